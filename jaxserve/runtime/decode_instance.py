"""Decode instance: pulls prefilled KV into a paged pool and decodes with continuous batching.

Loop (one thread, `Worker` shell), each `step()`:

1. decide (under the lock): `scheduling.admit_decodes` says how many of the
   finished prefills assigned to this instance (FCFS, never skipping the head)
   fit now: batch room and free blocks for prompt + max_tokens. Their blocks
   are allocated from the free list at once, so the reservation holds.
2. execute: pull each admitted KV (`KVTransfer.start` -> `wait`, timed), write
   it into the pool at its blocks (`engine.insert`), free the prefill
   instance's buffer slot; then one `engine.decode_step` over every running
   sequence (one token each; the engine pads the batch to a bucketed size).
3. apply (under the lock): append each sampled token, stream it, and end a
   sequence on max_tokens, EOS (unless ignore_eos) or a stop token; an ended
   or cancelled sequence returns its blocks to the free list immediately.

Inputs: `enqueue_pull()` from the controller (a request and the prefill
instance holding its KV). Outputs: tokens through `emit()`, transfer sizes and
times through `on_transfer`. The pool arrays are touched only by this thread;
the allocator only under the lock (so `cancel()` frees blocks at once).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from jaxserve.runtime.engine import Engine, StepBatch, StepRow
from jaxserve.runtime.kv_pool import BlockAllocator
from jaxserve.runtime.kv_transfer import InProcessTransfer, KVTransfer, TransferState
from jaxserve.runtime.prefill_instance import PrefillInstance
from jaxserve.runtime.request import FinishReason
from jaxserve.runtime.worker import Emitter, LiveRequest, StepRecord, Worker, now
from jaxserve.scheduling import DecodeLoad, PendingDecode, admit_decodes, blocks_for, kv_tokens_reserved


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    num_blocks: int = 256
    block_size: int = 16
    max_batch_size: int = 32


@dataclasses.dataclass(eq=False)
class _Running:
    live: LiveRequest
    block_table: tuple[int, ...]


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
        self.transfer: KVTransfer = transfer or InProcessTransfer()
        self._on_transfer = on_transfer
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self.pages = engine.init_pages(config.num_blocks, config.block_size)
        self._layout = engine.kv_layout()
        self._pending: collections.deque[tuple[LiveRequest, PrefillInstance]] = collections.deque()
        self._pulling: dict[str, _Running] = {}
        self._running: dict[str, _Running] = {}
        self.num_transfers = 0
        self.kv_transfer_bytes = 0

    # ---- controller side (thread-safe) --------------------------------------
    def enqueue_pull(self, live: LiveRequest, source: PrefillInstance) -> None:
        with self.cond:
            if self.error is not None:
                raise self.dead_error()
            self._pending.append((live, source))
            self.cond.notify_all()

    def load(self) -> DecodeLoad:
        with self.cond:
            return DecodeLoad(
                num_running=len(self._running) + len(self._pulling),
                num_waiting=len(self._pending),
                num_free_blocks=self.allocator.num_free,
            )

    @property
    def num_waiting(self) -> int:
        with self.cond:
            return len(self._pending)

    @property
    def num_running(self) -> int:
        with self.cond:
            return len(self._running) + len(self._pulling)

    def cancel(self, request_id: str) -> bool:
        """Forget a request and free its blocks now; True if this instance held it."""
        with self.cond:
            for entry in self._pending:
                if entry[0].request_id == request_id:
                    self._pending.remove(entry)
                    entry[1].release(request_id)
                    return True
            held = self._running.pop(request_id, None) or self._pulling.pop(request_id, None)
            if held is None:
                return False
            self.allocator.free(request_id)
            self.cond.notify_all()
            return True

    # ---- worker --------------------------------------------------------------
    def _admissible(self) -> int:
        pending = [PendingDecode(live.request_id, live.num_prompt_tokens, live.max_tokens) for live, _ in self._pending]
        return admit_decodes(
            pending,
            num_free_blocks=self.allocator.num_free,
            num_running=len(self._running) + len(self._pulling),
            max_batch_size=self.config.max_batch_size,
            block_size=self.config.block_size,
        )

    def has_work(self) -> bool:
        return bool(self._running) or (bool(self._pending) and self._admissible() > 0)

    def held_requests(self) -> list[LiveRequest]:
        return [
            *(live for live, _ in self._pending),
            *(r.live for r in self._pulling.values()),
            *(r.live for r in self._running.values()),
        ]

    def drop_all(self) -> None:
        for live, source in self._pending:
            source.release(live.request_id)
        self._pending.clear()
        for rid in [*self._pulling, *self._running]:
            self.allocator.free(rid)
        self._pulling.clear()
        self._running.clear()

    def step(self) -> bool:
        pulled = self._pull_admitted()
        decided_at = now()  # KV pulls excluded: the simulator charges them to the transfer
        with self.cond:
            running = list(self._running.values())
        if not running:
            return pulled
        rows = tuple(
            StepRow(
                request_id=r.live.request_id,
                token_ids=(r.live.output_ids[-1],),
                start_position=r.live.num_prompt_tokens + len(r.live.output_ids) - 1,
                block_table=r.block_table,
                sampling=r.live.request.sampling,
                seed=r.live.seed,
                sample_index=len(r.live.output_ids),
            )
            for r in running
        )
        started_at = now()
        for r in running:
            if r.live.timings.decode_start_at is None:
                r.live.timings.decode_start_at = started_at
        tokens, self.pages = self.engine.decode_step(StepBatch(rows), self.pages)
        self._apply(running, tokens)
        done = now()
        ctx = sum(row.start_position for row in rows)
        self.record_step(StepRecord("decode", done - decided_at, batch=len(rows), ctx_sum=ctx, at=done))
        return True

    def _pull_admitted(self) -> bool:
        with self.cond:
            admitted = [self._pending.popleft() for _ in range(self._admissible())]
            for live, _ in admitted:
                need = blocks_for(kv_tokens_reserved(live.num_prompt_tokens, live.max_tokens), self.config.block_size)
                self._pulling[live.request_id] = _Running(live, self.allocator.allocate(live.request_id, need))
        for live, source in admitted:
            seq = source.get(live.request_id)
            with self.cond:
                entry = self._pulling.get(live.request_id)
            if seq is None or entry is None:  # cancelled on the way
                self.cancel(live.request_id)
                continue
            live.timings.transfer_start_at = now()
            handle = self.transfer.start(seq, self._layout)
            if handle.wait() is not TransferState.DONE:
                raise RuntimeError(f"KV transfer of {live.request_id!r} from {source.name} failed")
            self.pages = self.engine.insert(handle.result(), seq.num_tokens, self.pages, entry.block_table)
            source.release(live.request_id)
            seconds = handle.seconds or 0.0
            t = live.timings
            t.transfer_end_at = now()
            t.kv_transfer_bytes, t.kv_transfer_s, t.decode_instance = handle.num_bytes, seconds, self.name
            with self.cond:
                self.num_transfers += 1
                self.kv_transfer_bytes += handle.num_bytes
                if self._pulling.pop(live.request_id, None) is not None:
                    self._running[live.request_id] = entry
            if self._on_transfer is not None:
                self._on_transfer(handle.num_bytes, seconds)
        return bool(admitted)

    def _apply(self, running: list[_Running], tokens: list[int]) -> None:
        at = now()
        eos = self.engine.model_config.eos_token_id
        emits: list[tuple[LiveRequest, int, FinishReason | None]] = []
        with self.cond:
            for r, token in zip(running, tokens, strict=False):
                rid = r.live.request_id
                if self._running.get(rid) is not r:  # cancelled during the step
                    continue
                finish = r.live.append_token(int(token), eos, at)
                emits.append((r.live, int(token), finish))
                if finish is not None:
                    del self._running[rid]
                    self.allocator.free(rid)
        for live, token, finish in emits:
            self.emitter.emit(live, (token,), finish)
