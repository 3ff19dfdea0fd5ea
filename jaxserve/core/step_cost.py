"""The step-cost contract: seconds of one engine step of a given shape on one instance.

The simulator charges every step through it, and the timed engine (`jaxserve.runtime.engines.timed`) sleeps
exactly what it says, so a server on the timed engine runs the simulator's timeline. The planner implements it
(`placement.step_time.ModelStepCost`: the latency model's kernels plus the profile's per-step host overhead);
the runtime only reads it, so the engine needs no planner import. One formula, two users.

Shapes are plain numbers: prompt `lengths` of a prefill batch; a decode round of `batch` rows attending over
`ctx_sum` tokens in all; a mixed (colocated) step of prompt `chunks` after `priors` done tokens each, with
`decode_batch` decodes riding along over `decode_ctx_sum`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class PrefillPipe:
    """A prefill batch's time split over a `pp`-stage pipe: each stage's kernels, one inter-stage send, and
    the step's host work (on the first stage). Alone the batch takes `pp · stage + (pp − 1) · send + host`
    (`StepCost.prefill_s`); a pipelined prefill instance overlaps the next batch once stage 0 frees."""

    stage_s: float
    send_s: float  # 0 when pp == 1
    host_s: float


class StepCost(Protocol):
    """Seconds of each engine step of one instance (its model, tp and pp)."""

    @property
    def pp(self) -> int: ...

    def prefill_s(self, lengths: Sequence[int]) -> float:
        """A prefill batch of prompts of these lengths through the whole pipe."""
        ...

    def prefill_pipe(self, lengths: Sequence[int]) -> PrefillPipe:
        """The same batch stage by stage (what a pipelined prefill schedules)."""
        ...

    def decode_s(self, batch: int, ctx_sum: float) -> float:
        """A decode round of `batch` one-token rows over `ctx_sum` context tokens in all (0 for no rows)."""
        ...

    def mixed_s(self, chunks: Sequence[int], priors: Sequence[int], decode_batch: int, decode_ctx_sum: float) -> float:
        """A colocated step: prompt chunks (possibly none: then a decode round) with decodes riding along."""
        ...


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """Seconds of a KV pull over the link into an instance: `latency_s + num_tokens · s_per_token`."""

    latency_s: float = 0.0
    s_per_token: float = 0.0

    def transfer_s(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.s_per_token
