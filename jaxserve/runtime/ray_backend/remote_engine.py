"""Controller-side proxies: the engine contract over Ray actors, one role each, so the runtime's loops run unchanged.

The prefill, decode and controller loops of `jaxserve/runtime/` (and the policies
of `scheduling.py`) drive these proxies exactly as they drive a local engine:

* `RemotePrefillEngine` (the prefill role): `prefill` runs the batch on the
  prefill actor and returns `PrefilledSequence`s whose `kv` is a `HeldKV`: the
  first token and sizes, with the KV left in the actor under a lease. A lease
  keeper thread renews the lease of every KV the controller's `PrefillInstance`
  still holds (`holds_kv`: in the batch being handed over, or buffered) and
  cancels the others. The hand-over is atomic: the instance moves a request from
  its running batch to its buffer under one lock, so the keeper never sees a KV
  in between and never cancels one that is about to be buffered.
* `RemoteDecodeEngine` (the decode role) keeps the paged pool inside the decode
  actor. `RayKVTransfer` (the Ray KV connector, `kv_connectors/ray.py`, bound to it) starts each pull as an actor call that
  returns at once (the handle's `poll()` asks Ray whether it finished, so pulls
  overlap decode steps); the decode actor fetches the KV straight from the
  prefill actor named by `HeldKV.holder` and stages it; `handle.insert` writes
  the staged KV into the pool (`insert_staged`).

Failures: a proxy that sees its actor die (`RayActorError`) waits for Ray to
restart it (`max_restarts`), then retries the call. A proxy that warmed its
actor (`warmup`) runs the same warm-ups in the new incarnation again before
the retry, so a restarted actor never compiles under traffic (a prefill actor
restarted between two calls is noticed by the same means: a prefill call marked
`warm` refuses on a cold actor). Prefill: the batch runs
again on the restarted actor (its requests never left the controller's queue;
KV the dead actor held is recomputed by the decode side). Decode: the proxy
knows, for every sequence in the pool, every token whose KV it held (prompt +
tokens already streamed, from the rows of each successful step); it re-prefills
them into the same blocks on the restarted actor and retries the step, so each
stream continues with no token lost or repeated. An actor that does not come
back raises EngineDeadError: its instance dies and the controller moves its
requests (`Controller.on_instance_dead`). Every fault is counted in the
controller's `FaultCounters` as it happens.
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

from jaxserve.core.errors import EngineDeadError, InvalidRequestError
from jaxserve.core.request import TokenLogprobs
from jaxserve.runtime.engines.contract import (
    Engine,
    EngineCapabilities,
    HeldKV,
    KVCopy,
    KVLayout,
    KVPages,
    PrefilledSequence,
    PrefillItem,
    PrefillResult,
    StepBatch,
    StepRow,
    WarmupSpec,
)
from jaxserve.runtime.guided import GuidedDecoder
from jaxserve.runtime.kv_connectors.ray_pull import fetch
from jaxserve.runtime.ray_backend.actors import (
    ActorInfo,
    ActorRestartedError,
    ActorWarmed,
    PrefillMeta,
    PullOrder,
    PullReport,
    RebuildItem,
)
from jaxserve.runtime.worker import FaultCounters
from models.config import ModelConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)
T = TypeVar("T")


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


@dataclasses.dataclass(frozen=True)
class _Warmed:
    """`WarmedPages` of a remote warm-up: the pool never leaves the actor, so the proxy's placeholder comes back;
    with what the actor compiled before it returned."""

    pages: KVPages | None
    actor: ActorWarmed


@dataclasses.dataclass(frozen=True)
class _ActorWarmup:
    """One warm-up an actor ran: what it compiled, and whether on its own paged pool."""

    spec: WarmupSpec
    on_pool: bool


class _RemoteBase(Engine):
    def __init__(
        self, name: str, actor: ActorHandle, info: ActorInfo, model_config: ModelConfig, restart_timeout_s: float,
        counters: FaultCounters,
    ) -> None:  # fmt: skip
        self.name = name
        self.actor = actor
        self.info = info
        self._model_config = model_config
        self.restart_timeout_s = restart_timeout_s
        self.counters = counters
        self._warmups: list[_ActorWarmup] = []  # every warm-up it ran (a restart repeats them, in order)
        self._hold = False  # `hold_background_warmup`: the next warm-up keeps its background compiles waiting
        # Whether the actor may still be compiling in the background: then `step_compiled` / `kv_copy_compiled`
        # ask it (one call each) until it says it is done; afterwards the answer is True without a call.
        self._compiling = False
        self.last_warmed: ActorWarmed | None = None  # what the actor's latest warm-up compiled before it returned
        self._pool_shape: tuple[int, int] | None = None  # (blocks, block size) of the actor's paged pool, if any
        # Prefix caching: called after a restart lost the pool (the instance forgets the cached blocks no one pins).
        self.on_pool_lost: Callable[[], None] | None = None
        self._guided: GuidedDecoder | None = None

    @property
    def guided(self) -> GuidedDecoder | None:
        return self._guided

    @guided.setter
    def guided(self, decoder: GuidedDecoder | None) -> None:
        """The controller's masks of guided requests (`Controller.guided_decoder` sets them on every engine): the
        actor builds a decoder of its own from the same tokenizer; a matcher is replayed from the tokens each call
        carries, so nothing more crosses the process boundary. `InvalidRequestError` if the actor cannot mask."""
        if decoder is self._guided:
            return
        if decoder is not None:
            self._call(lambda: self._send_guided(decoder))
        self._guided = decoder

    def _send_guided(self, decoder: GuidedDecoder) -> None:
        import ray

        to_str = getattr(decoder.tokenizer, "to_str", None)
        if to_str is None:
            raise InvalidRequestError(
                f"response_format on Ray needs a `tokenizers` tokenizer to send to {self.name}",
                field="response_format",
            )
        sent = cast(bool, ray.get(self.actor.set_guided.remote(to_str(), decoder.eos_token_ids, decoder.limits)))
        if not sent:
            raise InvalidRequestError(
                f"response_format needs engines that mask logits; {self.name}'s engine does not",
                field="response_format",
            )

    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return ()  # they live in the actor's process

    def warmup(self, spec: WarmupSpec, pages: KVPages | None = None) -> _Warmed:
        """`Engine.warmup` in the actor (a decode actor on its own pool: `pages` stays the proxy's; an actor
        whose engine cannot warm does nothing). A remote decode engine runs one step per call (no
        `multi_step_decode`), so its warm-up compiles single steps only: the loop programs would never run.
        Otherwise the embedded warm-up's plan: with `spec.background` the buckets that hold all others before
        it returns, the rest on the actor's compile thread (held until `start_background_warmup` after
        `hold_background_warmup`), while the actor's engine runs work padded up to compiled buckets."""
        import ray

        warmup = _ActorWarmup(dataclasses.replace(spec, decode_steps=1), on_pool=pages is not None)
        hold, self._hold = self._hold, False
        self._compiling = self._compiling or spec.background
        warmed = self._call(
            lambda: cast(ActorWarmed, ray.get(self.actor.warmup.remote(warmup.spec, warmup.on_pool, hold)))
        )
        if warmup not in self._warmups:
            self._warmups.append(warmup)
        self.last_warmed = warmed
        log.info(
            "%s warmed its buckets in %.1f s%s", self.name, warmed.seconds,
            f" ({warmed.num_background} more programs compile in the background)" if warmed.num_background else "",
        )  # fmt: skip
        return _Warmed(pages, warmed)

    def hold_background_warmup(self) -> None:
        self._hold = True

    def start_background_warmup(self) -> None:
        import ray

        self._call(lambda: ray.get(self.actor.start_background_warmup.remote()))

    def stop_background_warmup(self, timeout_s: float = 60.0) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):  # a dead actor compiles nothing
            ray.get(self.actor.stop_background_warmup.remote(timeout_s), timeout=timeout_s + 10)

    def background_warmup_done(self, timeout_s: float | None = None) -> bool:
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._compiling:
            self._compiling = not self._call(lambda: cast(bool, ray.get(self.actor.background_warmup_done.remote())))
            if self._compiling and deadline is not None and time.monotonic() >= deadline:
                break
            if self._compiling:
                time.sleep(0.05 if deadline is None else min(0.05, max(deadline - time.monotonic(), 0.0)))
        return not self._compiling

    def step_compiled(self, rows: Sequence[StepRow], block_size: int) -> bool:
        return self._ask_compiled(lambda: self.actor.step_compiled.remote(list(rows), block_size))

    def kv_copy_compiled(self, kind: KVCopy, padded: int, from_padded: int = 0) -> bool:
        return self._ask_compiled(lambda: self.actor.kv_copy_compiled.remote(kind, padded, from_padded))

    def _ask_compiled(self, query: Callable[[], object]) -> bool:
        """The actor's answer to a `*_compiled` query while it may still compile in the background (one call,
        which also says whether it is done: then no later query calls it); True afterwards."""
        import ray

        if not self._compiling:
            return True
        answer, done = self._call(lambda: cast(tuple[bool, bool], ray.get(query())))  # type: ignore[call-overload]
        self._compiling = not done
        return answer

    @property
    def warmed(self) -> bool:
        """Whether the controller warmed this instance (then a cold incarnation must be warmed again)."""
        return bool(self._warmups)

    def _rewarm(self) -> None:
        """After a restart: the new incarnation runs the warm-ups the old one ran, in order, before any traffic."""
        import ray

        if not self._warmups:
            return
        seconds = sum(
            cast(ActorWarmed, ray.get(self.actor.warmup.remote(w.spec, w.on_pool))).seconds for w in self._warmups
        )
        self._compiling = any(w.spec.background for w in self._warmups)
        log.warning("%s restarted: warmed its buckets again in %.1f s", self.name, seconds)

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        """The paged pool, built in the actor (the controller side holds a placeholder)."""
        import ray

        self._pool_shape = (num_blocks, block_size)
        self._call(lambda: ray.get(self.actor.init_pages.remote(num_blocks, block_size)))
        return ()

    def _recover(self) -> None:
        """After a restart, before the call is tried again: what the new incarnation needs first (its pool,
        empty, then the warm-ups on it)."""
        import ray

        if self._pool_shape is not None:
            ray.get(self.actor.init_pages.remote(*self._pool_shape))
        if self._guided is not None:  # the new incarnation's engine has no decoder yet
            self._send_guided(self._guided)
        self._rewarm()
        if self._pool_shape is not None and self.on_pool_lost is not None:
            self.on_pool_lost()

    def _call(self, fn: Callable[[], T], on_restart: Callable[[], None] | None = None) -> T:
        """Run `fn` (one actor call); on actor death wait for the restart, recover it (`_recover`), run
        `on_restart`, try again."""
        import ray

        while True:
            try:
                return fn()
            except ray.exceptions.RayActorError as e:
                log.warning("%s died (%r); waiting for Ray to restart it", self.name, e)
                wait_until_alive(self.actor, self.name, self.restart_timeout_s)
            except ActorRestartedError:  # it died and came back between two of our calls
                log.warning("%s was restarted between calls", self.name)
            self.counters.count("instance_restart")
            self._recover()
            if on_restart is not None:
                on_restart()


# ---- prefill ----------------------------------------------------------------------------------


class RemotePrefillEngine(_RemoteBase):
    """`Engine.prefill` on a `PrefillActor`; each KV stays in the actor under a lease (`HeldKV`)."""

    @property
    def capabilities(self) -> EngineCapabilities:
        """The prefill role, with the actor's pool for prefix caching (`paged_prefill`); logprobs where the
        actor's engine computes them (it said so at start)."""
        return EngineCapabilities(
            prefill=True, paged_prefill=True, logprobs=self.info.computes_logprobs, bucket_warmup=True
        )

    def __init__(self, *args: object, lease_s: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._outstanding: set[str] = set()
        self._holds: Callable[[str], bool] | None = None
        self._num_expired_seen = 0  # the actor's expired-lease count at the last renewal
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        import ray

        def run() -> list:  # type: ignore[type-arg]
            return ray.get(self.actor.prefill.remote(list(items), self.warmed))

        def rerouted() -> None:
            self.counters.count("rerouted", len(items))

        metas = self._call(run, rerouted)
        return self._held(items, metas)

    # ---- prefix caching: the paged pool lives in the actor (`paged_prefill`) ----------------------
    def kv_layout(self) -> KVLayout:
        return KVLayout(stage_layers=self.info.stage_layers, shardings=())  # the shardings live in the actor

    def prefill_rows(
        self, items: Sequence[PrefillItem], batch: StepBatch, pages: KVPages
    ) -> tuple[PrefillResult, KVPages]:
        """The rows on the actor's pool; each prompt's whole KV stays in the actor under a lease (`HeldKV`).

        A restart loses the pool (cached prefixes included): the retry runs every prompt in full
        (`items`) into the same blocks, which rewrites the cached ones the rows relied on.
        """
        import ray

        rows = batch

        def run() -> list:  # type: ignore[type-arg]
            return ray.get(self.actor.prefill_rows.remote(rows, self.warmed))

        def restarted() -> None:
            nonlocal rows
            self.counters.count("rerouted", len(items))
            whole = [
                dataclasses.replace(row, token_ids=item.token_ids, start_position=0)
                for row, item in zip(batch.rows, items, strict=True)
            ]
            rows = StepBatch(tuple(whole))

        metas = self._call(run, restarted)
        return self._held(items, metas), pages

    def _held(self, items: Sequence[PrefillItem], metas: Sequence[PrefillMeta]) -> PrefillResult:
        by_id = {i.request_id: i for i in items}
        with self._lock:
            self._outstanding.update(m.request_id for m in metas)
        seqs = tuple(
            PrefilledSequence(
                m.request_id,
                m.first_token,
                m.num_tokens,
                HeldKV(self.name, m.num_bytes, by_id[m.request_id]),
                m.first_logprobs,
            )
            for m in metas
        )
        return PrefillResult(seqs)

    # ---- leases ----------------------------------------------------------------------------
    def start_lease_keeper(self, holds: Callable[[str], bool]) -> None:
        """Renew the leases of KVs `holds(request_id)` says are still wanted; cancel the others."""
        self._holds = holds
        self._keeper = threading.Thread(target=self._keep, name=f"lease-keeper-{self.name}", daemon=True)
        self._keeper.start()

    def stop_lease_keeper(self) -> None:
        self._stop.set()

    def keep_once(self) -> tuple[list[str], list[str]]:
        """One renewal round: (renewed ids, cancelled ids). Leases that ran out meanwhile count as expired."""
        import ray

        assert self._holds is not None
        with self._lock:
            ids = list(self._outstanding)
        keep = [r for r in ids if self._holds(r)]
        drop = [r for r in ids if r not in set(keep)]
        with self._lock:
            self._outstanding.difference_update(drop)
        renewed: object = self.actor.renew.remote(keep)  # answers the actor's count of expired leases
        cancelled = self.actor.cancel.remote(drop) if drop else None
        with contextlib.suppress(ray.exceptions.RayError):  # a dead actor lost its KVs; decode recomputes
            num_expired = cast(int, fetch(renewed, max(self.lease_s / 3, 0.5)))
            # a restarted actor counts from 0 again: everything it reports is new
            new = num_expired - self._num_expired_seen if num_expired >= self._num_expired_seen else num_expired
            self._num_expired_seen = num_expired
            if new:
                self.counters.count("expired_lease", new)
            if cancelled is not None:
                fetch(cancelled, max(self.lease_s / 3, 0.5))
        return keep, drop

    def _keep(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.keep_once()
            except Exception:
                log.exception("lease keeper of %s", self.name)


# ---- decode -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tracked:
    token_ids: list[int]  # every token whose KV the actor's pool holds for this sequence
    block_table: tuple[int, ...]
    item: PrefillItem

    def rebuild_item(self, request_id: str) -> RebuildItem:
        return RebuildItem(request_id, tuple(self.token_ids), self.block_table, self.item.sampling, self.item.seed)


class RemoteDecodeEngine(_RemoteBase):
    """The decode role on a `DecodeActor`: the pool lives in the actor; KV arrives by `RayKVTransfer`."""

    @property
    def capabilities(self) -> EngineCapabilities:
        """The decode role, one step per call; logprobs where the actor's engine computes them. No
        `dense_insert`: pulled KV is staged in the actor and written there (`insert_staged`)."""
        return EngineCapabilities(decode=True, logprobs=self.info.computes_logprobs, bucket_warmup=True)

    def __init__(self, *args: object, stage_layers: tuple[int, ...], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._layout = KVLayout(stage_layers=stage_layers, shardings=())  # the shardings live in the actor
        self._tracked: dict[str, _Tracked] = {}
        self.num_pools_lost = 0  # restarts that rebuilt the pool (a pull started before one cannot trust it)
        self._new_since_step: set[str] = set()

    def kv_layout(self) -> KVLayout:
        return self._layout

    def _recover(self) -> None:
        """After a restart: a fresh pool, the warm-up again (on the empty pool, as at launch), then every
        tracked sequence re-prefilled into its blocks (its whole context: shared prefix blocks too); with
        prefix caching the instance then forgets the cached blocks no running sequence rebuilt."""
        import ray

        if self._pool_shape is None:  # restarted before it had a pool: nothing to rebuild or warm
            return
        items = [t.rebuild_item(rid) for rid, t in self._tracked.items()]
        log.warning("%s restarted: rebuilding %d sequences", self.name, len(items))
        ray.get(self.actor.init_pages.remote(*self._pool_shape))
        self._rewarm()
        ray.get(self.actor.rebuild.remote(items))
        self.num_pools_lost += 1
        self.counters.count("rerouted", len(items))
        if self.on_pool_lost is not None:
            self.on_pool_lost()

    # ---- pulls (started by RemoteHandle, finished at a step boundary) -------------------------
    def start_pull(self, order: PullOrder) -> object:
        """Start the actor's pull of `order` (returns at once): the ObjectRef of its `PullReport`."""
        return self.actor.pull.remote(order, self.warmed)

    def pull_done(self, ref: object) -> bool:
        import ray

        ready, _ = ray.wait([ref], timeout=0)  # type: ignore[list-item]
        return bool(ready)

    def finish_pull(self, ref: object, order: PullOrder) -> PullReport:
        """The report of a finished pull; if the actor died meanwhile, recover it and pull again (blocking)."""
        import ray

        try:
            report = cast(PullReport, fetch(ref))
        except (ray.exceptions.RayActorError, ActorRestartedError):  # died meanwhile, or found cold
            warm = self.warmed
            report = self._call(lambda: cast(PullReport, fetch(self.actor.pull.remote(order, warm))))
        if report.num_failed_attempts:
            self.counters.count("failed_pull", report.num_failed_attempts)
            self.counters.count("pull_retry", report.num_failed_attempts - int(report.recomputed))
        if report.recomputed:
            self.counters.count("recomputed")
        return report

    def insert_staged(
        self,
        request_id: str,
        item: PrefillItem,
        num_tokens: int,
        block_table: Sequence[int],
        start: int = 0,
        prefix_blocks: Sequence[int] = (),
        num_pools_lost: int | None = None,
    ) -> None:
        """Write the KV staged in the actor under `request_id` (positions `start` ..) into the pool at
        `block_table` (the blocks from position `start` on; `prefix_blocks` hold positions ..start).

        `num_pools_lost`: this proxy's count when the pull started. A pull over a cached prefix that a
        restart has wiped since (a pinned block no running sequence rebuilt) re-prefills the whole prompt.
        """
        import ray

        tokens = list(item.token_ids[: start + num_tokens])
        self._tracked[request_id] = _Tracked(tokens, (*prefix_blocks, *block_table), item)
        self._new_since_step.add(request_id)

        def run() -> bool:
            return bool(ray.get(self.actor.insert.remote(request_id, num_tokens, tuple(block_table))))

        if start > 0 and num_pools_lost is not None and num_pools_lost != self.num_pools_lost:
            self.actor.discard.remote(request_id)
            inserted = False
        else:
            inserted = self._call(run)
        if not inserted:
            # The staged KV (or the cached prefix under it) was lost with a restart: re-prefill this prompt too.
            rebuild = self._tracked[request_id].rebuild_item(request_id)
            self._call(lambda: ray.get(self.actor.rebuild.remote([rebuild])))
            self.counters.count("recomputed")

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        import ray

        tokens: list[int] = self._call(lambda: ray.get(self.actor.decode_step.remote(batch)))
        self._after_step(batch)
        return tokens, pages

    def decode_step_logprobs(
        self, batch: StepBatch, pages: KVPages
    ) -> tuple[list[int], list[TokenLogprobs | None], KVPages]:
        """`logprobs`: the step on the actor, with the logprobs of the rows that ask."""
        import ray

        def run() -> tuple[list[int], list[TokenLogprobs | None]]:
            out: object = ray.get(self.actor.decode_step_logprobs.remote(batch))
            return cast(tuple[list[int], list[TokenLogprobs | None]], out)

        tokens, logprobs = self._call(run)
        self._after_step(batch)
        return tokens, logprobs, pages

    def _after_step(self, batch: StepBatch) -> None:
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

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)
