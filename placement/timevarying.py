"""Time-varying workloads: a daily cycle in arrival rate and length mix, or a recorded trace.

`DiurnalSpec` describes a day: the rate follows a cosine between `trough_rps` and `peak_rps`
(highest at `peak_hour`), and each request comes from the night mix (by default `longbench`, long
summarisation prompts with short outputs) with a probability that follows the opposite cosine between
`night_share_min` (at the peak hour) and `night_share_max` (twelve hours later), else from the day mix
(by default `sharegpt`, chat).

A day can be *compressed*: with `hour_s` < 3600 each hour of the cycle lasts `hour_s` seconds, and
rates stay per real second, so a compressed hour holds `hour_s / 3600` of the requests of a real one
at the same instantaneous load (what the serving system sees second by second is unchanged; only the
cycle is faster). Arrivals are a non-homogeneous Poisson process drawn by thinning.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from placement.workload import MAX_POSITIONS, Workload, get_length_distribution


@dataclasses.dataclass(frozen=True)
class DiurnalSpec:
    peak_rps: float = 64.0
    trough_rps: float = 12.0
    peak_hour: float = 14.0
    day_mix: str = "sharegpt"
    night_mix: str = "longbench"
    night_share_min: float = 0.05
    night_share_max: float = 0.7
    hours: int = 24

    def __post_init__(self) -> None:
        if not 0 < self.trough_rps <= self.peak_rps:
            raise ValueError("need 0 < trough_rps <= peak_rps")
        if not 0 <= self.night_share_min <= self.night_share_max <= 1:
            raise ValueError("need 0 <= night_share_min <= night_share_max <= 1")
        if self.hours < 1:
            raise ValueError("hours must be >= 1")

    def _day_weight(self, hour: np.ndarray | float) -> np.ndarray:
        """1 at the peak hour, 0 twelve hours away."""
        return (1 + np.cos(2 * math.pi * (np.asarray(hour, dtype=np.float64) - self.peak_hour) / 24)) / 2

    def rate_at(self, hour: np.ndarray | float) -> np.ndarray:
        return self.trough_rps + (self.peak_rps - self.trough_rps) * self._day_weight(hour)

    def night_share_at(self, hour: np.ndarray | float) -> np.ndarray:
        return self.night_share_max - (self.night_share_max - self.night_share_min) * self._day_weight(hour)


def generate_diurnal(
    spec: DiurnalSpec, hour_s: float, rng: np.random.Generator, max_positions: int = MAX_POSITIONS
) -> Workload:
    """One (possibly compressed) day of requests; `Workload.rate` is the day's mean rate."""
    if hour_s <= 0:
        raise ValueError("hour_s must be positive")
    day_s = spec.hours * hour_s
    n = rng.poisson(spec.peak_rps * day_s)
    candidates = np.sort(rng.uniform(0.0, day_s, size=n))
    hours = candidates / hour_s
    arrival_at = candidates[rng.uniform(size=n) < spec.rate_at(hours) / spec.peak_rps]
    hours = arrival_at / hour_s
    night = rng.uniform(size=len(arrival_at)) < spec.night_share_at(hours)
    day_in, day_out = get_length_distribution(spec.day_mix, max_positions).sample(rng, len(arrival_at))
    night_in, night_out = get_length_distribution(spec.night_mix, max_positions).sample(rng, len(arrival_at))
    return Workload(
        arrival_at,
        np.where(night, night_in, day_in),
        np.where(night, night_out, day_out),
        len(arrival_at) / day_s,
    )


def hour_of(workload: Workload, hour_s: float) -> np.ndarray:
    """The hour index of every request's arrival."""
    return np.floor(workload.arrival_at / hour_s).astype(np.int64)


def select(workload: Workload, mask: np.ndarray) -> Workload:
    """The requests where `mask` holds (arrival times kept; `rate` is their mean rate over their span)."""
    arrival_at = workload.arrival_at[mask]
    span = float(arrival_at[-1] - arrival_at[0]) if len(arrival_at) > 1 else 0.0
    rate = (len(arrival_at) - 1) / span if span > 0 else workload.rate
    return Workload(arrival_at, workload.input_lens[mask], workload.output_lens[mask], rate)
