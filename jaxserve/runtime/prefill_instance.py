"""Prefill instance: prompts in, first tokens and buffered KV out.

Loop (one thread, `Worker` shell), each `step()`:

1. decide (under the lock), when the engine can take a batch: `scheduling.form_prefill_batch` takes
   prompts from the head of the FCFS queue up to `L_m` tokens, and never more than the free slots of
   the KV buffer (batches in flight hold slots too). A full buffer means an empty batch: the instance
   stops taking work until a decode instance pulls something (backpressure).
2. dispatch: `start_prefill` hands the batch to the engine (padded to length buckets, so it compiles
   once per bucket, not per prompt length). An engine with `async_prefill` returns at once with a handle;
   a watcher thread per batch waits on it and wakes the loop twice: when the batch has left the first
   pipeline stage, and when its first tokens are back. The next batch is decided and dispatched as
   soon as the first stage is free, so a pp-stage instance pipelines batches (stage 0 runs batch k+1
   while later stages run batch k), which is the simulator's prefill pipe. An engine without it
   (the Ray proxy) runs the batch in the call: one batch at a time. A resumed request (moved after
   tokens were streamed) prefills prompt + streamed tokens but the last (`LiveRequest.prefill_token_ids`).
3. apply (under the lock), oldest batch first, once its result is back: record timings, emit each
   first token; a request that is already finished (max_tokens 1, EOS) ends here; a resumed request
   emits nothing (its sample is discarded); every other one's KV goes into the buffer and the
   controller is told (`on_prefilled`) so it can assign a decode instance. A request cancelled
   meanwhile is dropped here. An engine failure reported by a watcher is raised here, so the
   `Worker` shell's failure path (hand every held request back) runs on the loop's thread.

Prefix caching (`PrefillConfig.prefix_policy.enabled`): the instance keeps a paged pool under a
`PrefixCache`. Each batch member pins its longest cached prefix and fresh blocks for the rest (`acquire` in
decide; a pool too full leaves it queued). A batch where no member hits runs exactly as without caching (the
dense prefill, pipelined over pp stages like any other batch); apply then writes each prompt's KV into its
blocks (`Engine.insert`, the decode side's write). A batch with a hit runs only the uncached suffixes as prompt
rows of the engine's paged step (`StepRow(is_prompt=True)`, as colocated chunked prefill does), in the call, and
gathers each prompt's whole KV from the pool into a dense copy for the buffer (`kv_pool.read_sequence`). Either
way apply names the prompt's full blocks (`commit`) and unpins them (`release`): blocks are pinned only while
their batch is in flight, the buffer and the pull path are the same as without caching, and the pool is touched
by this thread alone. While the engine's background warm-up still compiles a program this needs, the batch takes
a path without it: a hit batch whose paged bucket or gather is not in is prefilled densely, and a prompt whose
insert is not in is not written into the pool (its blocks are released unnamed: not cached). A prompt identical
to one in flight waits for it (and then finds its blocks cached). An
engine whose pool lives elsewhere (`paged_prefill`, a Ray actor) always takes the paged step. Needs an engine
with a paged pool (`decode` + `dense_insert`, or `paged_prefill`).

Inputs: `enqueue()` from the controller. Outputs: `emit()` of first tokens, the
buffer read by decode instances through `get()`, freed by `release()` once the
KV is pulled (or by `cancel()`); `holds_kv()` tells a lease keeper (Ray) which
KVs are still wanted (the batch being handed over or the buffer, read under one
lock, so the hand-over is atomic). Only the lock is ever waited on; the engine
calls and waits run outside it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

from jaxserve.core.blocks import BlockAllocator, OutOfBlocksError
from jaxserve.core.errors import EngineDeadError
from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.prefix_cache import CacheHit, PrefixCache, cache_stats
from jaxserve.core.request import FinishReason
from jaxserve.core.scheduling import (
    NO_PREFIX_CACHING,
    PrefillLoad,
    PrefixPolicy,
    WaitingPrompt,
    form_prefill_batch,
    prefill_buffer_free_slots,
    prompts_to_defer,
)
from jaxserve.runtime.api import InstanceStats
from jaxserve.runtime.engines.contract import (
    Engine,
    HeldKV,
    PrefilledSequence,
    PrefillHandle,
    PrefillItem,
    PrefillResult,
    ReadyPrefill,
    StepBatch,
    StepRow,
    bucket,
    start_prefill,
    step_tokens,
)
from jaxserve.runtime.kv_pool import read_sequence
from jaxserve.runtime.worker import Emitter, LiveRequest, StepRecord, Worker, now


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """What a prefill instance reads of the limits: `max_batch_tokens` (prompt tokens per batch; a longer prompt
    runs alone), `prefill_buffer_slots` (prefilled sequences held here until pulled) and, with prefix caching,
    `num_kv_blocks` x `block_size` (its paged pool: the controller puts `prefill_num_kv_blocks` there)."""

    limits: ServingLimits = DEFAULT_LIMITS
    prefix_policy: PrefixPolicy = (
        NO_PREFIX_CACHING  # enabled: keep prompts' KV in a paged pool and compute only uncached suffixes
    )


MIN_PROMPT_BUCKET = 16  # dense copies are padded like the engine's prefill output


@dataclasses.dataclass(eq=False)
class _Flight:
    """A batch handed to the engine and not yet handed over; its watcher fills in the last four fields."""

    batch: list[LiveRequest]
    items: list[PrefillItem]
    hits: dict[str, CacheHit]
    decided_at: float
    started_at: float = 0.0
    dense: bool = False  # with caching: run by the dense prefill, its KV written into the pool in apply
    stage_free: bool = False  # the batch has left the engine's first stage
    result: PrefillResult | None = None
    error: BaseException | None = None
    ended_at: float = 0.0  # when the result was back


class PrefillInstance(Worker):
    role = "prefill"

    def __init__(
        self,
        name: str,
        engine: Engine,
        config: PrefillConfig,
        emitter: Emitter,
        on_prefilled: Callable[[PrefillInstance, LiveRequest], None],
    ) -> None:
        super().__init__(name, emitter)
        self.engine = engine
        self.config = config
        self._on_prefilled = on_prefilled
        self._queue: collections.deque[LiveRequest] = collections.deque()
        self._inflight: collections.deque[_Flight] = collections.deque()  # dispatched batches, oldest first
        self._pipelined = engine.capabilities.async_prefill
        self._buffer: dict[str, tuple[LiveRequest, PrefilledSequence]] = {}
        self.max_buffer_used = 0  # high-water mark, for tests and stats
        limits = config.limits
        num_blocks = limits.require_num_kv_blocks()
        self.cache = PrefixCache(BlockAllocator(num_blocks, limits.block_size), enabled=config.prefix_policy.enabled)
        self._paged: Engine | None = None
        self._dense_misses = False
        if config.prefix_policy.enabled:
            if not (engine.capabilities.decode or engine.capabilities.paged_prefill):
                raise TypeError(
                    f"prefix caching on a prefill instance needs an engine with a paged pool; "
                    f"{type(engine).__name__} has none"
                )
            self._paged = engine
            # Batches with no cache hit take the dense prefill (pipelined) and are written into the pool after.
            self._dense_misses = engine.capabilities.dense_insert and not engine.capabilities.paged_prefill
            self.pages = engine.init_pages(num_blocks, limits.block_size)
        self.num_computed_tokens = 0  # prompt tokens this instance really computed (cached ones excluded)

    @property
    def _running(self) -> list[LiveRequest]:
        """Under the lock: every request in a batch in flight (dispatched, not yet handed over)."""
        return [live for f in self._inflight for live in f.batch]

    # ---- controller / decode side (thread-safe) -----------------------------
    def enqueue(self, live: LiveRequest) -> None:
        """Queue `live`. Raises EngineDeadError when this instance is dead, or when `live` is a resumed request
        (prompt + streamed tokens) longer than this caching instance's own KV pool: it could never be acquired
        and would block the FCFS queue behind it forever (admission checked the prompt alone)."""
        pool_tokens = self.cache.num_blocks * self.cache.block_size if self._paged is not None else None
        if pool_tokens is not None and live.num_prefill_tokens > pool_tokens:
            raise EngineDeadError(
                f"request {live.request_id!r} cannot be resumed: its prompt and streamed tokens "
                f"({live.num_prefill_tokens}) exceed the prefill instance's KV pool ({pool_tokens} tokens)"
            )
        with self.cond:
            if self.error is not None:
                raise self.dead_error()
            self._queue.append(live)
            self.cond.notify_all()

    def _uncached(self, live: LiveRequest) -> int:
        """Tokens `live` costs here: its prefill tokens less what the cache holds now (all without caching)."""
        if self._paged is None:
            return live.num_prefill_tokens
        ids = live.prefill_token_ids
        return len(ids) - self.cache.num_cached_tokens(ids, names=live.block_names(self.cache.block_size))

    def num_cached_tokens(self, live: LiveRequest) -> int:
        """Prompt tokens of `live` this instance's cache would serve now (routing asks this)."""
        with self.cond:
            return self.cache.num_cached_tokens(live.prefill_token_ids, names=live.block_names(self.cache.block_size))

    def load(self) -> PrefillLoad:
        with self.cond:
            return PrefillLoad(
                num_queued_tokens=sum(self._uncached(r) for r in self._queue)
                + sum(self._uncached(r) for r in self._running),
                num_queued_requests=len(self._queue) + len(self._running),
            )

    def stats(self) -> InstanceStats:
        with self.cond:
            return InstanceStats(
                "prefill", self.name, self.error is None, len(self._queue), len(self._running),
                num_prefill_buffer_used=len(self._buffer), prefill_buffer_capacity=self.config.limits.prefill_buffer_slots,
                **cache_stats(self.cache),
            )  # fmt: skip

    @property
    def num_waiting(self) -> int:
        with self.cond:
            return len(self._queue)

    @property
    def num_running(self) -> int:
        with self.cond:
            return len(self._running)

    @property
    def buffer_used(self) -> int:
        with self.cond:
            return len(self._buffer)

    def get(self, request_id: str) -> PrefilledSequence | None:
        """The buffered KV of a request (None once released or cancelled)."""
        with self.cond:
            entry = self._buffer.get(request_id)
            return None if entry is None else entry[1]

    def holds_kv(self, request_id: str) -> bool:
        """Is this request's KV still wanted here: in the batch being prefilled and handed over, or buffered?

        The batch and the buffer change under one lock, so a lease keeper asking this never sees a
        prefilled KV between the two (the hand-over is atomic).
        """
        with self.cond:
            return request_id in self._buffer or any(r.request_id == request_id for r in self._running)

    def release(self, request_id: str) -> None:
        """Free a buffer slot (the KV was pulled, or the request ended)."""
        with self.cond:
            if self._buffer.pop(request_id, None) is not None:
                self.cond.notify_all()

    def cancel(self, request_id: str) -> bool:
        """Drop a queued or buffered request; True if this instance held it."""
        with self.cond:
            for live in self._queue:
                if live.request_id == request_id:
                    self._queue.remove(live)
                    return True
            if self._buffer.pop(request_id, None) is not None:
                self.cond.notify_all()
                return True
            return any(r.request_id == request_id for r in self._running)

    # ---- worker --------------------------------------------------------------
    def _free_slots(self) -> int:
        return prefill_buffer_free_slots(self.config.limits.prefill_buffer_slots, len(self._buffer), len(self._running))

    def has_work(self) -> bool:
        return self._ready() is not None or (bool(self._queue) and self._free_slots() > 0 and self._pipe_open())

    def held_requests(self) -> list[LiveRequest]:
        return [*self._queue, *self._running, *(live for live, _ in self._buffer.values())]

    def drop_all(self) -> None:
        for live in self._running:
            self.cache.release(live.request_id)
        self._queue.clear()
        self._inflight.clear()
        self._buffer.clear()

    def _pipe_open(self) -> bool:
        """Under the lock: may a new batch enter the engine now? An asynchronous engine takes one as soon as
        its first stage has finished the last batch (a pp-stage instance pipelines batches, as the
        simulator's prefill pipe does); a synchronous one runs one batch at a time, and so does a batch with a
        prefix-cache hit (its paged step runs in the call: it is back before the next batch is decided)."""
        if not self._inflight:
            return True
        return self._pipelined and all(f.stage_free for f in self._inflight)

    def _ready(self) -> _Flight | None:
        """Under the lock: the oldest batch in flight if its result (or failure) is back."""
        if self._inflight and (self._inflight[0].result is not None or self._inflight[0].error is not None):
            return self._inflight[0]
        return None

    def step(self) -> bool:
        dispatched = self._dispatch()
        with self.cond:
            ready = self._ready()
        if ready is not None:
            self._apply(ready)
        return dispatched or ready is not None

    def _dispatch(self) -> bool:
        """Decide a batch and hand it to the engine; False if none could start."""
        decided_at = now()
        with self.cond:
            if not self._pipe_open():
                return False
            waiting = [WaitingPrompt(r.request_id, r.num_prefill_tokens) for r in self._queue]
            decision = form_prefill_batch(
                waiting, self.config.limits.max_batch_tokens, max_batch_size=self._free_slots()
            )
            batch = [self._queue.popleft() for _ in decision.request_ids]
            hits = self._acquire(batch)
            if not batch:
                return False
            items = [
                PrefillItem(r.request_id, r.prefill_token_ids, r.request.sampling, r.seed, r.timings.arrival_at)
                for r in batch
            ]
            rows = self._suffix_rows(items, hits)
            dense = self._paged is None or (
                self._dense_misses
                and (
                    not any(h.num_cached_tokens for h in hits.values())
                    # a hit whose paged bucket (or a prompt's gather) is still compiling in the background:
                    # recompute the whole prompts
                    or not self._paged.step_compiled(rows, self.cache.block_size)
                    or not all(
                        self._paged.kv_copy_compiled("gather", bucket(len(i.token_ids), MIN_PROMPT_BUCKET))
                        for i in items
                    )
                )
            )
            flight = _Flight(batch, items, hits, decided_at, dense=dense)
            self._inflight.append(flight)
        flight.started_at = now()
        handle = (
            start_prefill(self.engine, items) if dense else ReadyPrefill(self._prefill_paged(self._paged, items, rows))  # type: ignore[arg-type]
        )
        if isinstance(handle, ReadyPrefill):
            with self.cond:
                flight.stage_free, flight.result, flight.ended_at = True, handle.value, now()
        else:
            threading.Thread(
                target=self._watch, args=(flight, handle), name=f"{self.name}-prefill", daemon=True
            ).start()
        return True

    def _watch(self, flight: _Flight, handle: PrefillHandle) -> None:
        """A batch's watcher thread: wakes the worker when the batch frees stage 0 and when its tokens are back."""
        try:
            handle.wait_first_stage()
            with self.cond:
                flight.stage_free = True
                self.cond.notify_all()
            result = handle.result()
            with self.cond:
                flight.result, flight.ended_at = result, now()
                self.cond.notify_all()
        except BaseException as e:  # the worker thread raises it (and dies) when this batch is the oldest
            with self.cond:
                flight.stage_free, flight.error = True, e
                self.cond.notify_all()

    def _apply(self, flight: _Flight) -> None:
        """Hand over the oldest batch: emit first tokens, buffer the KVs, tell the controller."""
        if flight.error is not None:
            raise flight.error
        result, batch, items, hits = flight.result, flight.batch, flight.items, flight.hits
        assert result is not None
        started_at, ended_at = flight.started_at, flight.ended_at
        resumed = [r.is_resumed for r in batch]
        eos = self.engine.model_config.eos_token_ids
        unkept: set[str] = set()  # prompts whose KV the pool does not get (their blocks are not named)
        if self._paged is not None and flight.dense:  # the pool gets what the dense prefill computed (async writes)
            for live, seq in zip(batch, result.sequences, strict=True):
                assert not isinstance(seq.kv, HeldKV)  # a dense-insert engine prefills into this process
                if not self._paged.kv_copy_compiled("insert", seq.dense_kv[0].k.shape[1]):
                    unkept.add(live.request_id)  # its insert still compiles in the background: not cached
                    continue
                hit = hits[live.request_id]
                # cached blocks (a recomputed hit) are not written again: other requests read them; a table entry
                # past the pool drops its writes
                kept = hit.num_cached_tokens // self.cache.block_size
                table = (self.cache.num_blocks,) * kept + hit.block_table[kept:]
                self.pages = self._paged.insert(seq.kv, seq.num_tokens, self.pages, table)
        # what this batch found cached and did not compute (nothing when it was prefilled densely)
        cached = {i.request_id: 0 if flight.dense else hits[i.request_id].num_cached_tokens for i in items}
        emits: list[tuple[LiveRequest, int, FinishReason | None]] = []
        handed: list[LiveRequest] = []
        with self.cond:
            for live, seq, is_resumed in zip(batch, result.sequences, resumed, strict=True):
                t = live.timings
                if t.prefill_start_at is None:  # a resumed request keeps its first prefill's times
                    t.prefill_start_at, t.prefill_end_at, t.prefill_instance = started_at, ended_at, self.name
                    t.cached_prompt_tokens = cached[live.request_id]
                if self._paged is not None:
                    if live.request_id not in unkept:
                        names = live.block_names(self.cache.block_size)
                        self.cache.commit(live.request_id, live.prefill_token_ids, names)
                    self.cache.release(live.request_id)
                if live.cancelled:
                    continue
                finish = None
                if not is_resumed:
                    finish = live.append_token(seq.first_token, eos, ended_at, seq.first_logprobs)
                    emits.append((live, seq.first_token, finish))
                if finish is None:
                    self._buffer[live.request_id] = (live, seq)
                    handed.append(live)
            self._inflight.popleft()
            self.num_computed_tokens += sum(len(i.token_ids) - cached[i.request_id] for i in items)
            self.max_buffer_used = max(self.max_buffer_used, len(self._buffer))
        for live, token, finish in emits:
            self.emitter.emit(live, (token,), finish)
        for live in handed:
            self._on_prefilled(self, live)
        done = now()
        lengths = tuple(len(item.token_ids) for item in items)
        if any(cached.values()):
            # Suffixes over cached prefixes are not whole prompts: not a "prefill" to fit the latency model on.
            self.record_step(StepRecord("mixed", done - flight.decided_at, batch=len(items), at=done))
        else:
            self.record_step(StepRecord("prefill", done - flight.decided_at, prompt_lengths=lengths, at=done))

    # ---- prefix caching ------------------------------------------------------
    def _acquire(self, batch: list[LiveRequest]) -> dict[str, CacheHit]:
        """Under the lock: pin each member's cached prefix; members that wait go back to the queue head.

        A member whose prompt equals one in flight or an earlier member's (the samples of an `n` > 1
        request) waits for a later batch, where it finds that prompt's blocks cached instead of
        computing them again (`prompts_to_defer`, the rule the simulator shares); a member the pool
        cannot take now waits too (with everything after it).
        """
        if self._paged is None:
            return {}
        hits: dict[str, CacheHit] = {}
        kept: list[LiveRequest] = []
        back: list[LiveRequest] = []
        # a prompt identical to one in flight (its blocks not named yet) or to an earlier member waits for it
        running = self._running
        defer = prompts_to_defer(
            [live.prefill_token_ids for live in batch],
            [r.prefill_token_ids for r in running],
            self.cache.block_size,
            salts=[live.request.cache_salt for live in batch],  # a repeat under another salt shares nothing
            in_flight_salts=[r.request.cache_salt for r in running],
        )
        full = False
        for live, wait in zip(batch, defer, strict=True):
            ids = live.prefill_token_ids
            if full or wait:
                back.append(live)  # after one that did not fit (FCFS), or a repeat of a prompt in flight
                continue
            try:
                hits[live.request_id] = self.cache.acquire(
                    live.request_id, ids, len(ids), names=live.block_names(self.cache.block_size)
                )
            except OutOfBlocksError:
                full = True
                back.append(live)
                continue
            kept.append(live)
        self._queue.extendleft(reversed(back))
        batch[:] = kept
        return hits

    @staticmethod
    def _suffix_rows(items: list[PrefillItem], hits: dict[str, CacheHit]) -> list[StepRow]:
        """Each prompt's uncached suffix as a prompt row of a paged step (caching; none without)."""
        rows: list[StepRow] = []
        if not hits:
            return rows
        for item in items:
            hit = hits[item.request_id]
            c = hit.num_cached_tokens
            rows.append(
                StepRow(
                    request_id=item.request_id,
                    token_ids=item.token_ids[c:],
                    start_position=c,
                    block_table=hit.block_table,
                    sampling=item.sampling,
                    seed=item.seed,
                    sample_index=0,
                    is_prompt=True,
                )
            )
        return rows

    def _prefill_paged(self, engine: Engine, items: list[PrefillItem], rows: list[StepRow]) -> PrefillResult:
        """Compute each prompt's uncached suffix (`rows`) into the pool, then copy every prompt's KV out densely."""
        if engine.capabilities.paged_prefill:  # the pool lives with the engine (a Ray prefill actor)
            result, self.pages = engine.prefill_rows(items, StepBatch(tuple(rows)), self.pages)
            return result
        tokens, logprobs, self.pages = step_tokens(engine, StepBatch(tuple(rows)), self.pages)
        out = []
        for item, row, token, lp in zip(items, rows, tokens, logprobs, strict=True):
            n = len(item.token_ids)
            kv = read_sequence(self.pages, row.block_table, n, bucket(n, MIN_PROMPT_BUCKET))
            out.append(PrefilledSequence(item.request_id, int(token), n, kv, lp))
        return PrefillResult(tuple(out))
