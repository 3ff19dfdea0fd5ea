"""One decode call of up to N steps: the engine call an instance makes, and the step records it leaves.

A decode (or colocated) instance with `decode_steps_per_call = N > 1` hands a batch of pure decode
rows to `Engine.decode_steps` (N steps in one dispatch, sampling and stop checks on the
device) and gets each row's 1..N tokens back at once; a batch with a prompt row, an engine without
the capability (`multi_step_decode`), or N = 1 runs one `decode_step`. Semantics the instances keep (tests/test_runtime_multistep.py):

* every request's blocks for prompt + max_tokens are reserved at admission (`scheduling.admit_decodes`,
  `schedule_colocated`), so N steps never need a block the request does not hold — no policy change;
* a row that ends mid-call (EOS, a stop token id, max_tokens) ends on the device at exactly the token
  N = 1 would end on (sample index k of the call draws the same per-position key), and writes no
  more KV; its list is cut there;
* cancellation and stop strings (the front end cancels) take effect at the next call boundary, and a
  request whose pull finished (or that was admitted) joins at the next call boundary;
* each row's tokens are streamed as one chunk as soon as the call returns;
* a row that asks for logprobs gets one `TokenLogprobs` per token from the same call (the loop carries
  them on the device: `decode_steps_logprobs`); a call where no row asks computes none.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.runtime.engines.contract import (
    Engine,
    KVPages,
    RowLogprobs,
    StepBatch,
    StepRow,
    step_tokens,
    wants_logprobs,
)
from jaxserve.runtime.worker import StepRecord


def decode_call(
    engine: Engine, rows: tuple[StepRow, ...], pages: KVPages, num_steps: int
) -> tuple[list[list[int]], list[RowLogprobs], KVPages, bool]:
    """Run `rows` for up to `num_steps` steps: (each row's tokens, each row's logprobs (None where the row
    did not ask), the pool, whether it ran multi-step)."""
    logprobs = wants_logprobs(rows)
    caps = engine.capabilities
    multi = (
        num_steps > 1
        and caps.multi_step_decode
        and (not logprobs or caps.logprobs)
        and all(not r.is_prompt and len(r.token_ids) == 1 for r in rows)
    )
    if multi and logprobs:
        lists, lps, pages = engine.decode_steps_logprobs(StepBatch(rows), pages, num_steps)
        return lists, lps, pages, True
    if multi:
        lists, pages = engine.decode_steps(StepBatch(rows), pages, num_steps)
        return lists, [None] * len(rows), pages, True
    tokens, step_lps, pages = step_tokens(engine, StepBatch(rows), pages)
    return [[t] for t in tokens], [None if lp is None else (lp,) for lp in step_lps], pages, False


def decode_records(
    rows: Sequence[StepRow], lists: Sequence[Sequence[int]], seconds: float, at: float
) -> list[StepRecord]:
    """One "decode" record per step a multi-step call ran, the call's time split evenly over its steps.

    Step k's batch is the rows that produced a k-th token, each at position `start + k`, so the records
    (the profile fit, `/debug/steps`) read as single steps; a call of one step gives the one record
    a single step gives.
    """
    steps = max((len(x) for x in lists), default=1)
    records = []
    for k in range(max(steps, 1)):
        live = [r for r, x in zip(rows, lists, strict=True) if len(x) > k]
        ctx = sum(r.start_position + k for r in live)
        records.append(StepRecord("decode", seconds / steps, batch=len(live), ctx_sum=ctx, at=at))
    return records
