"""Goodput by bisection over arrival rates, against a live server.

DistServe's goodput is the highest request rate at which at least the target share of requests
attains the SLO. `sweep_rates` brackets it from a starting rate (doubling while the target holds,
halving while it does not) and then bisects geometrically until the bracket is within `rel_tol`.
Every probe replays the same requests (one base workload time-scaled to the probe's rate), so
probes differ only in rate. A measured attainment curve is noisy and need not be monotone; the
search reports the bracket it ended with and every probe, so a reader can see both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Probe:
    rate: float
    attainment: float


@dataclasses.dataclass(frozen=True)
class SweepResult:
    goodput: float  # highest passing rate found (0 when none passed)
    upper: float  # lowest failing rate found (inf when none failed)
    probes: tuple[Probe, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "goodput_rps": self.goodput,
            "first_failing_rps": self.upper if math.isfinite(self.upper) else None,
            "probes": [dataclasses.asdict(p) for p in self.probes],
        }


def sweep_rates(
    measure: Callable[[float], float],
    start_rate: float,
    target: float,
    *,
    rel_tol: float = 0.1,
    max_probes: int = 8,
) -> SweepResult:
    """Bracket and bisect the highest rate whose measured attainment is ≥ `target`.

    `measure(rate)` runs one probe and returns its attainment. At most `max_probes` probes run.
    """
    if start_rate <= 0 or not 0 < target <= 1 or max_probes < 1:
        raise ValueError("start_rate > 0, 0 < target <= 1 and max_probes >= 1 are required")
    probes: list[Probe] = []

    def ok(rate: float) -> bool:
        a = measure(rate)
        probes.append(Probe(rate, a))
        return a >= target

    lo, hi = 0.0, math.inf
    rate = start_rate
    if ok(rate):
        lo = rate
        while len(probes) < max_probes:
            rate *= 2
            if ok(rate):
                lo = rate
            else:
                hi = rate
                break
    else:
        hi = rate
        while len(probes) < max_probes:
            rate /= 2
            if ok(rate):
                lo = rate
                break
            hi = rate
    while lo > 0 and math.isfinite(hi) and hi > lo * (1 + rel_tol) and len(probes) < max_probes:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return SweepResult(lo, hi, tuple(probes))
