"""The Ray actors: one process per prefill or decode instance, owning its JAX runtime, mesh and engine.

An actor is created from an `EngineSpec` (what model, on how many devices) and
builds its engine on `jax.devices()[: tp * pp]` of its own process: on a CPU
machine the controller passes `XLA_FLAGS=--xla_force_host_platform_device_count=N`
through the actor's `runtime_env`; with GPUs, Ray's `num_gpus` gives it its
devices. Ray restarts a dead actor (`max_restarts`) by running `__init__` again
with the same arguments: the engine comes back empty, and the controller-side
proxies (`remote_engine.py`) rebuild what it held.

`PrefillActor`: `prefill(items)` runs the engine, keeps each KV in a
`LeasedKVBuffer` and returns only small metadata (`PrefillMeta`); decode actors
pull the KV with `take_host` (object store) or `offer_jax` (a ticket for
`jax.experimental.transfer`); a pull only lends the KV (it stays held), so an
attempt that fails after the take is retried against the same KV; the decode
actor frees it once it is staged on its side (`cancel`). `renew` / `cancel`
are also the controller's lease calls; a reaper thread frees KVs whose lease
ran out. With prefix caching the controller's prefill instance (which keeps the `PrefixCache`)
sends only the uncached suffixes as prompt rows (`prefill_rows`): they run on this actor's paged
pool (`init_pages`) and each prompt's whole KV is read back from its blocks into the leased buffer;
a pull then asks for positions `start ..` only (`PullOrder.start`), sliced here before it leaves.

Both compile before traffic when the controller asks (`warmup`, the same `Engine.warmup` with the same
`WarmupSpec` the embedded controller runs, its background part included: the buckets that hold all others
first, the rest on the actor's own compile thread; a decode actor warms on its own pool), into the driver's
persistent compilation cache (`EngineSpec.compile_cache`, turned on before the engine is built), and count
their XLA compilations (`num_compiles`), so a test can see that traffic after the warm-up compiles
nothing. A restarted incarnation is cold: a call that expects a warmed actor (`prefill(items,
warm=True)`) raises `ActorRestartedError` there, so the controller warms it again first.

`DecodeActor`: `pull(order)` fetches one KV from the prefill actor named in
the order (retries, then recompute or fail per the controller's `PullFailureConfig`), checks the
peer's model signature at first contact, checks what arrived (the sender's
manifest and, with the checksum on (`ControllerConfig.kv_checksum`), fingerprint; the positions the
request needs; the pool's shapes: a KV that fails is recomputed here, whatever
the policy), and stages the KV in this actor's layout; `insert` writes a staged
KV into the paged pool (checked against it once more); `decode_step` runs one
step (`decode_step_logprobs`: with the logprobs of the rows that ask; `PrefillMeta` carries a
first token's); `rebuild` re-prefills known token contexts into their blocks after a
restart. Pages never leave the actor.

Both are plain classes; `remote_engine.py` wraps them with `ray.remote`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, cast

import jax

from jaxserve.core.limits import DEFAULT_LIMITS
from jaxserve.core.request import SamplingParams, TokenLogprobs
from jaxserve.runtime.compilation.cache import CompileCacheConfig
from jaxserve.runtime.compilation.model_engine import WarmupReport
from jaxserve.runtime.engines.contract import (
    Engine,
    KVCopy,
    KVPages,
    PrefillItem,
    SequenceKV,
    StepBatch,
    StepRow,
    WarmedPages,
    WarmupSpec,
    bucket,
    step_tokens,
)
from jaxserve.runtime.kv_connectors.base import KVIntegrityError, check_pulled_kv, move_kv
from jaxserve.runtime.kv_connectors.ray_pull import (
    ActorPulls,
    ArraySpec,
    HostKV,
    HostShipment,
    JaxTicket,
    LeasedKVBuffer,
    Mechanism,
    PullError,
    check_arrival,
    check_positions,
    fetch,
    fingerprint_of,
    from_host,
    manifest,
    pull_staged,
    run_with_watchdog,
    stage_for_pull,
    start_transfer_server,
    to_host,
)
from jaxserve.runtime.kv_pool import read_sequence, slice_sequence
from jaxserve.runtime.prefill_instance import MIN_PROMPT_BUCKET
from models.config import ModelConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from jaxserve.runtime.guided import GuidedLimits

log = logging.getLogger(__name__)

EngineKind = Literal["model", "fake"]  # the real engine (any family), or the hand-computable one


class ActorRestartedError(RuntimeError):
    """A call reached a restarted actor the controller has not recovered yet: a decode actor without
    its pool, or an actor the controller had warmed that has not been warmed again."""


class IncompatiblePeerError(ValueError):
    """Two instances of one deployment disagree on the model or KV shape; they must not exchange KV."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What one actor runs: role, grid, model source, and which engine (the fake one for tests)."""

    role: Literal["prefill", "decode"]
    tp: int
    pp: int
    model_source: str
    dtype: str = "float32"
    block_size: int = DEFAULT_LIMITS.block_size  # the deployment's `ServingLimits.block_size`
    engine: EngineKind = "model"
    fake_config: ModelConfig | None = None
    quantization: str | None = None  # the weights' precision (`models.quantize`); None: the source's own
    # the driver's persistent compilation cache (`CompileCacheConfig.current()`), turned on in the actor before its
    # engine is built: without it every actor compiled every program again on every start (452 s for SmolLM2)
    compile_cache: CompileCacheConfig | None = None

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp


@dataclasses.dataclass(frozen=True)
class ModelSignature:
    """What two peers must agree on before KV moves between them."""

    model: str
    dtype: str
    num_layers: int
    num_heads: int
    head_size: int
    block_size: int

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: str, block_size: int) -> ModelSignature:
        return cls(cfg.name, dtype, cfg.num_layers, cfg.num_heads, cfg.hidden_size // cfg.num_heads, block_size)


def check_compatible(a: ModelSignature, b: ModelSignature, a_name: str, b_name: str) -> None:
    """Raise IncompatiblePeerError naming every field where `a` and `b` differ."""
    diffs = [
        f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in dataclasses.fields(ModelSignature)
        if getattr(a, f.name) != getattr(b, f.name)
    ]
    if diffs:
        raise IncompatiblePeerError(f"{a_name} and {b_name} cannot exchange KV caches: " + "; ".join(diffs))


@dataclasses.dataclass(frozen=True)
class ActorInfo:
    name: str
    pid: int
    node_id: str
    node_ip: str
    num_devices: int
    signature: ModelSignature
    model_config: ModelConfig
    stage_layers: tuple[int, ...]
    computes_logprobs: bool = False  # the actor's engine has the `logprobs` capability


@dataclasses.dataclass(frozen=True)
class ActorWarmed:
    """What an actor's `warmup` compiled before it returned (the rest compiles on its background thread)."""

    seconds: float
    prefill_shapes: tuple[tuple[int, int], ...] = ()  # (rows, tokens)
    step_shapes: tuple[tuple[int, int, int], ...] = ()  # (rows, tokens, table width)
    num_background: int = 0  # programs left to the background thread


@dataclasses.dataclass(frozen=True)
class PrefillMeta:
    request_id: str
    first_token: int
    num_tokens: int
    num_bytes: int
    first_logprobs: TokenLogprobs | None = None


@dataclasses.dataclass(frozen=True)
class BufferStats:
    num_held: int
    num_expired: int
    num_pulled: int
    num_cancelled: int


@dataclasses.dataclass(frozen=True)
class PullOrder:
    request_id: str
    source: ActorHandle
    source_name: str
    item: PrefillItem  # the prompt, for recompute
    mechanism: Mechanism | None = None  # None: the actor's configured mechanism
    start: int = 0  # the decode side holds positions ..start (a prefix-cache hit): move start.. only
    num_tokens: int = 0  # with start > 0: how many positions from start on to move


@dataclasses.dataclass(frozen=True)
class PullReport:
    request_id: str
    num_bytes: int
    seconds: float
    num_failed_attempts: int
    recomputed: bool
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class RebuildItem:
    """A sequence to restore after a restart: every token whose KV the pool held, and its blocks."""

    request_id: str
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    sampling: SamplingParams
    seed: int


@dataclasses.dataclass(frozen=True)
class DecodeStats:
    num_pulls: int
    num_failed_pulls: int
    num_recomputed: int
    num_staged: int


def suffix(kv: SequenceKV, start: int, num_tokens: int) -> SequenceKV:
    """Positions `start` .. `start + num_tokens` of a dense KV (padded like a prefill's); all of it when start is 0."""
    if start == 0:
        return kv
    return slice_sequence(kv, start, bucket(num_tokens, MIN_PROMPT_BUCKET))


def build_engine(spec: EngineSpec) -> Engine:
    devices = jax.devices()[: spec.num_devices]
    if len(devices) < spec.num_devices:
        raise RuntimeError(f"{spec.role} actor needs {spec.num_devices} devices, its process sees {len(devices)}")
    if spec.engine == "fake":
        from jaxserve.runtime.engines.fake import FakeEngine

        assert spec.fake_config is not None, "the fake engine needs fake_config"
        return FakeEngine(spec.fake_config, devices, tp=spec.tp, pp=spec.pp)
    from jaxserve.runtime.engines.model import ModelEngine

    return ModelEngine.load(
        spec.model_source, devices, tp=spec.tp, pp=spec.pp, dtype=spec.dtype, quantization=spec.quantization
    )


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch: one per XLA compile


class _CompileCounter:
    """Counts this process's XLA compilations (JAX's monitoring events)."""

    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1


class _ActorBase:
    def __init__(self, name: str, spec: EngineSpec, pulls: ActorPulls) -> None:
        self._compiles = _CompileCounter()
        if spec.compile_cache is not None:  # before the first compile: JAX reads the setting once
            spec.compile_cache.enable()
        self.name = name
        self.spec = spec
        self.transfer = pulls.transfer
        self.pull_failure = pulls.failure
        self.checksum = pulls.checksum
        self.engine = build_engine(spec)
        self._signature = ModelSignature.of(self.engine.model_config, spec.dtype, spec.block_size)
        self._stage_layers = self.engine.kv_layout().stage_layers
        self._server = start_transfer_server() if self.transfer.mechanism == "jax" else None
        self.warmed = False  # this incarnation ran `warmup` (a restart starts cold again)
        self.pages: KVPages | None = None  # the paged pool (decode; prefill with prefix caching)

    def init_pages(self, num_blocks: int, block_size: int) -> None:
        self.pages = self.engine.init_pages(num_blocks, block_size)

    def _require_pages(self) -> KVPages:
        if self.pages is None:  # a fresh incarnation: Ray restarted this actor between two calls
            raise ActorRestartedError(f"{self.name} (pid {os.getpid()}) has no KV pool: restarted, not rebuilt")
        return self.pages

    def info(self) -> ActorInfo:
        import ray

        ctx = ray.get_runtime_context()
        return ActorInfo(
            self.name, os.getpid(), ctx.get_node_id(), ray.util.get_node_ip_address(), len(jax.devices()),
            self._signature, self.engine.model_config, self._stage_layers,
            self.engine.capabilities.logprobs,
        )  # fmt: skip

    def ping(self) -> int:
        return os.getpid()

    def set_guided(self, tokenizer_json: str, eos_token_ids: tuple[int, ...], limits: GuidedLimits) -> bool:
        """Give this process's engine the masks of guided requests: a `GuidedDecoder` of its own, built from the
        controller's tokenizer (a matcher is replayed from each row's tokens, so nothing else travels). False if the
        engine cannot mask its logits."""
        if not hasattr(self.engine, "guided"):
            return False
        import tokenizers

        from jaxserve.runtime.guided import GuidedDecoder

        tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        vocab = self.engine.model_config.vocab_size
        self.engine.guided = GuidedDecoder(tokenizer, vocab, eos_token_ids, limits)  # type: ignore[attr-defined]
        return True

    def num_compiles(self) -> int:
        """XLA compilations in this process so far (a restarted actor counts from 0)."""
        return self._compiles.count

    def warmup(self, spec: WarmupSpec, on_pool: bool, hold: bool = False) -> ActorWarmed:
        """Compile every padded shape `spec` allows (`Engine.warmup`; with `spec.background` the rest on this
        process's compile thread); what it compiled before returning. An engine that cannot (the fake one) does
        nothing. `on_pool`: warm on this actor's paged pool. `hold`: keep the background compiles until
        `start_background_warmup` (the controller starts every instance's once all are ready)."""
        if not self.engine.capabilities.bucket_warmup:
            self.warmed = True
            return ActorWarmed(0.0)
        started = time.monotonic()
        if hold:
            self.engine.hold_background_warmup()
        if on_pool and self.pages is not None:
            report = self.engine.warmup(spec, self.pages)
            if report.pages is not None:
                self.pages = report.pages
        else:
            report = self._warm(self.engine, spec)
        self.warmed = True
        seconds = time.monotonic() - started
        if not isinstance(report, WarmupReport):  # an engine with bucket warm-ups that reports no shapes
            return ActorWarmed(seconds)
        return ActorWarmed(seconds, report.prefill_shapes, report.step_shapes, report.num_background)

    def start_background_warmup(self) -> None:
        self.engine.start_background_warmup()

    def stop_background_warmup(self, timeout_s: float) -> None:
        self.engine.stop_background_warmup(timeout_s)

    def compile_cache_dir(self) -> str | None:
        """The persistent compilation cache this process reads and fills (None: none)."""
        cache = CompileCacheConfig.current()
        return cache.directory if cache is not None else None

    def step_compiled(self, rows: Sequence[StepRow], block_size: int) -> tuple[bool, bool]:
        """`Engine.step_compiled`, and whether the background warm-up is done (`background_warmup_done`)."""
        done = self.background_warmup_done()
        return done or self.engine.step_compiled(rows, block_size), done

    def kv_copy_compiled(self, kind: KVCopy, padded: int, from_padded: int = 0) -> tuple[bool, bool]:
        """`Engine.kv_copy_compiled`, and whether the background warm-up is done (`background_warmup_done`)."""
        done = self.background_warmup_done()
        return done or self.engine.kv_copy_compiled(kind, padded, from_padded), done

    def background_warmup_done(self) -> bool:
        """Whether no background compile runs or waits now (then every `*_compiled` answer is True for good)."""
        return self.engine.background_warmup_done(0.0)

    def is_warm(self) -> bool:
        return self.warmed

    def _require_warm(self, warm: bool) -> None:
        if warm and not self.warmed:  # the controller warmed an earlier incarnation: Ray restarted this one
            raise ActorRestartedError(f"{self.name} (pid {os.getpid()}) is cold: restarted, not warmed again")

    def _warm(self, engine: Engine, spec: WarmupSpec) -> WarmedPages:
        return engine.warmup(spec)

    def signature(self) -> ModelSignature:
        return self._signature


class PrefillActor(_ActorBase):
    def __init__(self, name: str, spec: EngineSpec, pulls: ActorPulls) -> None:
        super().__init__(name, spec, pulls)
        self.buffer = LeasedKVBuffer(self.transfer.lease_s)
        self._uuids = itertools.count((os.getpid() << 20) + 1)
        reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)
        reaper.start()

    def _reap(self) -> None:
        while True:
            time.sleep(min(self.transfer.lease_s / 4, 0.25))
            self.buffer.expire(time.monotonic())

    def prefill(self, items: Sequence[PrefillItem], warm: bool = False) -> list[PrefillMeta]:
        """Run the batch and hold each KV under a lease. `warm`: the caller warmed this actor; a cold
        (restarted) incarnation refuses rather than compile under traffic."""
        self._require_warm(warm)
        result = self.engine.prefill(items)
        jax.block_until_ready([s.dense_kv for s in result.sequences])
        at = time.monotonic()
        out = []
        for seq in result.sequences:
            self.buffer.put(seq.request_id, seq.dense_kv, at)
            out.append(PrefillMeta(seq.request_id, seq.first_token, seq.num_tokens, seq.num_bytes, seq.first_logprobs))
        return out

    def prefill_rows(self, batch: StepBatch, warm: bool = False) -> list[PrefillMeta]:
        """Prefix caching: run the prompt rows (uncached suffixes) on this actor's pool, then hold each
        prompt's whole KV (read back from its blocks) under a lease, as `prefill` does."""
        self._require_warm(warm)
        tokens, logprobs, pages = step_tokens(self.engine, batch, self._require_pages())
        self.pages = pages
        out = []
        kvs = []
        for row, token, lp in zip(batch.rows, tokens, logprobs, strict=True):
            n = row.start_position + len(row.token_ids)
            kv = read_sequence(pages, row.block_table, n, bucket(n, MIN_PROMPT_BUCKET))
            kvs.append(kv)
            out.append(PrefillMeta(row.request_id, int(token), n, sum(s.num_bytes for s in kv), lp))
        jax.block_until_ready(kvs)
        at = time.monotonic()
        for meta, kv in zip(out, kvs, strict=True):
            self.buffer.put(meta.request_id, kv, at)
        return out

    def renew(self, request_ids: Sequence[str]) -> int:
        """Extend the leases of the ids still held; returns how many leases ran out so far (all time)."""
        self.buffer.renew(request_ids, time.monotonic())
        return self.buffer.num_expired

    def cancel(self, request_ids: Sequence[str]) -> int:
        return self.buffer.cancel(request_ids)

    def _lend(self, request_id: str, start: int, num_tokens: int) -> SequenceKV | None:
        kv = self.buffer.lend(request_id, time.monotonic())
        return None if kv is None else suffix(kv, start, num_tokens)

    def _fingerprint(self, kv: SequenceKV) -> int | None:
        return fingerprint_of(kv) if self.checksum else None

    def take_host(self, request_id: str, start: int = 0, num_tokens: int = 0) -> HostShipment | None:
        """Object-store pull: the KV (positions `start` .. `start + num_tokens` when `start` > 0) as host arrays,
        with its manifest and fingerprint (None if gone). It stays lent until the controller cancels it."""
        kv = self._lend(request_id, start, num_tokens)
        if kv is None:
            return None
        return HostShipment(to_host(kv), manifest(kv), self._fingerprint(kv))

    def offer_jax(self, request_id: str, start: int = 0, num_tokens: int = 0) -> JaxTicket | None:
        """JAX-transfer pull: stage the KV (from `start`, as `take_host`) on one device and register it with
        the transfer server."""
        kv = self._lend(request_id, start, num_tokens)
        if kv is None:
            return None
        if self._server is None:
            raise PullError(f"{self.name} runs no transfer server (mechanism {self.transfer.mechanism!r})")
        arrays = stage_for_pull(kv)
        uuid = next(self._uuids)
        self._server.await_pull(uuid, arrays)  # type: ignore[attr-defined]
        return JaxTicket(self._server.address(), uuid, manifest(kv), self._fingerprint(kv))  # type: ignore[attr-defined]

    def buffer_stats(self) -> BufferStats:
        b = self.buffer
        return BufferStats(len(b), b.num_expired, b.num_pulled, b.num_cancelled)


class DecodeActor(_ActorBase):
    def __init__(self, name: str, spec: EngineSpec, pulls: ActorPulls) -> None:
        super().__init__(name, spec, pulls)
        self.layout = self.engine.kv_layout()
        self._staged: dict[str, SequenceKV] = {}
        self._discarded: set[str] = set()  # pulls whose request ended while they ran: dropped when they land
        self._staged_lock = threading.Lock()
        self._peers_checked: set[str] = set()
        self.num_pulls = 0
        self.num_failed_pulls = 0
        self.num_recomputed = 0

    def init_pages(self, num_blocks: int, block_size: int) -> None:
        super().init_pages(num_blocks, block_size)
        self._staged.clear()

    def _check_peer(self, order: PullOrder) -> None:
        if order.source_name in self._peers_checked:
            return
        import ray

        try:
            theirs = cast(ModelSignature, fetch(order.source.signature.remote(), self.transfer.pull_timeout_s))
        except ray.exceptions.RayError:
            return  # the peer is down; the pull below fails over, and the check runs at the next contact
        check_compatible(theirs, self._signature, order.source_name, self.name)
        self._peers_checked.add(order.source_name)

    def _fetch(self, order: PullOrder) -> tuple[SequenceKV, int]:
        """The KV `order` names, checked (`_check_arrival`) and in this actor's layout; its size in bytes."""
        timeout = self.transfer.pull_timeout_s
        rid = order.request_id
        if (order.mechanism or self.transfer.mechanism) == "jax":
            offer: object = order.source.offer_jax.remote(rid, order.start, order.num_tokens)
            ticket = cast(JaxTicket | None, fetch(offer, timeout))
            if ticket is None:
                raise PullError(f"{order.source_name} no longer holds the KV of {rid!r} (pulled, expired or lost)")
            server = self._server
            kv = run_with_watchdog(lambda: pull_staged(server, ticket, timeout), timeout + 1.0, f"pull {rid!r}")
            self._check_arrival(order, kv, ticket.specs, ticket.fingerprint)
            return move_kv(kv, self.layout), ticket.num_bytes
        shipment = cast(
            HostShipment | None, fetch(order.source.take_host.remote(rid, order.start, order.num_tokens), timeout)
        )
        if shipment is None:
            raise PullError(f"{order.source_name} no longer holds the KV of {rid!r} (pulled, expired or lost)")
        kv = from_host(shipment.kv)
        self._check_arrival(order, kv, shipment.specs, shipment.fingerprint)
        return move_kv(kv, self.layout), shipment.num_bytes

    def _check_arrival(
        self, order: PullOrder, kv: SequenceKV, specs: Sequence[ArraySpec], fingerprint: int | None
    ) -> None:
        """KVIntegrityError unless `kv` is what the prefill actor sent and holds every position the request needs
        (the pool's shapes are checked after the regrouping, in `pull`)."""
        check_arrival(kv, specs, fingerprint, order.request_id, order.source_name)
        check_positions(kv, len(order.item.token_ids) - order.start, order.request_id)

    def pull(self, order: PullOrder, warm: bool = False) -> PullReport:
        """Stage one request's KV here: pulled from its prefill actor, or recomputed when that fails.
        `warm`: as for `PrefillActor.prefill` (a cold incarnation refuses)."""
        import ray

        self._require_warm(warm)
        self._check_peer(order)
        started_at = time.monotonic()
        failures: list[str] = []
        damaged = False
        for _ in range(1 + self.pull_failure.num_retries):
            try:
                kv, num_bytes = self._fetch(order)
                if self.pages is not None:  # a pool to write it into: the KV must fit it
                    check_pulled_kv(kv, len(order.item.token_ids) - order.start, self.pages, order.request_id)
            except KVIntegrityError as e:  # it moved, but wrong: recomputed below, whatever the policy
                failures.append(str(e))
                self.num_failed_pulls += 1
                damaged = True
                break
            except (PullError, ray.exceptions.RayError) as e:
                failures.append(repr(e))
                self.num_failed_pulls += 1
                if isinstance(e, PullError) and "no longer holds" in str(e):
                    break  # the KV is gone; asking again cannot bring it back
                continue
            jax.block_until_ready(kv)
            self._stage(order.request_id, kv)
            order.source.cancel.remote([order.request_id])  # staged here: the prefill side may free it now
            self.num_pulls += 1
            seconds = time.monotonic() - started_at
            return PullReport(order.request_id, num_bytes, seconds, len(failures), False)
        if self.pull_failure.on_failure == "fail" and not damaged:
            raise PullError(f"KV pull of {order.request_id!r} from {order.source_name} failed: {failures[-1]}")
        kv = self.engine.prefill([order.item]).sequences[0].dense_kv  # the prompt again, on this actor's devices
        kv = suffix(kv, order.start, order.num_tokens)
        jax.block_until_ready(kv)
        self._stage(order.request_id, kv)
        self.num_recomputed += 1
        seconds = time.monotonic() - started_at
        return PullReport(order.request_id, 0, seconds, len(failures), True, failures[-1])

    def has_staged(self, request_id: str) -> bool:
        return request_id in self._staged

    def _stage(self, request_id: str, kv: SequenceKV) -> None:
        with self._staged_lock:
            if request_id in self._discarded:  # its request ended while this pull ran
                self._discarded.remove(request_id)
                return
            self._staged[request_id] = kv

    def discard(self, request_id: str) -> bool:
        """Drop a staged KV that will not be inserted (its request ended while it was pulled); True if one was
        staged. A pull of it still running drops what it fetches when it lands."""
        with self._staged_lock:
            if self._staged.pop(request_id, None) is not None:
                return True
            self._discarded.add(request_id)
            return False

    def staged_host(self, request_id: str) -> tuple[HostKV, list[list[tuple[int, ...]]], list[str]]:
        """For tests: a staged KV as host arrays, each array's shard shapes and sharding spec."""
        kv = self._staged[request_id]
        shard_shapes = [[tuple(s.data.shape) for s in a.addressable_shards] for st in kv for a in (st.k, st.v)]
        specs = [str(a.sharding.spec) for st in kv for a in (st.k, st.v)]  # type: ignore[attr-defined]
        return to_host(kv), shard_shapes, specs

    def insert(self, request_id: str, num_tokens: int, block_table: Sequence[int]) -> bool:
        """Write a staged KV into the pool; False if nothing usable is staged under that id (lost with a
        restart, or one that does not fit the pool: `check_pulled_kv`); the caller then re-prefills it."""
        with self._staged_lock:
            kv = self._staged.pop(request_id, None)
        if kv is None:
            return False
        pages = self._require_pages()
        try:
            check_pulled_kv(kv, num_tokens, pages, request_id)  # before the pool (donated by insert) is touched
        except KVIntegrityError as e:
            log.warning("%s: %s; prefilling it again", self.name, e)
            return False
        self.pages = self.engine.insert(kv, num_tokens, pages, block_table)
        return True

    def _warm(self, engine: Engine, spec: WarmupSpec) -> WarmedPages:
        warmed = engine.warmup(spec, self._require_pages())
        if warmed.pages is not None:
            self.pages = warmed.pages
        return warmed

    def decode_step(self, batch: StepBatch) -> list[int]:
        tokens, self.pages = self.engine.decode_step(batch, self._require_pages())
        return [int(t) for t in tokens]

    def decode_step_logprobs(self, batch: StepBatch) -> tuple[list[int], list[TokenLogprobs | None]]:
        tokens, logprobs, self.pages = step_tokens(self.engine, batch, self._require_pages())
        return [int(t) for t in tokens], logprobs

    def rebuild(self, items: Sequence[RebuildItem]) -> None:
        """Re-prefill each context and write its KV into its blocks (the pool after a restart)."""
        pages = self._require_pages()
        if not items:
            return
        prefill_items = [PrefillItem(i.request_id, i.token_ids, i.sampling, i.seed) for i in items]
        result = self.engine.prefill(prefill_items)
        for item, seq in zip(items, result.sequences, strict=True):
            pages = self.engine.insert(seq.dense_kv, len(item.token_ids), pages, item.block_table)
        self.pages = jax.block_until_ready(pages)

    def stats(self) -> DecodeStats:
        return DecodeStats(self.num_pulls, self.num_failed_pulls, self.num_recomputed, len(self._staged))
