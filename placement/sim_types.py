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


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """Knobs of the simulated engine: the serving limits (`jaxserve/core/limits.py`, the runtime's defaults) and the mode.

    Two limits may be left to the hardware model: `num_kv_blocks=None` gives each instance the KV its device
    memory holds, and `max_batch_tokens=None` takes the engine token cap from the profile (else the default).
    """

    block_size: int = DEFAULT_LIMITS.block_size  # paged KV block, tokens
    max_decode_batch: int = DEFAULT_LIMITS.max_decode_batch  # running sequences per decode / colocated instance
    # the engine token cap of a prefill step (prefill instances and colocated prefill priority); None: the
    # profile's cap for the instance, else DEFAULT_LIMITS.max_batch_tokens
    max_batch_tokens: int | None = None
    # KV blocks per decode / colocated instance; None: what the device memory holds (the simulator models a
    # device; the server, which does not, defaults to DEFAULT_LIMITS.num_kv_blocks — a plan file records the
    # number its simulation used and `serve --plan` applies it)
    num_kv_blocks: int | None = None
    # prefilled sequences a prefill instance holds until pulled (None: only the KV memory bounds it)
    prefill_buffer_slots: int | None = DEFAULT_LIMITS.prefill_buffer_slots
    mode: SimMode = "full"
    stop_early: bool = True  # only with an SloSpec

    @classmethod
    def from_limits(cls, limits: ServingLimits, **kwargs: object) -> SimOptions:
        """The simulated engine of a server run with `limits`."""
        return cls(
            block_size=limits.block_size,
            max_decode_batch=limits.max_decode_batch,
            max_batch_tokens=limits.max_batch_tokens,
            num_kv_blocks=limits.num_kv_blocks,
            prefill_buffer_slots=limits.prefill_buffer_slots,
            **kwargs,  # type: ignore[arg-type]
        )

    def limits(self, default_batch_tokens: int = DEFAULT_LIMITS.max_batch_tokens) -> ServingLimits:
        """The serving limits this simulation assumed (the token cap as given, else `default_batch_tokens`)."""
        return ServingLimits(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_decode_batch=self.max_decode_batch,
            max_batch_tokens=self.max_batch_tokens or default_batch_tokens,
            prefill_buffer_slots=self.prefill_buffer_slots or DEFAULT_LIMITS.prefill_buffer_slots,
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
