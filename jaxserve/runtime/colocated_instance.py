"""Colocated instance: both phases on one device set (the vLLM and Sarathi baselines).

Loop (one thread, `Worker` shell), each `step()`:

1. decide (under the lock): `scheduling.schedule_colocated` over every
   unfinished request in arrival order. Without a chunk size it is vLLM's rule
   (admit and prefill waiting prompts whenever they fit, up to `L_m` tokens,
   else decode every running sequence); with `chunk_size` it is Sarathi's
   (a budget of `chunk_size` tokens per step: one per running decode, the rest
   prompt chunks). The decision names the requests admitted now and the blocks
   each reserves (prompt + max_tokens); the instance allocates exactly those.
   A resumed request (moved here after tokens were streamed) prefills prompt +
   streamed tokens but the last, and its completing chunk's sample is discarded.
2. execute: one `engine.decode_step` whose rows are prompt chunks (several
   tokens, `is_prompt`) and decodes (one token), all written into the paged
   pool; one token is sampled per row. A decode-only step with
   `decode_steps_per_call = N > 1` and an engine with `multi_step_decode` runs up to N
   steps in one call (`runtime/multi_step.py`); requests admitted meanwhile
   wait for the call boundary.
3. apply (under the lock): a chunk that completes its prompt yields the first
   token (a partial chunk's sample is discarded); decode rows append a token;
   stop rules as on a decode instance; ended or cancelled requests free their
   blocks at once.

Prefix caching (`ColocatedConfig.prefix_policy.enabled`): the pool is run by a `PrefixCache`; an
admitted request pins its longest cached prefix and its prompt chunks start after it (the
policy's chunk is cut to the uncached part); a completed prompt's full blocks are named, and a
finished request names prompt + answer (but the last token) and unpins them.

Inputs: `enqueue()` from the controller. Outputs: tokens through `emit()`.
`load()` (dispatch) is `scheduling.colocated_load`, as in the simulator: a
partially prefilled request holds its blocks and counts as running.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.blocks import BlockAllocator
from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.request import FinishReason
from jaxserve.core.scheduling import (
    NO_PREFIX_CACHING,
    ColocatedRequest,
    PrefillLoad,
    PrefixPolicy,
    colocated_load,
    schedule_colocated,
)
from jaxserve.runtime.api import InstanceStats
from jaxserve.runtime.engines.contract import Engine, StepRow
from jaxserve.runtime.multi_step import decode_call, decode_records
from jaxserve.runtime.worker import Emitter, LiveRequest, StepRecord, Worker, now, pooled_stats


@dataclasses.dataclass(frozen=True)
class ColocatedConfig:
    """What a colocated instance reads of the limits: `num_kv_blocks` x `block_size` (its pool),
    `max_decode_batch` (running sequences), `max_batch_tokens` (L_m of prefill-priority steps) and
    `chunk_size` (set: Sarathi chunked prefill with piggybacked decodes; the controller puts the plan
    instance's own there)."""

    limits: ServingLimits = DEFAULT_LIMITS
    prefix_policy: PrefixPolicy = (
        NO_PREFIX_CACHING  # enabled: prompts start after their longest cached prefix in this pool
    )
    decode_steps_per_call: int = 1  # N > 1: decode-only steps run up to N steps per engine call


@dataclasses.dataclass(eq=False)
class _Seq:
    live: LiveRequest
    prefill_ids: tuple[int, ...] = ()  # fixed at enqueue: the prompt, or prompt + streamed tokens but the last
    resumed: bool = False
    num_prefilled: int = 0
    block_table: tuple[int, ...] | None = None

    @classmethod
    def of(cls, live: LiveRequest) -> _Seq:
        return cls(live, live.prefill_token_ids, live.is_resumed)

    def policy_view(self) -> ColocatedRequest:
        # A resumed request prefills more than its prompt; it reserves the same prompt + max_tokens.
        num_prefill = len(self.prefill_ids)
        return ColocatedRequest(
            request_id=self.live.request_id,
            num_prompt_tokens=num_prefill,
            max_new_tokens=self.live.num_prompt_tokens + self.live.max_tokens - num_prefill,
            num_prefilled=self.num_prefilled,
            admitted=self.block_table is not None,
        )


class ColocatedInstance(Worker):
    role = "colocated"

    def __init__(self, name: str, engine: Engine, config: ColocatedConfig, emitter: Emitter) -> None:
        super().__init__(name, emitter)
        self.engine = engine
        self.config = config
        num_blocks, block_size = config.limits.require_num_kv_blocks(), config.limits.block_size
        self.cache = PrefixCache(BlockAllocator(num_blocks, block_size), enabled=config.prefix_policy.enabled)
        self.allocator = self.cache.allocator
        self.pages = engine.init_pages(num_blocks, block_size)
        self._seqs: dict[str, _Seq] = {}  # arrival order

    # ---- controller side (thread-safe) --------------------------------------
    def enqueue(self, live: LiveRequest) -> None:
        with self.cond:
            if self.error is not None:
                raise self.dead_error()
            self._seqs[live.request_id] = _Seq.of(live)
            self.cond.notify_all()

    def num_cached_tokens(self, live: LiveRequest) -> int:
        """Prompt tokens of `live` this instance's cache would serve now (routing asks this)."""
        with self.cond:
            return self.cache.num_cached_tokens(live.prefill_token_ids, names=live.block_names(self.cache.block_size))

    def load(self) -> PrefillLoad:
        with self.cond:
            return colocated_load([s.policy_view() for s in self._seqs.values()])

    def stats(self) -> InstanceStats:
        with self.cond:
            running = sum(1 for s in self._seqs.values() if s.block_table is not None)
            return pooled_stats(
                "colocated", self.name, self.error is None, len(self._seqs) - running, running, self.cache
            )

    @property
    def num_waiting(self) -> int:
        with self.cond:
            return sum(1 for s in self._seqs.values() if s.block_table is None)

    @property
    def num_running(self) -> int:
        with self.cond:
            return sum(1 for s in self._seqs.values() if s.block_table is not None)

    def cancel(self, request_id: str) -> bool:
        with self.cond:
            if self._seqs.pop(request_id, None) is None:
                return False
            self.cache.release(request_id)
            self.cond.notify_all()
            return True

    # ---- worker --------------------------------------------------------------
    def _decide(self) -> tuple[StepRow, ...]:
        seqs = list(self._seqs.values())
        decision = schedule_colocated(
            [s.policy_view() for s in seqs],
            num_free_blocks=self.cache.num_available,
            block_size=self.config.limits.block_size,
            max_batch_size=self.config.limits.max_decode_batch,
            max_batch_tokens=self.config.limits.max_batch_tokens,
            chunk_size=self.config.limits.chunk_size,
        )
        for reservation in decision.admit:
            rid = reservation.request_id
            s = self._seqs[rid]
            hit = self.cache.acquire(
                rid,
                s.prefill_ids,
                reservation.num_blocks * self.config.limits.block_size,
                names=s.live.block_names(self.config.limits.block_size),
            )
            s.block_table, s.num_prefilled = hit.block_table, hit.num_cached_tokens
            if s.live.timings.prefill_start_at is None:
                s.live.timings.cached_prompt_tokens = hit.num_cached_tokens
        rows: list[StepRow] = []
        at = now()
        for chunk in decision.prefill:
            s = self._seqs[chunk.request_id]
            assert s.block_table is not None
            start = max(chunk.start, s.num_prefilled)  # a cache hit on admission skips the cached prefix
            if start >= chunk.start + chunk.num_tokens:
                continue
            if s.live.timings.prefill_start_at is None:
                s.live.timings.prefill_start_at = at
            prompt = s.prefill_ids
            rows.append(
                StepRow(
                    request_id=chunk.request_id,
                    token_ids=tuple(prompt[start : chunk.start + chunk.num_tokens]),
                    start_position=start,
                    block_table=s.block_table,
                    sampling=s.live.request.sampling,
                    seed=s.live.seed,
                    sample_index=0,
                    is_prompt=True,
                )
            )
        for rid in decision.decode:
            s = self._seqs[rid]
            assert s.block_table is not None
            if s.live.timings.decode_start_at is None:
                s.live.timings.decode_start_at = at
            rows.append(
                StepRow(
                    request_id=rid,
                    token_ids=(s.live.output_ids[-1],),
                    start_position=s.live.num_prompt_tokens + len(s.live.output_ids) - 1,
                    block_table=s.block_table,
                    sampling=s.live.request.sampling,
                    seed=s.live.seed,
                    sample_index=len(s.live.output_ids),
                )
            )
        return tuple(rows)

    def has_work(self) -> bool:
        return bool(self._seqs)

    def held_requests(self) -> list[LiveRequest]:
        return [s.live for s in self._seqs.values()]

    def drop_all(self) -> None:
        for rid in self._seqs:
            self.cache.release(rid)
        self._seqs.clear()

    def step(self) -> bool:
        decided_at = now()
        with self.cond:
            rows = self._decide()
            seqs = [self._seqs[r.request_id] for r in rows]
        if not rows:
            return False
        lists, logprobs, self.pages, multi = decode_call(
            self.engine, rows, self.pages, self.config.decode_steps_per_call
        )
        at = now()
        eos = self.engine.model_config.eos_token_ids
        emits: list[tuple[LiveRequest, tuple[int, ...], FinishReason | None]] = []
        with self.cond:
            for row, s, tokens, lps in zip(rows, seqs, lists, logprobs, strict=True):
                rid = row.request_id
                if self._seqs.get(rid) is not s:  # cancelled during the step
                    continue
                if row.is_prompt:
                    s.num_prefilled = row.start_position + len(row.token_ids)
                    if s.num_prefilled < len(s.prefill_ids):
                        continue
                    self.cache.commit(rid, s.prefill_ids, s.live.block_names(self.config.limits.block_size))
                    if s.resumed:  # its KV is rebuilt; the next token comes from a decode row
                        continue
                    s.live.timings.prefill_end_at = at
                    s.live.timings.prefill_instance = s.live.timings.decode_instance = self.name
                taken, finish = s.live.append_tokens(tokens, eos, at, lps)
                emits.append((s.live, taken, finish))
                if finish is not None:
                    del self._seqs[rid]
                    self.cache.commit(rid, *s.live.finished_blocks(self.config.limits.block_size))
                    self.cache.release(rid)
        for live, chunk, finish in emits:
            self.emitter.emit(live, chunk, finish)
        if multi:
            done = now()
            for record in decode_records(rows, lists, done - decided_at, done):
                self.record_step(record)
            return True
        whole = [
            r.start_position == 0 and len(r.token_ids) == len(s.prefill_ids) for r, s in zip(rows, seqs, strict=True)
        ]
        self.record_step(_step_record(rows, whole, decided_at, now()))
        return True


def _step_record(rows: tuple[StepRow, ...], whole: list[bool], decided_at: float, done: float) -> StepRecord:
    """A step of whole prompts is a prefill, a step of one-token rows a decode; anything else is mixed."""
    seconds = done - decided_at
    if all(r.is_prompt and w for r, w in zip(rows, whole, strict=True)):
        return StepRecord("prefill", seconds, prompt_lengths=tuple(len(r.token_ids) for r in rows), at=done)
    if not any(r.is_prompt for r in rows):
        return StepRecord("decode", seconds, batch=len(rows), ctx_sum=sum(r.start_position for r in rows), at=done)
    return StepRecord("mixed", seconds, batch=len(rows), at=done)
