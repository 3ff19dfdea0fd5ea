"""What a simulation takes and gives: engine knobs (`SimOptions`) and per-request results (`SimResult`).

Kept apart from the event loop in `placement/simulator.py`, which re-exports both names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from placement.slo import SloSpec

SimMode = Literal["full", "prefill", "decode"]
PHASES = ("prefill_queue", "prefill", "transfer", "decode_queue", "decode")


# The planner's engine: the serving defaults, but with the KV blocks left to the modelled device's memory.
PLANNER_LIMITS = dataclasses.replace(DEFAULT_LIMITS, num_kv_blocks=None)


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """The simulated engine: the serving limits it runs with (`jaxserve/core/limits.py`, the runtime's own
    knobs, composed whole) and how the simulation runs.

    Three limits may be left to the hardware model and the profile: `limits.num_kv_blocks=None` gives each
    instance the KV its device memory holds, `profile_token_cap` takes the engine token cap of a prefill step
    from the profile (its cap for the instance's engine and tp, when it has one) instead of
    `limits.max_batch_tokens`, and `profile_decode_batch` the running-sequence cap of a decode / colocated
    instance from the profile's engine limits instead of `limits.max_decode_batch`.
    """

    limits: ServingLimits = PLANNER_LIMITS
    # a prefill step's token cap from the profile when it has one (the planner's default); False: the limits'
    profile_token_cap: bool = True
    # a decode / colocated instance's running-sequence cap from the profile's engine limits when it has them
    # (what `jaxserve plan` / `simulate` do without --max-decode-batch: plan for the engines the profile
    # measured); False, the library's default: `limits.max_decode_batch`, the serving engine's cap
    profile_decode_batch: bool = False
    # False: a prefill instance holds prefilled sequences until its KV memory is full, whatever
    # `limits.prefill_buffer_slots` says (a bound the simulator tests take away)
    bounded_prefill_buffer: bool = True
    mode: SimMode = "full"
    stop_early: bool = True  # only with an SloSpec

    @classmethod
    def planning(cls, mode: SimMode = "full", stop_early: bool = True, **changes: int | None) -> SimOptions:
        """The planner's engine (`PLANNER_LIMITS`) with some limits changed; a `max_batch_tokens` given
        replaces the profile's token cap."""
        limits = dataclasses.replace(PLANNER_LIMITS, **changes)  # type: ignore[arg-type]
        return cls(
            limits,
            profile_token_cap="max_batch_tokens" not in changes,
            mode=mode,
            stop_early=stop_early,
        )

    @classmethod
    def from_limits(cls, limits: ServingLimits, mode: SimMode = "full", stop_early: bool = True) -> SimOptions:
        """The simulated engine of a server run with `limits` (its caps as given, never the profile's)."""
        return cls(limits, profile_token_cap=False, profile_decode_batch=False, mode=mode, stop_early=stop_early)

    def token_cap(self, profile_cap: int | None) -> int:
        """A prefill step's token cap on an instance whose profile says `profile_cap` (None: it says none)."""
        if self.profile_token_cap and profile_cap is not None:
            return profile_cap
        return self.limits.max_batch_tokens

    def decode_batch_cap(self, profile_cap: int | None) -> int:
        """Running sequences per decode / colocated instance when the profile's engine ran with `profile_cap`."""
        if self.profile_decode_batch and profile_cap is not None:
            return profile_cap
        return self.limits.max_decode_batch

    def served_limits(self, token_cap: int, decode_batch: int | None = None) -> ServingLimits:
        """The serving limits this simulation assumed, with the token cap it charged (`token_cap`) and the decode
        batch cap it applied (`decode_batch`; None: the limits')."""
        return dataclasses.replace(
            self.limits, max_batch_tokens=token_cap, max_decode_batch=decode_batch or self.limits.max_decode_batch
        )


@dataclasses.dataclass
class SimResult:
    """Per-request timestamps (seconds; NaN where the run stopped before they happened)."""

    arrival_at: np.ndarray
    output_lens: np.ndarray
    prefill_start_at: np.ndarray
    first_token_at: np.ndarray
    transfer_start_at: np.ndarray
    transfer_end_at: np.ndarray
    decode_start_at: np.ndarray
    finish_at: np.ndarray
    verdict: bool | None = None
    num_events: int = 0

    @property
    def finished(self) -> np.ndarray:
        return ~np.isnan(self.finish_at)

    @property
    def num_finished(self) -> int:
        return int(self.finished.sum())

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_at - self.arrival_at

    @property
    def tpot_s(self) -> np.ndarray:
        steps = np.maximum(self.output_lens - 1, 1)
        tpot = (self.finish_at - self.first_token_at) / steps
        return np.where(self.output_lens > 1, tpot, np.where(self.finished, 0.0, np.nan))

    def phases(self) -> dict[str, np.ndarray]:
        """Per-request seconds in each phase (colocated: transfer and decode queue are 0)."""
        return {
            "prefill_queue": self.prefill_start_at - self.arrival_at,
            "prefill": self.first_token_at - self.prefill_start_at,
            "transfer": self.transfer_end_at - self.transfer_start_at,
            "decode_queue": (self.transfer_start_at - self.first_token_at)
            + (self.decode_start_at - self.transfer_end_at),
            "decode": self.finish_at - self.decode_start_at,
        }

    def attainment(self, slo: SloSpec) -> float:
        """Share attaining the SLO over all requests (unfinished ones count as misses)."""
        from placement.slo import attainment

        ttft = np.nan_to_num(self.ttft_s, nan=math.inf)
        tpot = np.nan_to_num(self.tpot_s, nan=math.inf)
        return attainment(ttft, tpot, slo)

    def summary(self, slo: SloSpec | None = None) -> dict[str, float]:
        """Percentiles of TTFT/TPOT and mean phase times over the finished requests."""
        done = self.finished
        out: dict[str, float] = {"num_requests": float(len(self.arrival_at)), "num_finished": float(done.sum())}
        if slo is not None:
            out["attainment"] = self.attainment(slo)
        if not done.any():
            return out
        for name, values in (("ttft_s", self.ttft_s[done]), ("tpot_s", self.tpot_s[done])):
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = float(np.percentile(values, q))
            out[f"{name}_mean"] = float(values.mean())
        for name, values in self.phases().items():
            out[f"{name}_mean_s"] = float(np.nanmean(values[done])) if np.any(~np.isnan(values[done])) else 0.0
        return out
