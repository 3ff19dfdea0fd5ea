"""scripts/bench_serving.py end to end on the tiny preset: a real pinned server, the bench client and
the engine-alone child, and the host share it reports is the arithmetic of what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench pins server and client to two cores")
def test_serving_bench_reports_the_host_share_of_a_served_step(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    out = tmp_path / "serving.json"
    cmd = [
        sys.executable, str(SCRIPT), "--model", "opt-tiny", "--concurrency", "4", "--requests", "8",
        "--input-len", "16", "--output-len", "24", "--reps", "2", "--engine-steps", "5",
        "--server-cpu", str(cores[0]), "--client-cpu", str(cores[1]), "--max-load", "1000", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    assert record["concurrency"] == 4 and len(record["reps"]) == 2
    for rep in record["reps"]:
        # full-batch decode steps were seen back to back, and the engine was timed
        assert rep["num_full_steps"] >= 2 and rep["interval_s"] > 0 and rep["engine_median_s"] > 0
        assert rep["host_share"] == pytest.approx(1 - rep["engine_median_s"] / rep["interval_s"])
        # the served steps' mean context lies between the prompt and the prompt + answer
        assert 16 <= rep["mean_ctx"] <= 16 + 24
        assert rep["output_tok_s"] > 0 and rep["tpot_median_s"] > 0
    assert record["host_share"] is not None
    assert "host share of a served step:" in done.stdout
