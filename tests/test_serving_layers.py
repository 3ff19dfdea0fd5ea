"""Dependency rule (DESIGN.md): tools may import the planner, the runtime package may not.

The load generator (`jaxserve_bench`) replays planner workloads, so it lives beside
`jaxserve/`, not in it; the serving layer, the client and the wire schema import
nothing from `placement`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_the_load_generator_is_not_in_the_runtime_package():
    assert not (ROOT / "jaxserve" / "bench").exists()
    assert (ROOT / "jaxserve_bench" / "loadgen.py").is_file()


def test_serving_client_and_wire_do_not_import_the_planner():
    files = [*sorted((ROOT / "jaxserve" / "serving").glob("*.py")), ROOT / "jaxserve" / "client.py"]
    offenders = {str(f.relative_to(ROOT)): m for f in files for m in _imports(f) if m.split(".")[0] == "placement"}
    assert offenders == {}


def test_jaxserve_bench_command_still_works(capsys):
    from jaxserve.cli import main

    try:
        main(["bench", "--help"])
    except SystemExit as e:
        assert e.code == 0
    assert "--workload" in capsys.readouterr().out
