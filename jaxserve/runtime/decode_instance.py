"""Decode instance: pulls prefilled KV into a paged pool and decodes with continuous batching.

Loop (one thread, `Worker` shell), each `step()`:

1. decide (under the lock): `scheduling.admit_decodes` returns which of the
   finished prefills assigned to this instance (FCFS, never skipping the head)
   fit now — batch room and free blocks for prompt + max_tokens — and the
   blocks each reserves; the instance applies that decision: it allocates those
   blocks at once (so the reservation holds) and starts each pull
   (`KVTransfer.start`, non-blocking). A request cancelled before its hand-off
   never enters the queue (`enqueue_pull` drops it). The same admission also
   runs at each hand-off (`start_pulls()`, on the prefill side's thread), so a
   pull that fits starts the moment its prefill ends, as the simulator starts it,
   not at this loop's next boundary; this loop admits the rest as room frees.
2. pulls: every pull still in flight is polled (`handle.poll()`); the ones that
   finished are written into the pool (`handle.insert`) and join the running
   batch now, at the step boundary; their prefill buffer slots are freed. A
   pull that FAILED costs only its own request: its blocks go back at once and,
   per `DecodeConfig.pull_failure`, the pull is retried (`num_retries`, while the
   prefill instance still holds the KV), then the request is recomputed
   (`on_failure="recompute"`: the controller prefills it again on a live
   prefill instance and it comes back here or elsewhere) or fails alone with
   `KVTransferError` (`"fail"`). A pull whose prefill instance died, or was
   retired by a switch meanwhile, is recomputed whatever the policy: the request
   did nothing wrong. The instance keeps decoding the others.
3. execute: one `engine.decode_step` over every running sequence (one token
   each; the engine pads the batch to a bucketed size), or, with
   `decode_steps_per_call = N > 1` and an engine that can (`multi_step_decode`),
   up to N steps in one call when no local prompt row rides along
   (`runtime/multi_step.py`: the reservation already covers them; rows stop
   on the device exactly where single steps would). Pulls in flight do not
   hold it back: they overlap decoding, as the simulator models; a finished
   pull joins at the next call boundary.
4. apply (under the lock): append each sampled token (N per row after a
   multi-step call, streamed as one chunk), and end a sequence on max_tokens, EOS (unless ignore_eos) or a stop token; an ended
   or cancelled sequence returns its blocks to the free list immediately.

Prefix caching (`DecodeConfig.prefix_policy.enabled`): the pool is run by a `PrefixCache`.
Admission pins the longest cached prefix of the prompt (`acquire(..., min_uncached_tokens=0)`)
and the pull moves only positions `c = hit.num_cached_tokens ..` (a dense slice of the prefill
side's KV, `kv_pool.slice_sequence`), written into the blocks from `c // block_size` on; the
prompt's full blocks are then named (`commit`). While the prefill engine still compiles that slice in its
background warm-up (`Engine.kv_copy_compiled`), the pull moves the whole KV instead and writes none of the
first `c // block_size` blocks (their table entries point past the pool): more bytes, no compile. A finished request names its blocks of prompt +
answer (but the last token, whose KV is never computed) and unpins them, so the next turn of a
conversation finds them. `enqueue_local()` is conditional disaggregation: the request was never
prefilled elsewhere; after admission its uncached prompt suffix rides as a prompt row
(`StepRow(is_prompt=True)`) in the next decode step with the running decodes, whose sample is its
first token. Every path that ends a request here (finish, cancel, failed pull, death) calls
`cache.release` exactly once for it (idempotent anyway). Without caching the cache is a plain
allocator front (`PrefixCache(enabled=False)`).

Inputs: `enqueue_pull()` from the controller (a request and the prefill
instance holding its KV), then `start_pulls()` on the same (prefill) thread.
Outputs: tokens through `emit()`, lost KVs through `recompute()`, per-request
pull failures through `fail()`, transfer sizes and times through `on_transfer`. What blocks: only the lock and the engine's
decode step; with nothing running and pulls in flight the loop waits on its
condition variable for a few milliseconds between polls. The pool arrays are
touched only by this thread; the allocator only under the lock (so `cancel()`
frees blocks at once).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Literal, Protocol, runtime_checkable

from jaxserve.core.blocks import BlockAllocator
from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.request import FinishReason
from jaxserve.core.scheduling import NO_PREFIX_CACHING, DecodeLoad, PendingDecode, PrefixPolicy, admit_decodes
from jaxserve.runtime.api import InstanceStats
from jaxserve.runtime.engines.contract import (
    Engine,
    HeldKV,
    PrefilledSequence,
    RowLogprobs,
    SequenceKV,
    StepRow,
    bucket,
)
from jaxserve.runtime.kv_connectors.base import (
    KVIntegrityError,
    KVTransfer,
    KVTransferError,
    PullFailureConfig,
    TransferHandle,
    TransferState,
)
from jaxserve.runtime.kv_connectors.in_process import InProcessTransfer
from jaxserve.runtime.kv_pool import slice_sequence
from jaxserve.runtime.multi_step import decode_call, decode_records
from jaxserve.runtime.prefill_instance import MIN_PROMPT_BUCKET, PrefillInstance
from jaxserve.runtime.worker import Emitter, LiveRequest, StepRecord, Worker, now, pooled_stats

log = logging.getLogger(__name__)


@runtime_checkable
class DiscardableHandle(Protocol):
    """A pull whose KV lands in another process (`RemoteHandle`): `discard()` frees it there when the
    request ends before the pull is inserted (an in-process pull's arrays are simply dropped)."""

    def discard(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What a decode instance reads of the limits: `num_kv_blocks` x `block_size` (its pool) and
    `max_decode_batch` (running sequences)."""

    limits: ServingLimits = DEFAULT_LIMITS
    pull_failure: PullFailureConfig = dataclasses.field(default_factory=PullFailureConfig)
    prefix_policy: PrefixPolicy = (
        NO_PREFIX_CACHING  # enabled: keep finished requests' blocks cached; pull only what is missing
    )
    decode_steps_per_call: int = 1  # N > 1: up to N decode steps per engine call (`multi_step_decode`)


@dataclasses.dataclass(eq=False)
class _Running:
    live: LiveRequest
    block_table: tuple[int, ...]
    prompt_from: int | None = None  # a local prefill: its prompt row (positions prompt_from..) is still to run


@dataclasses.dataclass(eq=False)
class _Pull:
    live: LiveRequest
    source: PrefillInstance
    block_table: tuple[int, ...]
    num_cached_tokens: int = 0  # prompt positions this instance already holds (not pulled)
    handle: TransferHandle | None = None
    whole: bool = False  # the whole KV moves even so (its slice is not compiled yet); the cached blocks are skipped
    num_failures: int = 0


class DecodeInstance(Worker):
    role = "decode"

    def __init__(
        self,
        name: str,
        engine: Engine,
        config: DecodeConfig,
        emitter: Emitter,
        transfer: KVTransfer | None = None,
        on_transfer: Callable[[int, float], None] | None = None,
    ) -> None:
        super().__init__(name, emitter)
        self.engine = engine
        self.config = config
        self.transfer: KVTransfer = transfer or InProcessTransfer(engine)
        self._on_transfer = on_transfer
        num_blocks, block_size = config.limits.require_num_kv_blocks(), config.limits.block_size
        self.cache = PrefixCache(BlockAllocator(num_blocks, block_size), enabled=config.prefix_policy.enabled)
        self.allocator = self.cache.allocator
        self.pages = engine.init_pages(num_blocks, block_size)
        # (request, the prefill instance holding its KV, or None: prefill it here)
        self._pending: collections.deque[tuple[LiveRequest, PrefillInstance | None]] = collections.deque()
        self._pulling: dict[str, _Pull] = {}
        self._running: dict[str, _Running] = {}
        self.num_transfers = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_tokens = 0  # positions pulled (prompt minus what this cache held)
        self.num_local_prefills = 0
        self.num_local_prefill_tokens = 0  # prompt tokens computed here by local prefills
        self.max_blocks_used = 0  # high-water mark of pinned blocks (free and evictable ones excluded)

    # ---- controller side (thread-safe) --------------------------------------
    def enqueue_pull(self, live: LiveRequest, source: PrefillInstance) -> None:
        with self.cond:
            if self.error is not None:
                raise self.dead_error()
            if live.cancelled:  # cancelled between its prefill and this hand-off: never queue it
                source.release(live.request_id)
                return
            self._pending.append((live, source))
            self.cond.notify_all()

    def start_pulls(self) -> None:
        """Admit what fits now and start those pulls on the caller's thread.

        The controller calls this right after `enqueue_pull`, on the prefill instance's thread at its
        hand-off (outside the controller's lock), so a pull runs while this instance decodes and joins at
        its next step boundary — the moment the simulator starts it (`placement/simulator.py`). Left to
        `step()`, a pull would start only at the next boundary and join at the one after whenever it is
        not done at once (always, for a real pull of hundreds of MB). What does not fit now is admitted
        by `step()` once blocks or batch room free up. Starting is non-blocking (`KVTransfer.start`).
        """
        with self.cond:
            if self.error is not None or self._stop:
                return
            started = self._admit()
        for pull in started:
            try:
                self._start_pull(pull)
            except Exception as e:  # never the prefill side's problem: this pull fails alone
                log.exception("starting the KV pull of %s failed", pull.live.request_id)
                self._pull_failed(pull, repr(e), retry=False)
        if started:
            self.wake()

    def enqueue_local(self, live: LiveRequest) -> None:
        """Conditional disaggregation: prefill `live`'s uncached prompt suffix here (no transfer)."""
        with self.cond:
            if self.error is not None:
                raise self.dead_error()
            if live.cancelled:
                return
            self._pending.append((live, None))
            self.cond.notify_all()

    def num_cached_tokens(self, live: LiveRequest, min_uncached_tokens: int = 0) -> int:
        """Leading prompt tokens of `live` this instance's cache holds (routing asks this)."""
        with self.cond:
            return self.cache.num_cached_tokens(
                live.prefill_token_ids, min_uncached_tokens, names=live.block_names(self.cache.block_size)
            )

    def load(self) -> DecodeLoad:
        with self.cond:
            return DecodeLoad(
                num_running=len(self._running) + len(self._pulling),
                num_waiting=len(self._pending),
                num_free_blocks=self.cache.num_available,
            )

    def stats(self) -> InstanceStats:
        with self.cond:
            running = len(self._running) + len(self._pulling)
            return pooled_stats("decode", self.name, self.error is None, len(self._pending), running, self.cache)

    @property
    def num_waiting(self) -> int:
        with self.cond:
            return len(self._pending)

    @property
    def num_running(self) -> int:
        with self.cond:
            return len(self._running) + len(self._pulling)

    @property
    def num_pulling(self) -> int:
        with self.cond:
            return len(self._pulling)

    def cancel(self, request_id: str) -> bool:
        """Forget a request and free its blocks now; True if this instance held it."""
        with self.cond:
            for entry in self._pending:
                if entry[0].request_id == request_id:
                    self._pending.remove(entry)
                    if entry[1] is not None:
                        entry[1].release(request_id)
                    return True
            pull = self._pulling.pop(request_id, None)
            if pull is not None:
                pull.source.release(request_id)
                _discard(pull)
            elif self._running.pop(request_id, None) is None:
                return False
            self.cache.release(request_id)
            self.cond.notify_all()
            return True

    # ---- worker --------------------------------------------------------------
    def _admit(self) -> list[_Pull]:
        """Under the lock: apply `admit_decodes`' decision (reserve its blocks); the pulls to start."""
        while self._pending and self._pending[0][0].cancelled:  # belt and braces: never block the head
            live, src = self._pending.popleft()
            if src is not None:
                src.release(live.request_id)
        pending = [PendingDecode(live.request_id, live.num_prompt_tokens, live.max_tokens) for live, _ in self._pending]
        decision = admit_decodes(
            pending,
            num_free_blocks=self.cache.num_available,
            num_running=len(self._running) + len(self._pulling),
            max_batch_size=self.config.limits.max_decode_batch,
            block_size=self.config.limits.block_size,
        )
        started = []
        for reservation in decision.admitted:
            if self._awaits_shared_prefix(self._pending[0][0]):
                break  # FCFS: the head waits for blocks in flight (maybe admitted just now); nothing overtakes it
            live, source = self._pending.popleft()
            assert live.request_id == reservation.request_id
            ids = live.prefill_token_ids
            # A pull needs no position computed here (min 0); a local prefill needs the last one's logits.
            hit = self.cache.acquire(
                live.request_id,
                ids,
                reservation.num_blocks * self.config.limits.block_size,
                min_uncached_tokens=0 if source is not None else 1,
                names=live.block_names(self.config.limits.block_size),
            )
            if source is None:
                self._running[live.request_id] = _Running(live, hit.block_table, prompt_from=hit.num_cached_tokens)
                continue
            pull = _Pull(live, source, hit.block_table, hit.num_cached_tokens)
            self._pulling[live.request_id] = pull
            started.append(pull)
        self.max_blocks_used = max(self.max_blocks_used, self.cache.num_blocks - self.cache.num_available)
        return started

    def _awaits_shared_prefix(self, live: LiveRequest) -> bool:
        """Under the lock, with prefix caching: should `live` wait for blocks another request in flight is
        about to name?

        The samples of an `n` > 1 request reach this instance together, with the same prompt. The
        first one's pull brings the prompt's full blocks; admitted at the same time, the others would
        each reserve (and pull) a private copy. So a request whose prompt is that of one in flight
        (pulled, or prefilled here), with full blocks still uncached, waits until that one is inserted
        and its blocks are named, then pins them (ref counts) and brings only the rest: its own copy
        of the last, partial block and what follows. Prompts that merely share a prefix (a system
        prompt, even all their full blocks) do not wait: the simulator (`placement/prefix_sim.py`)
        admits them at once too.
        """
        if not self.cache.enabled:
            return False
        names = live.block_names(self.config.limits.block_size)
        if self.cache.num_cached_prefix_blocks(names) >= len(names):
            return False
        in_flight = [p.live for p in self._pulling.values()]
        in_flight += [r.live for r in self._running.values() if r.prompt_from is not None]
        ids = live.prefill_token_ids
        salt = live.request.cache_salt
        return any(
            other is not live and other.prefill_token_ids == ids and other.request.cache_salt == salt
            for other in in_flight
        )

    def _admissible(self) -> bool:
        if self._pending and self._awaits_shared_prefix(self._pending[0][0]):
            return False
        pending = [PendingDecode(live.request_id, live.num_prompt_tokens, live.max_tokens) for live, _ in self._pending]
        decision = admit_decodes(
            pending[:1],
            num_free_blocks=self.cache.num_available,
            num_running=len(self._running) + len(self._pulling),
            max_batch_size=self.config.limits.max_decode_batch,
            block_size=self.config.limits.block_size,
        )
        return len(decision) > 0

    def has_work(self) -> bool:
        return bool(self._running) or bool(self._pulling) or (bool(self._pending) and self._admissible())

    def held_requests(self) -> list[LiveRequest]:
        return [
            *(live for live, _ in self._pending),
            *(p.live for p in self._pulling.values()),
            *(r.live for r in self._running.values()),
        ]

    def drop_all(self) -> None:
        for live, source in self._pending:
            if source is not None:
                source.release(live.request_id)
        self._pending.clear()
        for pull in self._pulling.values():
            pull.source.release(pull.live.request_id)
            _discard(pull)
        for rid in [*self._pulling, *self._running]:
            self.cache.release(rid)
        self._pulling.clear()
        self._running.clear()

    def step(self) -> bool:
        with self.cond:
            started = self._admit()
        for pull in started:
            self._start_pull(pull)
        joined = self._finish_pulls()
        decided_at = now()  # KV pulls excluded: the simulator charges them to the transfer
        with self.cond:
            running = list(self._running.values())
        if not running:
            return bool(started) or joined
        rows = tuple(self._row(r) for r in running)
        started_at = now()
        for r in running:
            t = r.live.timings
            if r.prompt_from is not None and t.prefill_start_at is None:
                t.prefill_start_at, t.prefill_instance = started_at, self.name
                t.cached_prompt_tokens = r.prompt_from
            if t.decode_start_at is None:
                t.decode_start_at = started_at
        lists, logprobs, self.pages, multi = decode_call(
            self.engine, rows, self.pages, self.config.decode_steps_per_call
        )
        self._apply(running, lists, logprobs)
        done = now()
        if multi:
            for record in decode_records(rows, lists, done - decided_at, done):
                self.record_step(record)
            return True
        ctx = sum(row.start_position for row in rows)
        kind: Literal["decode", "mixed"] = "mixed" if any(row.is_prompt for row in rows) else "decode"
        self.record_step(StepRecord(kind, done - decided_at, batch=len(rows), ctx_sum=ctx, at=done))
        return True

    def _row(self, r: _Running) -> StepRow:
        live = r.live
        if r.prompt_from is not None:  # a local prefill: the uncached prompt suffix, its sample the next token
            ids = live.prefill_token_ids
            return StepRow(
                request_id=live.request_id,
                token_ids=ids[r.prompt_from :],
                start_position=r.prompt_from,
                block_table=r.block_table,
                sampling=live.request.sampling,
                seed=live.seed,
                sample_index=len(live.output_ids),
                is_prompt=True,
            )
        return StepRow(
            request_id=live.request_id,
            token_ids=(live.output_ids[-1],),
            start_position=live.num_prompt_tokens + len(live.output_ids) - 1,
            block_table=r.block_table,
            sampling=live.request.sampling,
            seed=live.seed,
            sample_index=len(live.output_ids),
        )

    def _start_pull(self, pull: _Pull) -> None:
        """Start (or restart) one pull; a KV the prefill instance no longer holds is a failed pull."""
        rid = pull.live.request_id
        seq = pull.source.get(rid)
        if seq is None:
            with self.cond:
                if self._pulling.get(rid) is not pull:
                    return  # cancelled on the way
            self._pull_failed(pull, f"{pull.source.name} no longer holds the KV", retry=False)
            return
        if pull.live.timings.transfer_start_at is None:
            pull.live.timings.transfer_start_at = now()
        c = pull.num_cached_tokens
        rest = seq.num_tokens - c
        pull.whole = (
            c > 0
            and not isinstance(seq.kv, HeldKV)
            and not pull.source.engine.kv_copy_compiled(
                "slice", bucket(rest, MIN_PROMPT_BUCKET), seq.dense_kv[0].k.shape[1]
            )
        )
        if c > 0 and not pull.whole:  # this instance holds the first c positions: move only the rest
            if isinstance(seq.kv, HeldKV):  # held by another process (Ray): its holder slices it
                prefix = pull.block_table[: c // self.config.limits.block_size]
                kv: SequenceKV | HeldKV = dataclasses.replace(seq.kv, start=c, prefix_blocks=prefix)
            else:
                kv = slice_sequence(seq.dense_kv, c, bucket(rest, MIN_PROMPT_BUCKET))
            seq = PrefilledSequence(seq.request_id, seq.first_token, rest, kv, seq.first_logprobs)
        try:
            pull.handle = self.transfer.start(seq)
        except Exception as e:  # a transfer that cannot even start fails this pull, not the instance
            log.warning("KV pull of %s from %s did not start: %r", rid, pull.source.name, e)
            self._pull_failed(pull, repr(e), retry=True)

    def _finish_pulls(self) -> bool:
        """Poll every pull in flight; insert the finished ones (they join the batch now). True if any joined."""
        with self.cond:
            pulls = [p for p in self._pulling.values() if p.handle is not None]
        joined = False
        for pull in pulls:
            handle = pull.handle
            assert handle is not None
            state = handle.poll()
            if state is TransferState.PENDING:
                continue
            if state is TransferState.FAILED:
                self._pull_failed(pull, f"transfer from {pull.source.name} failed", retry=True)
                continue
            rid = pull.live.request_id
            with self.cond:
                if self._pulling.get(rid) is not pull:
                    continue  # cancelled while in flight (its blocks are already free)
            c = pull.num_cached_tokens
            moved = pull.live.num_prefill_tokens - (0 if pull.whole else c)  # positions that came over
            try:
                # c is a multiple of the block size: positions c.. start at block c // block_size.
                kept = c // self.config.limits.block_size
                table = pull.block_table[kept:]
                if pull.whole:  # all positions arrived: the cached blocks' entries point past the pool (dropped)
                    table = (self.cache.num_blocks,) * kept + table
                self.pages = handle.insert(moved, self.pages, table)
            except KVIntegrityError as e:  # checked before the pool was touched: that request is recomputed
                self._pull_failed(pull, str(e), retry=False, lost=True)
                continue
            except Exception as e:
                # `insert` donates the pool: a failure inside it leaves the pool unusable, so it kills the instance.
                raise RuntimeError(f"writing the KV of {rid!r} into the pool failed") from e
            pull.source.release(rid)
            seconds = handle.seconds or 0.0
            t = pull.live.timings
            t.transfer_end_at = now()
            t.kv_transfer_bytes, t.kv_transfer_s, t.decode_instance = handle.num_bytes, seconds, self.name
            t.kv_transfer_tokens = moved
            with self.cond:
                self.num_transfers += 1
                self.kv_transfer_bytes += handle.num_bytes
                self.kv_transfer_tokens += moved
                if self._pulling.pop(rid, None) is not None:
                    self.cache.commit(
                        rid, pull.live.prefill_token_ids, pull.live.block_names(self.config.limits.block_size)
                    )
                    self._running[rid] = _Running(pull.live, pull.block_table)
                    joined = True
            if self._on_transfer is not None:
                self._on_transfer(handle.num_bytes, seconds)
        return joined

    def _pull_failed(self, pull: _Pull, why: str, *, retry: bool, lost: bool = False) -> None:
        """One pull failed: retry it, or give its blocks back now and recompute or fail that request alone.
        `lost`: the KV that arrived is unusable (`KVIntegrityError`): recomputed whatever the policy."""
        rid = pull.live.request_id
        self.emitter.count_fault("failed_pull")
        pull.num_failures += 1
        pull.handle = None
        if retry and pull.num_failures <= self.config.pull_failure.num_retries and pull.source.get(rid) is not None:
            log.warning("KV pull of %s failed (%s); retry %d", rid, why, pull.num_failures)
            self.emitter.count_fault("pull_retry")
            self._start_pull(pull)
            return
        with self.cond:
            if self._pulling.pop(rid, None) is not pull:
                return  # cancelled meanwhile
            self.cache.release(rid)
            self.cond.notify_all()
        pull.source.release(rid)
        if lost:
            log.warning("KV of %s failed its integrity check (%s); prefilling it again", rid, why)
            self.emitter.count_fault("recomputed")
            self.emitter.recompute(pull.live)
        elif pull.source.error is not None or not pull.source.alive:
            # its prefill instance died, or a switch retired it (stopped, its buffer dropped): a re-route, whatever
            # the policy, since the request did nothing wrong and a live prefill instance can compute it again
            how = "died" if pull.source.error is not None else "was retired"
            log.warning("KV of %s lost: %s %s; prefilling it again", rid, pull.source.name, how)
            self.emitter.count_fault("rerouted")
            self.emitter.recompute(pull.live)
        elif self.config.pull_failure.on_failure == "recompute":
            log.warning("KV pull of %s failed (%s); recomputing it", rid, why)
            self.emitter.count_fault("recomputed")
            self.emitter.recompute(pull.live)
        else:
            log.warning("KV pull of %s failed (%s); failing that request", rid, why)
            self.emitter.fail(
                pull.live, KVTransferError(f"the KV of {rid!r} could not be pulled to {self.name}: {why}")
            )

    def _apply(self, running: list[_Running], lists: list[list[int]], logprobs: list[RowLogprobs]) -> None:
        at = now()
        eos = self.engine.model_config.eos_token_ids
        emits: list[tuple[LiveRequest, tuple[int, ...], FinishReason | None]] = []
        with self.cond:
            for r, tokens, lps in zip(running, lists, logprobs, strict=False):
                rid = r.live.request_id
                if self._running.get(rid) is not r:  # cancelled during the step
                    continue
                if r.prompt_from is not None:  # a local prefill ran: the prompt's KV is in the pool now
                    ids = r.live.prefill_token_ids
                    self.num_local_prefills += 1
                    self.num_local_prefill_tokens += len(ids) - r.prompt_from
                    self.cache.commit(rid, ids, r.live.block_names(self.config.limits.block_size))
                    r.prompt_from = None
                    r.live.timings.prefill_end_at = at
                    r.live.timings.decode_instance = self.name
                    if r.live.is_resumed:  # its KV is rebuilt; the next token comes from a decode row
                        continue
                taken, finish = r.live.append_tokens(tokens, eos, at, lps)
                emits.append((r.live, taken, finish))
                if finish is not None:
                    del self._running[rid]
                    self.cache.commit(rid, *r.live.finished_blocks(self.config.limits.block_size))  # then unpin
                    self.cache.release(rid)
        for live, chunk, finish in emits:
            self.emitter.emit(live, chunk, finish)


def _discard(pull: _Pull) -> None:
    """A pull that will never be inserted: let a remote one free what it fetched (non-blocking)."""
    if isinstance(pull.handle, DiscardableHandle):
        pull.handle.discard()
