"""What every runtime role shares: the live-request record and the worker thread shell.

`LiveRequest` is the one mutable record of a request in flight. The controller
creates it; the instance that currently holds the request fills in its
timestamps and output, and hands tokens to the controller through `Emitter`.

`Worker` is the thread shell around a role's `step()`: it calls `step()` while
there is work, sleeps on its condition variable when `step()` reports idle, and
if `step()` raises it records the error, marks itself dead, drops everything it
holds and hands those requests to the controller (`Emitter.on_instance_dead`),
which moves them to live instances (or fails them when none is left), so that
no client waits forever and no stream loses or repeats a token.

A request that moves after some of its tokens were streamed is *resumed*: a
prefill instance prefills `prefill_token_ids` (prompt + every streamed token but
the last) and discards the sample; decoding continues from the last streamed
token at its own position and sample index, exactly as if nothing had happened.

`StepRecord`s are what each instance's steps really cost — shape and wall time from
deciding the batch to handing its tokens on — kept in a bounded `step_log`. They
are the serving process's own latency profile: `GET /debug/steps` serves them and
`jaxserve profile --from-server` fits the latency model to them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import ClassVar, Literal, Protocol

from jaxserve.core.errors import EngineDeadError
from jaxserve.core.prefix_cache import PrefixCache, block_hashes, cache_stats
from jaxserve.core.request import FinishReason, GenerateRequest, RequestTimings, TokenLogprobs, finish_reason
from jaxserve.runtime.api import FaultStats, InstanceRole, InstanceStats

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class LiveRequest:
    """A request in flight: the request, its seed, its output so far, its timings."""

    request: GenerateRequest
    seed: int
    timings: RequestTimings
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # parallel to output_ids, if asked
    finished: bool = False
    cancelled: bool = False
    _names: tuple[int, int, tuple[bytes, ...]] | None = dataclasses.field(default=None, repr=False)

    def block_names(self, block_size: int) -> tuple[bytes, ...]:
        """The prefix-cache names of `prefill_token_ids`' full blocks (computed once per length)."""
        ids = self.prefill_token_ids
        if self._names is None or self._names[:2] != (block_size, len(ids)):
            self._names = (block_size, len(ids), block_hashes(ids, block_size, self.request.cache_salt))
        return self._names[2]

    def names_of(self, token_ids: tuple[int, ...], block_size: int) -> tuple[bytes, ...]:
        """The prefix-cache names of other token ids of this request (e.g. prompt + answer), under its salt."""
        return block_hashes(token_ids, block_size, self.request.cache_salt)

    def finished_blocks(self, block_size: int) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """What a finished request leaves in a pool for later ones (`PrefixCache.commit`): its prompt and answer
        but the last token, whose KV was never computed, and their names (what a resumed prefill would run)."""
        return self.prefill_token_ids, self.block_names(block_size)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.request.sampling.max_tokens

    @property
    def prefill_token_ids(self) -> tuple[int, ...]:
        """What a prefill runs: the prompt, or for a resumed request prompt + streamed tokens but the last."""
        if not self.output_ids:
            return self.request.prompt_token_ids
        return self.request.prompt_token_ids + tuple(self.output_ids[:-1])

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_prompt_tokens + max(len(self.output_ids) - 1, 0)

    @property
    def is_resumed(self) -> bool:
        """Tokens were streamed already: its prefill only rebuilds KV (its sample is discarded)."""
        return bool(self.output_ids)

    @property
    def wants_logprobs(self) -> bool:
        return self.request.sampling.logprobs is not None

    def logprobs_of_last(self, num_tokens: int) -> tuple[TokenLogprobs, ...] | None:
        """The logprobs of the last `num_tokens` output tokens (what an emitted chunk carries); None if not asked."""
        if not self.wants_logprobs:
            return None
        return tuple(self.output_logprobs[len(self.output_logprobs) - num_tokens :]) if num_tokens else ()

    def append_token(
        self, token: int, eos_token_ids: Sequence[int], now: float, logprobs: TokenLogprobs | None = None
    ) -> FinishReason | None:
        """Record one output token (and its logprobs, when the request asked); return why the request stops, or None."""
        if self.wants_logprobs:
            if logprobs is None:
                raise ValueError(f"request {self.request_id!r} asked for logprobs but its token came without them")
            self.output_logprobs.append(logprobs)
        self.output_ids.append(token)
        self.timings.token_times.append(now)
        if self.timings.first_token_at is None:
            self.timings.first_token_at = now
        return finish_reason(self.request.sampling, token, len(self.output_ids), eos_token_ids)

    def append_tokens(
        self,
        tokens: Sequence[int],
        eos_token_ids: Sequence[int],
        now: float,
        logprobs: Sequence[TokenLogprobs] | None = None,
    ) -> tuple[tuple[int, ...], FinishReason | None]:
        """Record a call's tokens up to the one that finishes the request (a multi-step row's extra tokens
        end where single steps would have ended it); the tokens taken and why it stops, or None.
        `logprobs`: one per token, when the request asked."""
        taken: list[int] = []
        for k, token in enumerate(tokens):
            taken.append(int(token))
            finish = self.append_token(int(token), eos_token_ids, now, None if logprobs is None else logprobs[k])
            if finish is not None:
                return tuple(taken), finish
        return tuple(taken), None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step as an instance ran it.

    `kind`: "prefill" (whole prompts, `prompt_lengths`), "decode" (`batch` rows attending over
    `ctx_sum` positions in all: Σ of each row's new-token position) or "mixed" (a chunked step).
    `seconds`: wall time from deciding the batch to handing its tokens on (a decode instance's
    KV pulls excluded), so host work and anything else that shares the cores is in it.
    """

    kind: Literal["prefill", "decode", "mixed"]
    seconds: float
    prompt_lengths: tuple[int, ...] = ()
    batch: int = 0
    ctx_sum: int = 0
    at: float = 0.0  # monotonic time the step ended

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


STEP_LOG_SIZE = 4096


FaultKind = Literal["failed_pull", "pull_retry", "recomputed", "expired_lease", "rerouted", "instance_restart"]


class FaultCounters:
    """Fault counters, bumped where each event happens (thread-safe); `snapshot()` never waits on anything else."""

    _FIELDS: ClassVar[dict[str, str]] = {
        "failed_pull": "num_failed_pulls",
        "pull_retry": "num_pull_retries",
        "recomputed": "num_recomputed",
        "expired_lease": "num_expired_leases",
        "rerouted": "num_rerouted_requests",
        "instance_restart": "num_instance_restarts",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(self._FIELDS.values(), 0)

    def count(self, kind: FaultKind, n: int = 1) -> None:
        with self._lock:
            self._counts[self._FIELDS[kind]] += n

    def snapshot(self) -> FaultStats:
        with self._lock:
            return FaultStats(**self._counts)


class Emitter(Protocol):
    """The controller side of a worker: where tokens, lost KVs, dead instances and failures go."""

    def emit(self, live: LiveRequest, token_ids: tuple[int, ...], finish_reason: FinishReason | None) -> None:
        """Stream `token_ids`, the tokens `live` just appended (their logprobs are the last ones in `live`)."""
        ...

    def fail(self, live: LiveRequest, error: BaseException) -> None: ...

    def recompute(self, live: LiveRequest) -> None:
        """`live`'s KV is lost (a failed pull): prefill it again on a live instance and continue it there."""
        ...

    def on_instance_dead(self, instance: Worker, held: Sequence[LiveRequest]) -> None:
        """`instance` died; `held` are the requests it held (already dropped there): move or fail them."""
        ...

    def count_fault(self, kind: FaultKind, n: int = 1) -> None: ...


class Worker:
    """A thread that runs `step()` until stopped; subclasses implement `step`, `has_work`, `held_requests`."""

    def __init__(self, name: str, emitter: Emitter) -> None:
        self.name = name
        self.emitter = emitter
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.step_log: collections.deque[StepRecord] = collections.deque(maxlen=STEP_LOG_SIZE)

    # ---- to implement -------------------------------------------------------
    def step(self) -> bool:
        """One decide -> execute -> apply round; return False when there was nothing to do."""
        raise NotImplementedError

    def has_work(self) -> bool:
        """Called under `cond`: is there anything `step` could do now?"""
        raise NotImplementedError

    def held_requests(self) -> list[LiveRequest]:
        """Called under `cond`: every request this worker holds (queued, buffered, running)."""
        raise NotImplementedError

    def drop_all(self) -> None:
        """Called under `cond` after a failure: forget every held request and free its resources."""
        raise NotImplementedError

    def stats(self) -> InstanceStats:
        """This instance's state (thread-safe, never blocks on anything but the lock)."""
        raise NotImplementedError

    # ---- thread shell -------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"jaxserve-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def request_stop(self) -> None:
        """Ask the thread to stop without waiting for it or for `cond` (a compile in progress may hold that)."""
        self._stop = True
        if self.cond.acquire(blocking=False):
            try:
                self.cond.notify_all()
            finally:
                self.cond.release()

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the thread to end; True when it has (or never started)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def record_step(self, record: StepRecord) -> None:
        self.step_log.append(record)  # deque.append is atomic; readers take step_log.copy()

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"instance {self.name} died: {self.error!r}")

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self._stop and not self.has_work():
                        self.cond.wait(timeout=0.5)
                    if self._stop:
                        return
                progressed = self.step()
                self.num_steps += 1
                if not progressed:  # e.g. waiting on a transfer: do not spin
                    with self.cond:
                        self.cond.wait(timeout=0.002)
        except BaseException as e:  # a dead worker hands its requests back, never leaves them hanging
            log.exception("worker %s died", self.name)
            with self.cond:
                self.error = e
                held = self.held_requests()
                self.drop_all()
            self.emitter.on_instance_dead(self, held)


def now() -> float:
    return time.monotonic()


def pooled_stats(
    role: InstanceRole, name: str, alive: bool, num_waiting: int, num_running: int, cache: PrefixCache
) -> InstanceStats:
    """The stats of an instance that keeps a paged KV pool (decode, colocated): its queue, its batch, its pool."""
    return InstanceStats(
        role, name, alive, num_waiting, num_running,
        num_kv_blocks_used=cache.num_blocks - cache.num_available,
        num_kv_blocks_free=cache.num_available,
        **cache_stats(cache),
    )  # fmt: skip
