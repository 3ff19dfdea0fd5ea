"""What a simulation takes and gives: engine knobs (`SimOptions`) and per-request results (`SimResult`).

Kept apart from the event loop in `placement/simulator.py`, which re-exports both names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

from jaxserve.scheduling import DEFAULT_PREFILL_BUFFER_SLOTS
from placement.slo import SloSpec

SimMode = Literal["full", "prefill", "decode"]
PHASES = ("prefill_queue", "prefill", "transfer", "decode_queue", "decode")


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """Knobs of the simulated engine (defaults follow the runtime's)."""

    block_size: int = 16  # paged KV block, tokens
    max_decode_batch: int = 256  # running sequences per decode / colocated instance
    # colocated prefill-priority step budget; None: the profile's L_m for the instance (as for prefill
    # instances), which is 512 — the runtime's --max-batch-tokens default — without a profile
    colocated_batch_tokens: int | None = None
    # prefilled sequences a prefill instance holds until pulled (the runtime's bound; None: only the
    # KV memory bounds the buffer)
    prefill_buffer_slots: int | None = DEFAULT_PREFILL_BUFFER_SLOTS
    mode: SimMode = "full"
    stop_early: bool = True  # only with an SloSpec


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
