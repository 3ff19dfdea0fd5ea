"""Controller-side proxies: the `Engine` contract over a Ray actor, so the runtime's loops run unchanged.

The prefill, decode and controller loops of `jaxserve/` (and the policies of
`scheduling.py`) drive these proxies exactly as they drive a local engine:

* `RemotePrefillEngine.prefill` runs the batch on the prefill actor and returns
  `RemotePrefilledSequence`s: the first token and sizes, with the KV left in the
  actor under a lease. A `LeaseKeeper` thread renews the lease of every KV the
  controller's `PrefillInstance` still buffers and cancels the ones it dropped.
* `RemoteDecodeEngine` keeps the paged pool inside the decode actor. Its
  `kv_layout()` is a `RemoteKVLayout` naming the actor, which `RayKVTransfer`
  uses to tell the decode actor to pull a KV straight from the prefill actor;
  the handle's `result()` is a `RemoteKVRef` that `insert` turns into a write of
  the staged KV.

Failures: a proxy that sees its actor die (`RayActorError`) waits for Ray to
restart it (`max_restarts`), then retries the call. Prefill: the batch runs
again on the restarted actor (its requests never left the controller's queue;
KV the dead actor held is recomputed by the decode side). Decode: the proxy
knows, for every sequence in the pool, every token whose KV it held (prompt +
tokens already streamed, from the rows of each successful step); it re-prefills
them into the same blocks on the restarted actor and retries the step, so each
stream continues with no token lost or repeated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import jax

from jaxserve.errors import EngineDeadError
from jaxserve.runtime.engine import (
    KVLayout,
    KVPages,
    PrefilledSequence,
    PrefillItem,
    PrefillResult,
    SequenceKV,
    StageKV,
    StepBatch,
)
from jaxserve.runtime.kv_transfer import TransferState
from jaxserve.runtime.ray_backend.actors import ActorInfo, ActorRestartedError, PullOrder, PullReport, RebuildItem
from jaxserve.runtime.ray_backend.transfer import fetch
from models.config import OPTConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class FaultCounters:
    """What the proxies saw go wrong (read by the controller's stats and metrics)."""

    num_actor_restarts: int = 0
    num_rerouted_requests: int = 0  # requests re-run on a restarted actor (prefill batch or decode rebuild)
    num_failed_pulls: int = 0  # pull attempts that failed (the decode actor then retried or recomputed)
    num_recomputed: int = 0  # KVs re-prefilled on the decode side instead of pulled


PERMANENT_DEATH_PINGS = 8  # consecutive ActorDiedError answers (~2.5 s) that mean "no restart coming"


def wait_until_alive(actor: ActorHandle, name: str, timeout_s: float) -> None:
    """Block until a (restarting) actor answers a ping; EngineDeadError when it does not come back."""
    import ray

    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    num_died = 0  # a restarting actor queues the ping; a dead one answers ActorDiedError at once, every time
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=max(min(10.0, deadline - time.monotonic()), 0.1))
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            last = e
            num_died = num_died + 1 if isinstance(e, ray.exceptions.ActorDiedError) else 0
            if num_died >= PERMANENT_DEATH_PINGS:
                break
            time.sleep(0.3)
    raise EngineDeadError(f"actor {name} is gone (no restart left, or none within {timeout_s:.0f} s): {last!r}")


class _RemoteBase:
    def __init__(
        self, name: str, actor: ActorHandle, info: ActorInfo, model_config: OPTConfig, restart_timeout_s: float,
        counters: FaultCounters,
    ) -> None:  # fmt: skip
        self.name = name
        self.actor = actor
        self.info = info
        self._model_config = model_config
        self.restart_timeout_s = restart_timeout_s
        self.counters = counters

    @property
    def model_config(self) -> OPTConfig:
        return self._model_config

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return ()  # they live in the actor's process

    def _call(self, fn: Callable[[], T], on_restart: Callable[[], None] | None = None) -> T:
        """Run `fn` (one actor call); on actor death wait for the restart, run `on_restart`, try again."""
        import ray

        while True:
            try:
                return fn()
            except ray.exceptions.RayActorError as e:
                log.warning("%s died (%r); waiting for Ray to restart it", self.name, e)
                wait_until_alive(self.actor, self.name, self.restart_timeout_s)
            except ActorRestartedError:  # it died and came back between two of our calls
                log.warning("%s was restarted between calls", self.name)
            self.counters.num_actor_restarts += 1
            if on_restart is not None:
                on_restart()


# ---- prefill ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RemotePrefilledSequence(PrefilledSequence):
    """A prefilled sequence whose KV stays in a prefill actor (under a lease)."""

    item: PrefillItem | None = None
    source: ActorHandle | None = None
    source_name: str = ""
    kv_bytes: int = 0

    @property
    def num_bytes(self) -> int:
        return self.kv_bytes


class RemotePrefillEngine(_RemoteBase):
    """`Engine.prefill` on a `PrefillActor`; the decode-side methods are not for prefill instances."""

    def __init__(self, *args: object, lease_s: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._outstanding: set[str] = set()
        self._lookup: Callable[[str], object | None] | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    def kv_layout(self) -> KVLayout:
        raise NotImplementedError("a prefill proxy has no decode layout")

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        import ray

        def run() -> list:  # type: ignore[type-arg]
            return ray.get(self.actor.prefill.remote(list(items)))

        def rerouted() -> None:
            self.counters.num_rerouted_requests += len(items)

        metas = self._call(run, rerouted)
        by_id = {i.request_id: i for i in items}
        with self._lock:
            self._outstanding.update(m.request_id for m in metas)
        seqs = tuple(
            RemotePrefilledSequence(
                m.request_id, m.first_token, m.num_tokens, (), by_id[m.request_id], self.actor, self.name, m.num_bytes
            )
            for m in metas
        )
        return PrefillResult(seqs)

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        raise NotImplementedError("prefill instances have no paged pool")

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        raise NotImplementedError("prefill instances have no paged pool")

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        raise NotImplementedError("prefill instances do not decode")

    # ---- leases ----------------------------------------------------------------------------
    def start_lease_keeper(self, lookup: Callable[[str], object | None]) -> None:
        """Renew leases of KVs `lookup(request_id)` still returns; cancel the others (pulled or dropped)."""
        self._lookup = lookup
        self._keeper = threading.Thread(target=self._keep, name=f"lease-keeper-{self.name}", daemon=True)
        self._keeper.start()

    def stop_lease_keeper(self) -> None:
        self._stop.set()

    def keep_once(self) -> tuple[list[str], list[str]]:
        """One renewal round: (renewed ids, cancelled ids)."""
        import ray

        assert self._lookup is not None
        with self._lock:
            ids = list(self._outstanding)
        keep = [r for r in ids if self._lookup(r) is not None]
        drop = [r for r in ids if r not in set(keep)]
        with self._lock:
            self._outstanding.difference_update(drop)
        refs: list[ray.ObjectRef[int]] = []
        if keep:
            refs.append(self.actor.renew.remote(keep))
        if drop:
            refs.append(self.actor.cancel.remote(drop))
        with contextlib.suppress(ray.exceptions.RayError):  # a dead actor lost its KVs; decode recomputes
            ray.get(refs, timeout=max(self.lease_s / 3, 0.5))
        return keep, drop

    def _keep(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.keep_once()
            except Exception:
                log.exception("lease keeper of %s", self.name)


# ---- decode -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RemoteKVLayout(KVLayout):
    """A decode actor's layout, as the controller sees it: stage layers and the proxy to pull through."""

    engine: RemoteDecodeEngine | None = dataclasses.field(default=None, compare=False)


class RemoteKVRef(tuple[StageKV, ...]):
    """The result of a remote pull: the KV is staged in the decode actor under `request_id`."""

    request_id: str
    item: PrefillItem

    def __new__(cls, request_id: str, item: PrefillItem) -> RemoteKVRef:
        self = super().__new__(cls, ())
        self.request_id = request_id
        self.item = item
        return self


@dataclasses.dataclass
class _Tracked:
    token_ids: list[int]  # every token whose KV the actor's pool holds for this sequence
    block_table: tuple[int, ...]
    item: PrefillItem


class RemoteDecodeEngine(_RemoteBase):
    """`Engine` insert / decode_step on a `DecodeActor`; the pool lives in the actor."""

    def __init__(self, *args: object, stage_layers: tuple[int, ...], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._layout = RemoteKVLayout(stage_layers=stage_layers, shardings=(), engine=self)
        self._pool_shape: tuple[int, int] | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._new_since_step: set[str] = set()

    def kv_layout(self) -> KVLayout:
        return self._layout

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        raise NotImplementedError("decode instances do not take prompts")

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        import ray

        self._pool_shape = (num_blocks, block_size)
        self._call(lambda: ray.get(self.actor.init_pages.remote(num_blocks, block_size)), self._rebuild)
        return ()

    def _rebuild(self) -> None:
        """After a restart: a fresh pool, then every tracked sequence re-prefilled into its blocks."""
        import ray

        assert self._pool_shape is not None
        items = [
            RebuildItem(rid, tuple(t.token_ids), t.block_table, t.item.sampling, t.item.seed)
            for rid, t in self._tracked.items()
        ]
        log.warning("%s restarted: rebuilding %d sequences", self.name, len(items))
        ray.get(self.actor.init_pages.remote(*self._pool_shape))
        ray.get(self.actor.rebuild.remote(items))
        self.counters.num_rerouted_requests += len(items)

    def pull(self, order: PullOrder) -> PullReport:

        def run() -> PullReport:
            return cast(PullReport, fetch(self.actor.pull.remote(order)))

        report = self._call(run, self._rebuild)
        self.counters.num_failed_pulls += report.num_failed_attempts
        self.counters.num_recomputed += int(report.recomputed)
        return report

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        import ray

        if not isinstance(kv, RemoteKVRef):
            raise TypeError("a remote decode engine inserts KV pulled by RayKVTransfer (a RemoteKVRef)")
        rid = kv.request_id
        self._tracked[rid] = _Tracked(list(kv.item.token_ids[:num_tokens]), tuple(block_table), kv.item)
        self._new_since_step.add(rid)

        def run() -> bool:
            return bool(ray.get(self.actor.insert.remote(rid, num_tokens, tuple(block_table))))

        if not self._call(run, self._rebuild):
            # The staged KV was lost with a restart between pull and insert: re-prefill this prompt too.
            t = self._tracked[rid]
            item = RebuildItem(rid, tuple(t.token_ids), t.block_table, t.item.sampling, t.item.seed)
            self._call(lambda: ray.get(self.actor.rebuild.remote([item])), self._rebuild)
            self.counters.num_recomputed += 1
        return pages

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        import ray

        tokens: list[int] = self._call(lambda: ray.get(self.actor.decode_step.remote(batch)), self._rebuild)
        # Only now is this step's KV in the pool: record it (a retry above replayed from the old state).
        in_batch = set()
        for row in batch.rows:
            in_batch.add(row.request_id)
            t = self._tracked.get(row.request_id)
            if t is not None:
                del t.token_ids[row.start_position :]
                t.token_ids.extend(row.token_ids)
        for rid in list(self._tracked):  # every running sequence is in every step; the rest ended
            if rid not in in_batch and rid not in self._new_since_step:
                del self._tracked[rid]
        self._new_since_step.clear()
        return tokens, pages

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)


# ---- the transfer the decode loop calls -------------------------------------------------------


class RemoteHandle:
    """A pull running in the decode actor; `result()` names the staged KV."""

    def __init__(self, seq: RemotePrefilledSequence, engine: RemoteDecodeEngine) -> None:
        assert seq.item is not None and seq.source is not None
        self._seq = seq
        self._engine = engine
        self._item: PrefillItem = seq.item
        self._order = PullOrder(seq.request_id, seq.source, seq.source_name, seq.item)
        self._report: PullReport | None = None
        self._error: BaseException | None = None

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def num_bytes(self) -> int:
        return self._report.num_bytes if self._report is not None else 0

    @property
    def seconds(self) -> float | None:
        return self._report.seconds if self._report is not None else None

    def poll(self) -> TransferState:
        if self._report is not None:
            return TransferState.DONE
        if self._error is not None:
            return TransferState.FAILED
        return TransferState.PENDING

    def wait(self, timeout_s: float | None = None) -> TransferState:
        import ray

        del timeout_s  # the actor bounds each attempt (pull_timeout_s, watchdog)
        if self.poll() is TransferState.PENDING:
            try:
                self._report = self._engine.pull(self._order)
            except (ray.exceptions.RayError, EngineDeadError) as e:
                log.error("KV pull of %s failed: %r", self.request_id, e)
                self._error = e
        return self.poll()

    def result(self) -> SequenceKV:
        if self.wait() is not TransferState.DONE:
            raise RuntimeError(f"KV transfer of {self.request_id!r} failed: {self._error!r}")
        return RemoteKVRef(self.request_id, self._item)


class RayKVTransfer:
    """`KVTransfer` for the Ray backend: the decode actor pulls from the prefill actor directly."""

    def start(self, seq: PrefilledSequence, target: KVLayout) -> RemoteHandle:
        if not isinstance(seq, RemotePrefilledSequence) or not isinstance(target, RemoteKVLayout):
            raise TypeError("RayKVTransfer moves KV between Ray actors (remote sequences and layouts only)")
        assert target.engine is not None
        return RemoteHandle(seq, target.engine)
