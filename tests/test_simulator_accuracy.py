"""The simulator predicts the real engine: `scripts/check_simulator.py` end to end, live.

Profiles opt-mini on this machine (each deployment's engines on the cores it will be served on),
serves a disaggregated (1 prefill + 1 decode device) and a colocated (1 device) deployment for real,
each pinned to as many cores as it has devices with the bench client on the others, benches each at
4 rates spanning roughly 50–100 % attainment, and simulates the same traces with the fitted profile
(padded shapes). The paper reports its simulator within 2 points of the real system; this asserts
≤ 5 points at every rate and ≤ 2 in the median.

It is skipped below 4 cores rather than loosened (the tolerance is the requirement). On this
project's 2-vCPU machines the disaggregated server gets both cores and shares them with the client,
and its two devices share one XLA thread pool; and the small-batch decode step the TPOT SLO hangs on
varies by up to ~50 % between two back-to-back profiles of the same pinned core. Measured there
(issue 6 note): colocated within 1.7 points at all 4 rates in one run, 2.5–28 points in another;
disaggregated 0–47 points.
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


@pytest.mark.slow
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
