"""The dependency rule of docs/architecture.md, enforced on the import graph.

Every `import` in `jaxserve/`, `models/` and `placement/` is read statically (function-level imports
included: a lazy import is still an arrow). The layers, bottom up:

* the contract: `jaxserve.core` and `models.config`, pure Python; they import nothing else of ours;
* the planner (`placement`) imports only the contract; the model (`models`) only itself and the contract;
* the runtime (`jaxserve.runtime`) imports the contract and the model, never the planner;
* the serving layer (`jaxserve.serving`, the wire schema `jaxserve.proto`, the client, `jaxserve.llm`, the model
  registry) imports the runtime, never the planner;
* the tools wing (`jaxserve.tools`) is the one library place that imports both the runtime and the planner;
* the entry points (`jaxserve.cli`, `jaxserve.commands`) sit on top and may import anything.

No module imports a layer above its own, and the module graph has no circles. The map itself is checked too:
each module of the contract, the runtime, the commands and the tools is named in its part of the document.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "models", "placement")

# Layer name -> the layers it may import (itself included).
ALLOWED: dict[str, set[str]] = {
    "contract": {"contract"},
    "planner": {"contract", "planner"},
    "model": {"contract", "model"},
    "runtime": {"contract", "model", "runtime"},
    "serving": {"contract", "model", "runtime", "serving"},
    "testing": {"contract", "model", "runtime", "testing"},
    "tools": {"contract", "model", "runtime", "serving", "planner", "testing", "tools"},
    "entry": {"contract", "model", "runtime", "serving", "planner", "testing", "tools", "entry"},
}


def layer_of(module: str) -> str:
    if module == "models.config" or module == "jaxserve.core" or module.startswith("jaxserve.core."):
        return "contract"
    top = module.split(".")[0]
    if top == "placement":
        return "planner"
    if top == "models":
        return "model"
    parts = module.split(".")
    second = parts[1] if len(parts) > 1 else ""
    if second == "runtime":
        return "runtime"
    # the wire schema (`proto`) is the serving layer's boundary, read by the service and the client; the model
    # registry resolves a model argument for `LLM` and the entry points
    if second in ("serving", "client", "llm", "assets", "proto", "model_registry"):
        return "serving"
    if second == "testing":
        return "testing"
    if second == "tools":
        return "tools"
    if second in ("cli", "commands", "__main__", ""):
        return "entry"
    raise AssertionError(f"{module}: no layer; add it to docs/architecture.md and to this test")


def module_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    mod = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    mod = node.module or ""
                candidates = [mod, *(f"{mod}.{a.name}" for a in node.names)]
            else:
                continue
            for c in candidates:
                # `import a.b.c` or `from a.b import c`: the deepest module of ours that the name reaches.
                while c and c not in files:
                    c = c.rpartition(".")[0]
                if c and c != name:
                    targets.add(c)
        graph[name] = targets
    return graph


def test_every_module_has_a_layer() -> None:
    for name in module_files():
        layer_of(name)


def test_no_module_imports_a_layer_it_may_not() -> None:
    bad = [
        f"{src} ({layer_of(src)}) -> {dst} ({layer_of(dst)})"
        for src, dsts in sorted(import_graph().items())
        for dst in sorted(dsts)
        if layer_of(dst) not in ALLOWED[layer_of(src)]
    ]
    assert bad == [], "imports against docs/architecture.md's dependency rule:\n" + "\n".join(bad)


def test_the_module_graph_has_no_circles() -> None:
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == [], f"import circles: {circles}"


def test_the_rule_test_sees_real_arrows() -> None:
    # The checks above pass vacuously on an empty graph; a few arrows known to exist must be seen.
    graph = import_graph()
    assert "jaxserve.core.scheduling" in graph["placement.simulator"]
    assert "jaxserve.core.scheduling" in graph["jaxserve.runtime.prefill_instance"]
    assert any(d.startswith("placement.") for d in graph["jaxserve.tools.replan_loop"])
    assert any(d.startswith("jaxserve.runtime.") for d in graph["jaxserve.tools.replan_loop"])


def test_the_contract_and_the_planner_load_no_jax() -> None:
    """The planner runs where no accelerator stack is installed, and a planner process pool must not pay
    JAX's import per worker: the contract and every planner module import without JAX (checked in a fresh
    interpreter; this test process has JAX loaded already)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import jaxserve.core, placement, models.config\n"
        "for pkg in (jaxserve.core, placement):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'jaxlib'))\n"
        "sys.exit(f'JAX loaded: {bad[:5]}' if bad else 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_fit_reads_the_contracts_sample_types() -> None:
    # One definition of the measured step samples, in the contract; the planner's fit re-exports it.
    from jaxserve.core import step_samples
    from placement import profile_fit

    assert profile_fit.PrefillSample is step_samples.PrefillSample
    assert profile_fit.DecodeSample is step_samples.DecodeSample


def test_no_file_cites_a_document_outside_the_repository() -> None:
    hits = [
        str(p.relative_to(ROOT))
        for pkg in (*PACKAGES, "tests", "scripts", "docs")
        for p in (ROOT / pkg).rglob("*")
        if p.suffix in (".py", ".md", ".sh") and p != Path(__file__).resolve() and "DESIGN" + ".md" in p.read_text()
    ]
    assert hits == [], f"files citing DESIGN.md (not in this repository; the map is docs/architecture.md): {hits}"


# The parts of docs/architecture.md that map a folder, by their headings.
MAP_SECTIONS = {
    "jaxserve/core": "### `jaxserve/core/`",
    "jaxserve/runtime": "### `jaxserve/runtime/`",
    "jaxserve/tools": "### `jaxserve/tools/`",
    "jaxserve/commands": "### `jaxserve/cli.py`, `jaxserve/commands/`",
}


def test_the_map_names_every_module_of_the_contract_runtime_commands_and_tools() -> None:
    """A module added (or moved) without its line in the map is a room a newcomer cannot find: each module of
    these folders is named in its folder's part of docs/architecture.md (`name.py`, `name` or `name.attr`)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for folder, heading in MAP_SECTIONS.items():
        start = doc.index(heading)
        ends = [i for i in (doc.find("\n### ", start + 1), doc.find("\n## ", start + 1)) if i != -1]
        section = doc[start : min(ends)]
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name != "__init__.py" and not re.search(rf"`{re.escape(path.stem)}[`.]", section):
                missing.append(str(path.relative_to(ROOT)))
    assert missing == [], f"modules docs/architecture.md does not name where their folder is mapped: {missing}"
