"""The simulator predicts the real engine: `scripts/check_simulator.py` end to end, live.

Profiles opt-mini on this machine, serves a disaggregated (1 prefill + 1 decode device) and a
colocated (1 device) deployment for real, benches each at 4 rates spanning roughly 50–100 %
attainment, and simulates the same traces with the fitted profile. The paper reports its simulator
within 2 points of the real system; this asserts ≤ 5 points at every rate and ≤ 2 in the median.
Needs a quiet machine with independent cores: each XLA device pinned to a core of its own, and the
server and the bench client off those cores. On this project's 2-vCPU machines two single-core XLA
devices deliver only ~1.2-1.7x one device (measured by `check_simulator.py`'s scaling check) and the
client shares the devices' cores, so the engine runs up to ~2x slower than its profile predicts and the
check fails there (see the issue 6 note). It is skipped on machines with fewer than 4 cores rather than
loosened: the tolerance is the requirement.
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
    reason=f"needs >= {MIN_CORES} independent cores (one per device plus the client); 2-vCPU machines contend",
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
