"""The timed KV connector: a pull into a `TimedEngine` that takes the latency model's link time, on the link.

The fake among the connectors (it moves a few tiny arrays in process, `InProcessTransfer`) whose clock is the
simulator's: `serve --engine timed` pairs it with the timed engine (`engines/timed.py`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

from jaxserve.runtime.engines.contract import Engine, KVPages, PrefilledSequence
from jaxserve.runtime.engines.timed import TimedEngine
from jaxserve.runtime.kv_connectors.base import TransferState
from jaxserve.runtime.kv_connectors.in_process import InProcessHandle, InProcessTransfer


class TimedTransfer:
    """`KVTransfer` into a `TimedEngine` that charges each pull where the simulator does: on the link into the
    decode instance, from the moment the pull starts (its prefill's hand-off, `DecodeInstance.start_pulls`),
    while the decode instance keeps stepping. A pull is DONE once its link time has passed (and its arrays
    landed); inserting it then costs the decode device nothing, and the request joins at the next step
    boundary, as `placement/simulator.py` has it. Pulls into one instance share its link: each starts when the
    one before it has crossed (the simulator serializes per prefill-decode pair; pulls from two prefill
    instances overlapping on the link is the difference, a link time of ~1 ms against steps of tens).
    `serve --engine timed` uses it; thread-safe (pulls start on the prefill instances' threads)."""

    def __init__(self, target: Engine) -> None:
        if not isinstance(target, TimedEngine):
            raise TypeError(f"a timed transfer pulls into a TimedEngine; {type(target).__name__} is not one")
        self.target = target
        self._inner = InProcessTransfer(target)
        self._lock = threading.Lock()
        self._link_free_at = -math.inf

    def start(self, seq: PrefilledSequence) -> TimedHandle:
        handle = self._inner.start(seq)
        clock = self.target._clock
        with self._lock:
            begin = max(clock(), self._link_free_at)
            self._link_free_at = ready_at = begin + self.target.transfer_s(seq.num_tokens)
        return TimedHandle(handle, begin, ready_at, clock, self.target._sleep)


class TimedHandle:
    """A `TimedTransfer` pull: PENDING until its link time has passed, then the in-process copy's state."""

    def __init__(
        self,
        inner: InProcessHandle,
        started_at: float,
        ready_at: float,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self._inner = inner
        self._started_at, self._ready_at = started_at, ready_at
        self._clock, self._sleep = clock, sleep

    @property
    def request_id(self) -> str:
        return self._inner.request_id

    @property
    def num_bytes(self) -> int:
        return self._inner.num_bytes

    @property
    def seconds(self) -> float | None:
        """The modelled link time (the copy itself is a few tiny arrays)."""
        return self._ready_at - self._started_at if self._inner.seconds is not None else None

    def poll(self) -> TransferState:
        if self._clock() < self._ready_at:
            return TransferState.PENDING
        return self._inner.poll()

    def wait(self, timeout_s: float | None = None) -> TransferState:
        left = self._ready_at - self._clock()
        if left > 0:
            self._sleep(left)
        return self._inner.wait(timeout_s)

    def insert(self, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        """The KV crossed the link on its own time: nothing left to charge on the decode device."""
        if self.wait() is not TransferState.DONE:
            raise RuntimeError(f"KV transfer of {self.request_id!r} failed")
        return pages
