"""The runtime never imports the planner: every `jaxserve.runtime` module loads without `placement`.

Checked in a fresh interpreter (this test process has imported the planner already); it fails if a runtime
module — `step_timing.py` included, which once took its sample types from `placement.profile_fit` —
pulls in any `placement` module, directly or through another import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib, pkgutil, sys
import jaxserve.runtime
names = [m.name for m in pkgutil.walk_packages(jaxserve.runtime.__path__, "jaxserve.runtime.")]
assert "jaxserve.runtime.step_timing" in names and "jaxserve.runtime.step_samples" in names, names
bad = {}
for name in names:
    before = set(sys.modules)
    importlib.import_module(name)
    new = sorted(m for m in set(sys.modules) - before if m == "placement" or m.startswith("placement."))
    if new:
        bad[name] = new
print(bad)
sys.exit(1 if bad else 0)
"""


def test_no_runtime_module_imports_the_planner() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"runtime modules that import the planner: {done.stdout}{done.stderr}"


def test_the_fit_reads_the_runtime_sample_types() -> None:
    # One definition of the measured samples, on the runtime side; the planner's fit re-exports it.
    from jaxserve.runtime import step_samples
    from placement import profile_fit

    assert profile_fit.PrefillSample is step_samples.PrefillSample
    assert profile_fit.DecodeSample is step_samples.DecodeSample


def test_the_simulators_load_no_device_runtime() -> None:
    """The simulators (plain and prefix-caching) share the runtime's pure pieces (block allocator, prefix
    cache, scheduling policies) but never load JAX: `placement` runs on a machine without accelerators' stacks
    warm, and a planner process pool must not pay JAX's import per worker."""
    code = (
        "import sys; import placement.simulator, placement.prefix_sim, placement.planner; "
        "sys.exit(1 if 'jax' in sys.modules else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
