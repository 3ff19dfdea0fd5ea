"""The Ray KV connector: pulls between actor processes, started by the controller's decode loop.

`RayKVTransfer` is bound to one `RemoteDecodeEngine` (the proxy of a decode actor): `start(seq)` sends a
`PullOrder` to the decode actor, which fetches the KV straight from the prefill actor holding it (`HeldKV.holder`)
and stages it there (the mechanics, both sides: `ray_pull.py`); the handle's `poll()` asks Ray whether that call
finished, so pulls overlap decode steps, and `insert` writes the staged KV into the actor's pool. The retries
and the failure policy run in the decode actor (`PullFailureConfig`, the controller's, handed over at launch);
a FAILED handle is then the controller's to recompute or fail.

`ObjectStoreTransfer` is the object-store path as a plain in-process `KVTransfer` (`ray.put`/`ray.get` round
trip), so the shared conformance test (tests/test_kv_transfer.py) runs it next to `InProcessTransfer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from jaxserve.runtime.engines.contract import Engine, HeldKV, KVPages, PrefilledSequence
from jaxserve.runtime.kv_connectors.base import TransferState, move_kv
from jaxserve.runtime.kv_connectors.in_process import InProcessHandle
from jaxserve.runtime.kv_connectors.ray_pull import HostKV, from_host, host_num_bytes, to_host
from jaxserve.runtime.ray_backend.actors import PullOrder, PullReport
from jaxserve.runtime.ray_backend.remote_engine import RemoteDecodeEngine

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


class RemoteHandle:
    """A pull running in the decode actor, started at once; `poll()` never blocks."""

    def __init__(self, order: PullOrder, engine: RemoteDecodeEngine, prefix_blocks: Sequence[int] = ()) -> None:
        self._order = order
        self._engine = engine
        self._prefix_blocks = tuple(prefix_blocks)  # the decode blocks of positions ..order.start
        self._num_pools_lost = engine.num_pools_lost
        self._ref = engine.start_pull(order)
        self._report: PullReport | None = None
        self._error: BaseException | None = None

    @property
    def request_id(self) -> str:
        return self._order.request_id

    @property
    def num_bytes(self) -> int:
        return self._report.num_bytes if self._report is not None else 0

    @property
    def seconds(self) -> float | None:
        return self._report.seconds if self._report is not None else None

    def _collect(self) -> None:
        """The pull's report, or its error. EngineDeadError (the decode actor is gone for good) propagates:
        that is the instance dying, not this pull failing, and a failed pull would be recomputed and routed
        straight back to the dead instance."""
        import ray

        try:
            self._report = self._engine.finish_pull(self._ref, self._order)
        except ray.exceptions.RayError as e:
            log.error("KV pull of %s failed: %r", self.request_id, e)
            self._error = e

    def poll(self) -> TransferState:
        if self._report is None and self._error is None and self._engine.pull_done(self._ref):
            self._collect()
        if self._report is not None:
            return TransferState.DONE
        return TransferState.FAILED if self._error is not None else TransferState.PENDING

    def wait(self, timeout_s: float | None = None) -> TransferState:
        del timeout_s  # the actor bounds each attempt (pull_timeout_s, watchdog)
        if self._report is None and self._error is None:
            self._collect()
        return self.poll()

    def discard(self) -> None:
        """The request ended while this pull ran: the decode actor drops its KV (now, or when it lands)."""
        self._engine.actor.discard.remote(self.request_id)

    def insert(self, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        if self.wait() is not TransferState.DONE:
            raise RuntimeError(f"KV transfer of {self.request_id!r} failed: {self._error!r}")
        self._engine.insert_staged(
            self.request_id, self._order.item, num_tokens, block_table, self._order.start, self._prefix_blocks,
            self._num_pools_lost,
        )  # fmt: skip
        return pages


class RayKVTransfer:
    """`KVTransfer` into one decode actor: it pulls each `HeldKV` straight from the prefill actor holding it."""

    def __init__(self, target: Engine, holders: Mapping[str, ActorHandle]) -> None:
        if not isinstance(target, RemoteDecodeEngine):
            raise TypeError(f"RayKVTransfer pulls into a decode actor; {type(target).__name__} is not one")
        self.target = target
        self.holders = holders

    def start(self, seq: PrefilledSequence) -> RemoteHandle:
        if not isinstance(seq.kv, HeldKV):
            raise TypeError(f"RayKVTransfer moves KV held by Ray actors; {seq.request_id!r} is in this process")
        held = seq.kv
        order = PullOrder(
            seq.request_id, self.holders[held.holder], held.holder, held.item, start=held.start,
            num_tokens=seq.num_tokens if held.start else 0,
        )  # fmt: skip
        return RemoteHandle(order, self.target, held.prefix_blocks)


class ObjectStoreTransfer:
    """Host copy -> `ray.put` -> `ray.get` -> `device_put` into the target's layout (needs `ray.init`)."""

    def __init__(self, target: Engine) -> None:
        if not target.capabilities.dense_insert:
            raise TypeError(f"an object-store transfer writes into a local engine; {type(target).__name__} is not one")
        self.target = target
        self.layout = target.kv_layout()

    def start(self, seq: PrefilledSequence) -> InProcessHandle:
        """The round trip runs here, blocking; the handle then holds arrays on the target's devices, as an
        in-process pull's (its `insert` checks them the same way)."""
        import ray

        started_at = time.monotonic()
        host = to_host(seq.dense_kv)
        fetched: HostKV = ray.get(ray.put(host))
        arrays = move_kv(from_host(fetched), self.layout)
        return InProcessHandle(seq.request_id, arrays, host_num_bytes(host), started_at, self.target)
