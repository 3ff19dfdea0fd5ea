"""`jaxserve profile`'s fit on the real XLA engine predicts shapes it never timed (issue 12, the real-engine half).

`scripts/profile_fidelity.py` pins itself to one CPU with XLA single-threaded (as `jaxserve profile --cpus`),
times opt-mini's prefill and decode steps on a grid (the fastest of several runs, compile excluded, on the
process's CPU clock so the other tenants of a shared machine do not count), fits C1..C6 and the step
overhead, then times 20 shapes off the grid (other batch sizes, prompt lengths and contexts, some in
padded buckets the grid never ran) and predicts each with the simulator's step formula. Median relative
error ≤ 10 % and P90 ≤ 20 % over those shapes.

Marked `timing` (run it by hand on a quiet machine: `pytest -m timing`), not gated in `.ci/run`: the P90 sits
at the bound. Clean CI runs measured 12.7 % and 20.4 % (the short 1.6-3 ms decode steps come out ~20 % slower
than the fit predicts); until the model covers them, a CI gate on it would fail on noise about half the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timing
def test_profile_predicts_off_grid_shapes_of_the_real_engine(tmp_path: Path) -> None:
    out = tmp_path / "fidelity.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets the profile's flags
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, str(ROOT / "scripts" / "profile_fidelity.py"), "--no-colocated", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    table = done.stdout
    assert len(doc["rows"]) == 20 and {r["phase"] for r in doc["rows"]} == {"prefill", "decode"}
    (entry,) = doc["entries"]
    assert len(entry["step_overhead"]) == 3 and entry["step_overhead"][0] > 0  # a per-step host cost was fitted
    assert doc["median_rel_error"] <= 0.10, table
    assert doc["p90_rel_error"] <= 0.20, table
