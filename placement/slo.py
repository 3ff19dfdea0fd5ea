"""Latency SLOs and attainment: which requests count toward goodput.

Two forms:

* `joint` (default, the paper's goodput): a request attains its SLO when TTFT ≤ ttft_s **and**
  TPOT ≤ tpot_s; the deployment meets the target when that share is ≥ `attainment`.
* `p90` (per metric, as in the paper's Figure 1): the share with TTFT ≤ ttft_s and, separately, the
  share with TPOT ≤ tpot_s must each be ≥ `attainment` (with attainment 0.9 this is "P90 TTFT ≤ ttft_s
  and P90 TPOT ≤ tpot_s", the percentile taken as the smallest value covering 90 % of requests).

`ttft_s` or `tpot_s` may be `math.inf` to judge one phase alone (prefill-only / decode-only searches).
TPOT = (last token time − first token time) / (output tokens − 1); a one-token request has TPOT 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

SloMode = Literal["joint", "p90"]


@dataclasses.dataclass(frozen=True)
class SloSpec:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9
    mode: SloMode = "joint"

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("SLOs must be positive")
        if self.mode not in ("joint", "p90"):
            raise ValueError(f"SLO mode must be joint or p90, got {self.mode!r}")

    def scaled(self, scale: float) -> SloSpec:
        """Both SLOs multiplied by `scale` (smaller is tighter)."""
        return dataclasses.replace(self, ttft_s=self.ttft_s * scale, tpot_s=self.tpot_s * scale)

    def required(self, num_requests: int) -> int:
        """How many requests (per metric in p90 mode) must attain for the target to hold."""
        return math.ceil(self.attainment * num_requests - 1e-9)


def attainment(ttft_s: np.ndarray, tpot_s: np.ndarray, slo: SloSpec) -> float:
    """The attainment figure: joint share, or in p90 mode the smaller of the two per-metric shares."""
    if len(ttft_s) == 0:
        return 0.0
    ttft_ok = ttft_s <= slo.ttft_s
    tpot_ok = tpot_s <= slo.tpot_s
    if slo.mode == "joint":
        return float(np.mean(ttft_ok & tpot_ok))
    return float(min(np.mean(ttft_ok), np.mean(tpot_ok)))


class VerdictTracker:
    """Counts requests as they are judged; says when the verdict can no longer change."""

    def __init__(self, num_requests: int, slo: SloSpec) -> None:
        self.slo = slo
        self.need = slo.required(num_requests)
        self.allowed_misses = num_requests - self.need
        # joint: one counter pair; p90: one pair per metric.
        self.good = [0, 0]
        self.bad = [0, 0]
        self._verdict: bool | None = None
        self._update()  # a target of 0 requests is met at once

    def record_ttft(self, ok: bool) -> None:
        if self.slo.mode == "p90":
            self._count(0, ok)
        elif not ok:
            self.bad[0] += 1
            self._update()

    def record_done(self, ttft_ok: bool, tpot_ok: bool) -> None:
        """A finished request: joint mode counts it once; p90 counts its TPOT (TTFT came at first token)."""
        if self.slo.mode == "p90":
            self._count(1, tpot_ok)
        elif ttft_ok:
            self._count(0, tpot_ok)

    def _count(self, metric: int, ok: bool) -> None:
        if ok:
            self.good[metric] += 1
        else:
            self.bad[metric] += 1
        self._update()

    def _update(self) -> None:
        metrics = (0, 1) if self.slo.mode == "p90" else (0,)
        if any(self.bad[m] > self.allowed_misses for m in metrics):
            self._verdict = False
        elif all(self.good[m] >= self.need for m in metrics):
            self._verdict = True

    def verdict(self) -> bool | None:
        """True/False once certain, None while open."""
        return self._verdict
