"""Seconds of one engine step of a given shape: the one formula the simulator and the timed engine share.

A step's time is the latency model's kernel time for its shape (`placement/latency.py`) plus the profile's
per-step host overhead (`StepOverhead`):

* prefill batch of prompt `lengths` on a `pp`-stage instance, run through the whole pipe:
  `pp · stage(Σl, Σl², B) + (pp − 1) · send(Σl) + overhead(Σl, prefill)`;
* decode round of `batch` rows attending over `ctx_sum` tokens: `pipeline_decode_round_s + overhead(ctx_sum)`;
* mixed (colocated) step of prompt chunks `chunks` after `priors` done tokens, plus `decode_batch` decodes over
  `decode_ctx_sum`: `pp · chunk_stage + (pp − 1) · send + overhead(decode_ctx_sum + Σ(chunk + prior), prefill)`.

`ModelStepCost` binds them to one instance's model as the runtime's step-cost contract
(`jaxserve.core.step_cost.StepCost`): what the timed engine sleeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jaxserve.core.step_cost import PrefillPipe
from placement.latency import StageLatency, StepOverhead, pipeline_decode_round_s


def prefill_step_s(model: StageLatency, overhead: StepOverhead, lengths: Sequence[int]) -> float:
    total = float(sum(lengths))
    sum_sq = float(sum(n * n for n in lengths))
    stage = model.prefill_stage_s(total, sum_sq, len(lengths))
    send = (model.pp - 1) * model.send_s(int(total)) if model.pp > 1 else 0.0
    return model.pp * stage + send + overhead.step_s(total, model.pp, True)


def decode_step_s(model: StageLatency, overhead: StepOverhead, batch: int, ctx_sum: float) -> float:
    if batch == 0:
        return 0.0
    return pipeline_decode_round_s(model, batch, ctx_sum) + overhead.step_s(ctx_sum, model.pp, False)


def decode_round_fn(model: StageLatency, overhead: StepOverhead, batch: int) -> Callable[[float], float]:
    """`decode_step_s(model, overhead, batch, ·)` with what does not depend on the context computed once
    (the same arithmetic, so the same seconds): for a caller charging many rounds of one batch size."""
    if batch == 0:
        return lambda ctx_sum: 0.0
    pp = model.pp
    k = min(batch, pp)
    micro = -(-batch // k)  # the largest micro-batch (`pipeline_decode_round_s`)
    make = getattr(model, "decode_stage_fn", None)
    stage: Callable[[float], float] = (
        make(micro) if make is not None else lambda ctx_sum: model.decode_stage_s(micro, ctx_sum)
    )
    if pp == 1:
        return lambda ctx_sum: stage(ctx_sum) + overhead.step_s(ctx_sum, 1, False)
    send = model.send_s(micro)
    return lambda ctx_sum: pp * (stage(ctx_sum * micro / batch) + send) + overhead.step_s(ctx_sum, pp, False)


def mixed_step_s(
    model: StageLatency,
    overhead: StepOverhead,
    chunks: Sequence[int],
    priors: Sequence[int],
    decode_batch: int,
    decode_ctx_sum: float,
) -> float:
    """A colocated step: prompt chunks (possibly none) with decodes riding along."""
    if not chunks:
        return decode_step_s(model, overhead, decode_batch, decode_ctx_sum)
    num_tokens = float(sum(chunks))
    sum_sq = float(sum(c * (c + 2 * p) for c, p in zip(chunks, priors, strict=True)))
    stage = model.chunk_stage_s(num_tokens, sum_sq, len(chunks), decode_batch, decode_ctx_sum)
    send = (model.pp - 1) * model.send_s(int(num_tokens) + decode_batch) if model.pp > 1 else 0.0
    prompt_ctx = float(sum(c + p for c, p in zip(chunks, priors, strict=True)))
    return model.pp * stage + send + overhead.step_s(decode_ctx_sum + prompt_ctx, model.pp, True)


@dataclasses.dataclass(frozen=True)
class ModelStepCost:
    """The step-cost contract (`jaxserve.core.step_cost.StepCost`) of one instance: these formulas on its
    latency model and step overhead — what the timed engine sleeps, so it runs the simulator's timeline."""

    model: StageLatency
    overhead: StepOverhead

    @property
    def pp(self) -> int:
        return self.model.pp

    def prefill_s(self, lengths: Sequence[int]) -> float:
        return prefill_step_s(self.model, self.overhead, lengths)

    def prefill_pipe(self, lengths: Sequence[int]) -> PrefillPipe:
        total = float(sum(lengths))
        stage = self.model.prefill_stage_s(total, float(sum(n * n for n in lengths)), len(lengths))
        send = self.model.send_s(int(total)) if self.model.pp > 1 else 0.0
        return PrefillPipe(stage, send, self.overhead.step_s(total, self.model.pp, True))

    def decode_s(self, batch: int, ctx_sum: float) -> float:
        return decode_step_s(self.model, self.overhead, batch, ctx_sum)

    def mixed_s(self, chunks: Sequence[int], priors: Sequence[int], decode_batch: int, decode_ctx_sum: float) -> float:
        return mixed_step_s(self.model, self.overhead, chunks, priors, decode_batch, decode_ctx_sum)
