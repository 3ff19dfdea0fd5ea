"""Measured step times: what `step_timing.py` produces and the planner's fit (`placement/profile_fit.py`) reads.

Plain data, no JAX and no planner import: the runtime never imports `placement/`, so the contract between
timing the engine and fitting the latency model lives on the runtime side and the planner imports it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PrefillSample:
    lengths: tuple[int, ...]  # prompt lengths in the batch
    seconds: float


@dataclasses.dataclass(frozen=True)
class DecodeSample:
    batch: int
    ctx_sum: int  # Σ context tokens the step attends over
    seconds: float
