"""Prefill instance: prompts in, first tokens and buffered KV out.

Loop (one thread, `Worker` shell), each `step()`:

1. decide (under the lock): `scheduling.form_prefill_batch` takes prompts from
   the head of the FCFS queue up to `L_m` tokens, and never more than the free
   slots of the KV buffer. A full buffer means an empty batch: the instance
   stops taking work until a decode instance pulls something (backpressure).
2. execute: `engine.prefill(batch)` on this instance's devices (the engine pads
   to length buckets, so it compiles once per bucket, not per prompt length).
   A resumed request (moved after tokens were streamed) prefills prompt +
   streamed tokens but the last (`LiveRequest.prefill_token_ids`).
3. apply (under the lock): record timings, emit each first token; a request
   that is already finished (max_tokens 1, EOS) ends here; a resumed request
   emits nothing (its sample is discarded); every other one's KV goes into the
   buffer and the controller is told (`on_prefilled`) so it can assign a decode
   instance. A request cancelled meanwhile is dropped here.

Inputs: `enqueue()` from the controller. Outputs: `emit()` of first tokens, the
buffer read by decode instances through `get()`, freed by `release()` once the
KV is pulled (or by `cancel()`); `holds_kv()` tells a lease keeper (Ray) which
KVs are still wanted (the batch being handed over or the buffer, read under one
lock, so the hand-over is atomic). Only the lock is ever waited on; the engine
call runs outside it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from jaxserve.runtime.api import InstanceStats
from jaxserve.runtime.engine import PrefilledSequence, PrefillEngine, PrefillItem
from jaxserve.runtime.request import FinishReason
from jaxserve.runtime.worker import Emitter, LiveRequest, StepRecord, Worker, now
from jaxserve.scheduling import (
    DEFAULT_PREFILL_BUFFER_SLOTS,
    PrefillLoad,
    WaitingPrompt,
    form_prefill_batch,
    prefill_buffer_free_slots,
)


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    max_batch_tokens: int = 512  # L_m: prompt tokens per batch (a longer prompt runs alone)
    buffer_capacity: int = DEFAULT_PREFILL_BUFFER_SLOTS  # prefilled sequences held here until pulled


class PrefillInstance(Worker):
    role = "prefill"

    def __init__(
        self,
        name: str,
        engine: PrefillEngine,
        config: PrefillConfig,
        emitter: Emitter,
        on_prefilled: Callable[[PrefillInstance, LiveRequest], None],
    ) -> None:
        super().__init__(name, emitter)
        self.engine = engine
        self.config = config
        self._on_prefilled = on_prefilled
        self._queue: collections.deque[LiveRequest] = collections.deque()
        self._running: list[LiveRequest] = []
        self._buffer: dict[str, tuple[LiveRequest, PrefilledSequence]] = {}
        self.max_buffer_used = 0  # high-water mark, for tests and stats

    # ---- controller / decode side (thread-safe) -----------------------------
    def enqueue(self, live: LiveRequest) -> None:
        with self.cond:
            if self.error is not None:
                raise self.dead_error()
            self._queue.append(live)
            self.cond.notify_all()

    def load(self) -> PrefillLoad:
        with self.cond:
            return PrefillLoad(
                num_queued_tokens=sum(r.num_prefill_tokens for r in self._queue)
                + sum(r.num_prefill_tokens for r in self._running),
                num_queued_requests=len(self._queue) + len(self._running),
            )

    def stats(self) -> InstanceStats:
        with self.cond:
            return InstanceStats(
                "prefill", self.name, self.error is None, len(self._queue), len(self._running),
                num_prefill_buffer_used=len(self._buffer), prefill_buffer_capacity=self.config.buffer_capacity,
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
        return prefill_buffer_free_slots(self.config.buffer_capacity, len(self._buffer), len(self._running))

    def has_work(self) -> bool:
        return bool(self._queue) and self._free_slots() > 0

    def held_requests(self) -> list[LiveRequest]:
        return [*self._queue, *self._running, *(live for live, _ in self._buffer.values())]

    def drop_all(self) -> None:
        self._queue.clear()
        self._running.clear()
        self._buffer.clear()

    def step(self) -> bool:
        decided_at = now()
        with self.cond:
            waiting = [WaitingPrompt(r.request_id, r.num_prefill_tokens) for r in self._queue]
            decision = form_prefill_batch(waiting, self.config.max_batch_tokens, max_batch_size=self._free_slots())
            batch = [self._queue.popleft() for _ in decision.request_ids]
            self._running = batch
        if not batch:
            return False
        started_at = now()
        items = [PrefillItem(r.request_id, r.prefill_token_ids, r.request.sampling, r.seed) for r in batch]
        resumed = [r.is_resumed for r in batch]
        result = self.engine.prefill(items)
        ended_at = now()
        eos = self.engine.model_config.eos_token_id
        emits: list[tuple[LiveRequest, int, FinishReason | None]] = []
        handed: list[LiveRequest] = []
        with self.cond:
            for live, seq, is_resumed in zip(batch, result.sequences, resumed, strict=True):
                t = live.timings
                if t.prefill_start_at is None:  # a resumed request keeps its first prefill's times
                    t.prefill_start_at, t.prefill_end_at, t.prefill_instance = started_at, ended_at, self.name
                if live.cancelled:
                    continue
                finish = None
                if not is_resumed:
                    finish = live.append_token(seq.first_token, eos, ended_at)
                    emits.append((live, seq.first_token, finish))
                if finish is None:
                    self._buffer[live.request_id] = (live, seq)
                    handed.append(live)
            self._running = []
            self.max_buffer_used = max(self.max_buffer_used, len(self._buffer))
        for live, token, finish in emits:
            self.emitter.emit(live, (token,), finish)
        for live in handed:
            self._on_prefilled(self, live)
        done = now()
        lengths = tuple(len(item.token_ids) for item in items)
        self.record_step(StepRecord("prefill", done - decided_at, prompt_lengths=lengths, at=done))
        return True
