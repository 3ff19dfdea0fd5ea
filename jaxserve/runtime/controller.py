"""Controller: the front door of a deployment. Requests in, token streams out.

A request's life (disaggregated):

1. `submit()` checks it fits (`check_fits`), applies admission control (OverloadedError when
   the prefill queues hold `max_queued_requests`), stamps `arrival_at` and
   puts it on the prefill instance with the shortest queue
   (`scheduling.choose_prefill_instance`). It returns a `RequestStream`.
2. The prefill instance's thread prefills it in an FCFS batch, streams the
   first token through `emit()`, and keeps its KV in its buffer; `on_prefilled`
   then assigns the least-loaded decode instance
   (`scheduling.choose_decode_instance`).
3. That decode instance pulls the KV when it has blocks and batch room, then
   streams one token per step through `emit()` until a stop rule ends it.
4. The final `TokenChunk` carries `finish_reason` and the `RequestTimings`;
   the observer (metrics) hears about every finished request and transfer.

Prefix caching (`ControllerConfig.prefix_policy.enabled`, off by default; see docs/prefix_caching.md):
every instance keeps KV blocks content-addressed (`PrefixCache`), step 1 picks the prefill
instance with `scheduling.choose_prefill_instance_cached` (cached prefix against queued uncached
tokens), step 2 the decode instance with `choose_decode_instance_cached` (the one holding the
conversation, within an imbalance bound), and a pull moves only what the decode instance lacks.
Conditional disaggregation (`prefix_policy.local_prefill_tokens` > 0): in step 1 the decode
instance is chosen first; when the part of the prompt it lacks is shorter than the threshold
(`scheduling.prefill_locally`) it prefills the prompt itself (`enqueue_local`), no transfer.

Colocated deployments skip 2-3: the colocated instance does both phases.
`cancel()` (or `RequestStream.cancel()`, or cancelling the task consuming
`generate()`) removes the request wherever it is and frees its blocks or
buffer slot at once; the stream ends with finish_reason "abort". A request
cancelled between its prefill and the decode hand-off is dropped there.

Failures (both backends; the Ray backend's proxies end in the same hooks):

* a worker that dies hands its requests to `on_instance_dead`: a request not
  yet prefilled is queued on a live prefill (or colocated) instance; one with
  tokens streamed is *resumed* there (prompt + streamed tokens but the last are
  prefilled, the sample discarded) and continues on a live decode instance from
  its next token, at the same position and sample index, so the stream neither
  loses nor repeats a token and seeded sampling is unchanged. A request whose
  KV a live instance already holds stays there. With nothing alive to take it,
  it fails with EngineDeadError; new requests avoid dead instances.
* a failed KV pull costs only that request (see `decode_instance.py`):
  `recompute()` resumes it on a live prefill instance, or it fails alone.
* `stats().faults` counts these events as they happen (`FaultCounters`).

`shutdown()` stops new requests (ShuttingDownError), lets the in-flight ones
drain for `drain_timeout_s`, aborts the rest and stops threads.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

import jax

from jaxserve.core.errors import EngineDeadError, InvalidRequestError, JaxServeError, OverloadedError, ShuttingDownError
from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.plan import DeploymentPlan
from jaxserve.core.request import FinishReason, GenerateRequest, RequestTimings, SamplingParams, TokenChunk
from jaxserve.core.scheduling import (
    NO_PREFIX_CACHING,
    CachedDecodeLoad,
    CachedPrefillLoad,
    PrefixPolicy,
    choose_decode_instance,
    choose_decode_instance_cached,
    choose_prefill_instance,
    choose_prefill_instance_cached,
    prefill_locally,
)
from jaxserve.runtime.api import ControllerStats, FaultStats, InstanceStats, ServingController
from jaxserve.runtime.colocated_instance import ColocatedConfig, ColocatedInstance
from jaxserve.runtime.decode_instance import DecodeConfig, DecodeInstance, PullFailureConfig
from jaxserve.runtime.engines.contract import BucketWarmable, DecodeEngine, LogprobEngine, PrefillEngine
from jaxserve.runtime.instances import EngineFactory, PlacedInstance, build_engines
from jaxserve.runtime.kv_transfer import InProcessTransfer, TransferFactory
from jaxserve.runtime.prefill_instance import PrefillConfig, PrefillInstance
from jaxserve.runtime.sampling import default_seed
from jaxserve.runtime.worker import FaultCounters, FaultKind, LiveRequest, Worker, now
from models.config import OPTConfig

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["Controller", "ControllerConfig", "ControllerStats", "FaultStats", "InstanceStats", "RequestStream"]

log = logging.getLogger(__name__)


class Observer(Protocol):
    """Metrics hook: called from worker threads; keep it quick."""

    def on_request_finished(
        self, timings: RequestTimings, num_prompt_tokens: int, num_output_tokens: int, finish_reason: FinishReason
    ) -> None: ...

    def on_kv_transfer(self, num_bytes: int, seconds: float) -> None: ...


class WorkloadHook(Protocol):
    """What the workload monitor hears (`jaxserve/tools/replan_loop.py`): admissions and finishes; keep it quick."""

    def on_arrival(self, arrival_at: float, num_prompt_tokens: int) -> None: ...

    def on_finish(self, timings: RequestTimings, num_output_tokens: int, finish_reason: FinishReason) -> None: ...


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    """What the front door accepts: request sizes (`Controller.check_fits`) and queue depth (`submit`)."""

    max_queued_requests: int = 256  # over all prefill (or colocated) queues; beyond: OverloadedError
    retry_after_s: float = 1.0  # the Retry-After an OverloadedError carries
    max_tokens_limit: int | None = None  # largest max_tokens (default: the model's positions)
    max_prompt_tokens: int | None = None  # longest prompt (default: the model's positions - 1)


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """What `Controller.warmup()` compiles before the first client (and a live switch before routing)."""

    buckets: bool = False  # every padded shape the limits allow (`serve` turns it on)
    logprobs: bool = False  # with buckets: the logprob programs of those shapes too


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """A deployment's knobs, one small config per concern (docs/knobs.md): the serving limits (block_size,
    num_kv_blocks, max_decode_batch, max_batch_tokens, prefill_buffer_slots; jaxserve/core/limits.py, which
    the simulator and plan files share), what a failed KV pull does, admission, warm-up, prefix caching."""

    limits: ServingLimits = DEFAULT_LIMITS  # num_kv_blocks: per decode / colocated instance, must be a number here
    pull_failure: PullFailureConfig = dataclasses.field(default_factory=PullFailureConfig)
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)
    warmup: WarmupConfig = dataclasses.field(default_factory=WarmupConfig)
    # Prefix caching (docs/prefix_caching.md): `enabled` turns on content-addressed KV blocks on every instance and
    # cache-aware routing (off by default); the routing weights and the local-prefill threshold. The simulator's too.
    prefix_policy: PrefixPolicy = NO_PREFIX_CACHING
    prefill_num_kv_blocks: int | None = None  # a caching prefill instance's pool (default: num_kv_blocks)
    decode_steps_per_call: int = 1  # decode / colocated: up to N decode steps per engine call (multi-step)
    drain_timeout_s: float = 30.0  # shutdown(): in-flight requests get this long before they are aborted

    def __post_init__(self) -> None:
        self.limits.require_num_kv_blocks()
        if self.decode_steps_per_call < 1:
            raise ValueError(f"decode_steps_per_call must be >= 1, got {self.decode_steps_per_call}")

    @property
    def prefill_pool_blocks(self) -> int:
        """A caching prefill instance's pool: `prefill_num_kv_blocks`, else the limits' `num_kv_blocks`."""
        if self.prefill_num_kv_blocks is not None:
            return self.prefill_num_kv_blocks
        return self.limits.require_num_kv_blocks()


_END = object()


class RequestStream:
    """The token stream of one request: iterate (blocking) for `TokenChunk`s; `cancel()` to abort."""

    def __init__(self, request_id: str, controller: Controller) -> None:
        self.request_id = request_id
        self._controller = controller
        self._cond = threading.Condition()
        self._items: collections.deque[TokenChunk | BaseException] = collections.deque()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[TokenChunk | BaseException]] | None = None
        self.finished = False

    def _push(self, item: TokenChunk | BaseException) -> None:
        with self._cond:
            if self.finished:
                return
            if isinstance(item, BaseException) or item.finish_reason is not None:
                self.finished = True
            if self._async is not None:
                loop, queue = self._async
                loop.call_soon_threadsafe(queue.put_nowait, item)
            else:
                self._items.append(item)
                self._cond.notify_all()

    def _attach_async(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[TokenChunk | BaseException]:
        queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        with self._cond:
            while self._items:
                queue.put_nowait(self._items.popleft())
            self._async = (loop, queue)
        return queue

    async def async_chunks(self) -> AsyncGenerator[TokenChunk, None]:
        """The chunks on the running event loop; leaving the loop early (or cancelling the task) cancels."""
        queue = self._attach_async(asyncio.get_running_loop())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not self.finished:
                self.cancel()

    def next_chunk(self, timeout_s: float | None = None) -> TokenChunk | None:
        """The next chunk; None at the end of the stream. Raises the request's error, or TimeoutError."""
        with self._cond:
            if not self._items and self.finished:
                return None
            if not self._cond.wait_for(lambda: bool(self._items), timeout=timeout_s):
                raise TimeoutError(f"no tokens for {self.request_id!r} within {timeout_s} s")
            item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> TokenChunk:
        chunk = self.next_chunk()
        if chunk is None:
            raise StopIteration
        return chunk

    def collect(self, timeout_s: float | None = None) -> tuple[list[int], TokenChunk]:
        """Every token id and the final chunk (blocking)."""
        ids: list[int] = []
        while True:
            chunk = self.next_chunk(timeout_s)
            if chunk is None:
                raise RuntimeError("stream ended without a final chunk")
            ids.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                return ids, chunk

    def cancel(self) -> None:
        self._controller.cancel(self.request_id)


Instance = PrefillInstance | DecodeInstance | ColocatedInstance


class Controller:
    def __init__(
        self,
        placed: Sequence[PlacedInstance],
        plan: DeploymentPlan,
        config: ControllerConfig | None = None,
        *,
        transfer: TransferFactory | None = None,
        observer: Observer | None = None,
        tokenizer: Tokenizer | None = None,
        faults: FaultCounters | None = None,
    ) -> None:
        self.config = config or ControllerConfig()
        self.plan = plan
        self.observer = observer
        self.tokenizer: Tokenizer | None = tokenizer
        self.model_config: OPTConfig = placed[0].engine.model_config
        self.faults = faults or FaultCounters()
        self._lock = threading.Lock()
        self._live: dict[str, tuple[LiveRequest, RequestStream]] = {}
        self._shutting_down = False
        self._started = False
        self.prefill_instances: list[PrefillInstance] = []
        self.decode_instances: list[DecodeInstance] = []
        self.colocated_instances: list[ColocatedInstance] = []
        self._make_transfer: TransferFactory = transfer or InProcessTransfer
        # the live switch (`jaxserve/runtime/switch.py`): staged instances warm up unrouted, retiring ones drain
        self.placed_of: dict[str, PlacedInstance] = {}
        self._staged: list[Instance] = []
        self._retiring: list[Instance] = []
        self._pinned: dict[str, DecodeInstance] = {}  # switch warm-up request -> the decode instance it must use
        self._internal: set[str] = set()  # switch warm-up request ids (not the workload's)
        self.workload_hook: WorkloadHook | None = None
        for p in placed:
            self._route_instance(self._make_instance(p))
        mc, cfg = self.model_config, self.config
        self.max_prompt_tokens = cfg.admission.max_prompt_tokens or mc.max_position_embeddings - 1
        self.max_tokens_limit = cfg.admission.max_tokens_limit or mc.max_position_embeddings

    def _make_instance(self, p: PlacedInstance) -> Instance:
        """An instance (not started) for a placed engine."""
        cfg = self.config
        self.placed_of[p.name] = p
        if p.spec.role == "prefill":
            if not isinstance(p.engine, PrefillEngine):
                raise TypeError(f"{p.name} needs a PrefillEngine, got {type(p.engine).__name__}")
            pc = PrefillConfig(
                limits=dataclasses.replace(cfg.limits, num_kv_blocks=cfg.prefill_pool_blocks),  # its own pool
                prefix_policy=cfg.prefix_policy,
            )
            return PrefillInstance(p.name, p.engine, pc, self, self._on_prefilled)
        if not isinstance(p.engine, DecodeEngine):
            raise TypeError(f"{p.name} needs a DecodeEngine, got {type(p.engine).__name__}")
        if p.spec.role == "decode":
            dc = DecodeConfig(
                limits=cfg.limits,
                pull_failure=cfg.pull_failure,
                prefix_policy=cfg.prefix_policy,
                decode_steps_per_call=cfg.decode_steps_per_call,
            )
            return DecodeInstance(p.name, p.engine, dc, self, self._make_transfer(p.engine), self._on_kv_transfer)
        cc = ColocatedConfig(
            limits=dataclasses.replace(cfg.limits, chunk_size=p.spec.chunk_size),  # the plan instance's chunk
            prefix_policy=cfg.prefix_policy,
            decode_steps_per_call=cfg.decode_steps_per_call,
        )
        return ColocatedInstance(p.name, p.engine, cc, self)

    def _route_instance(self, inst: Instance) -> None:
        if isinstance(inst, PrefillInstance):
            self.prefill_instances.append(inst)
        elif isinstance(inst, DecodeInstance):
            self.decode_instances.append(inst)
        else:
            self.colocated_instances.append(inst)

    @classmethod
    def from_plan(
        cls,
        model_source: str,
        plan: DeploymentPlan,
        devices: Sequence[jax.Device] | None = None,
        engine_factory: EngineFactory | None = None,
        config: ControllerConfig | None = None,
        *,
        observer: Observer | None = None,
        dtype: str = "float32",
        transfer: TransferFactory | None = None,
    ) -> Controller:
        """Place `plan` on `devices` (default: all), one engine per instance loaded from `model_source`;
        `transfer` moves KV into each decode instance (default `InProcessTransfer`)."""
        if engine_factory is None:
            from jaxserve.runtime.engines.opt import opt_engine_factory

            engine_factory = opt_engine_factory(model_source, dtype=dtype)
        placed = build_engines(plan, engine_factory, devices)
        tokenizer = None
        try:
            from models.checkpoint import load_tokenizer

            tokenizer = load_tokenizer(model_source)
        except Exception:  # a preset name or a directory without tokenizer files
            tokenizer = None
        return cls(placed, plan, config, transfer=transfer, observer=observer, tokenizer=tokenizer)

    @property
    def instances(self) -> list[Instance]:
        return [
            *self.prefill_instances,
            *self.decode_instances,
            *self.colocated_instances,
            *self._staged,
            *self._retiring,
        ]

    @property
    def instance_names(self) -> tuple[str, ...]:
        return tuple(inst.name for inst in self.instances)

    def step_records(self, since: float = 0.0) -> list[dict[str, object]]:
        """Each instance's recent steps (`StepRecord`s that ended after `since`, monotonic seconds)."""
        out: list[dict[str, object]] = []
        for inst in self.instances:
            steps = [r.to_dict() for r in inst.step_log.copy() if r.at > since]  # copy: one C call
            out.append({"name": inst.name, "role": inst.role, "steps": steps})
        return out

    # ---- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for inst in self.instances:
            inst.start()

    def warmup(self) -> float:
        """Compile before the first client; seconds taken.

        With `warmup.buckets`, every engine that can (`BucketWarmable`) first runs each padded shape its
        instance's limits allow (prefill rows x tokens up to the token cap; decode rows x block-table
        widths up to the longest sequence; chunk shapes), so no user waits on XLA. Then one short
        request goes through every front instance, which also warms the hand-off path.
        """
        started = time.monotonic()
        if self.config.warmup.buckets:
            self._warm_buckets()
        front: Sequence[PrefillInstance | ColocatedInstance] = self.prefill_instances or self.colocated_instances
        bos = self.model_config.bos_token_id
        sampling = SamplingParams(max_tokens=2, ignore_eos=True)
        streams = [self.submit(GenerateRequest(f"warmup-{i}", (bos, bos), sampling)) for i in range(len(front))]
        for stream in streams:
            stream.collect(timeout_s=600)
        return time.monotonic() - started

    def _warm_buckets(self, instances: Sequence[Instance] | None = None) -> None:
        """Compile every padded shape of `instances` (default: the routed ones; a live switch: the staged)."""
        chosen = [*self.prefill_instances, *self.decode_instances, *self.colocated_instances]
        chosen = chosen if instances is None else list(instances)
        max_seq_len = min(self.max_prompt_tokens + self.max_tokens_limit, self.model_config.max_position_embeddings)
        cfg = self.config
        for p in (i for i in chosen if isinstance(i, PrefillInstance)):
            if isinstance(p.engine, BucketWarmable):
                p.engine.warmup(
                    num_blocks=1,
                    block_size=cfg.limits.block_size,
                    max_batch_tokens=p.config.limits.max_batch_tokens,
                    max_seq_len=self.max_prompt_tokens,
                    max_prefill_rows=p.config.limits.prefill_buffer_slots,  # a batch never outgrows the buffer's free slots
                    decode=False,
                    logprobs=cfg.warmup.logprobs,
                )
                if p.config.prefix_policy.enabled:  # cached prompts run as paged prompt rows on the instance's pool
                    with p.cond:
                        warmed = p.engine.warmup(
                            num_blocks=p.config.limits.require_num_kv_blocks(),
                            block_size=p.config.limits.block_size,
                            max_decode_batch_size=p.config.limits.prefill_buffer_slots,
                            max_seq_len=self.max_prompt_tokens,
                            chunk_size=p.config.limits.max_batch_tokens,
                            prefill=False,
                            decode=False,
                            pages=p.pages,
                            logprobs=cfg.warmup.logprobs,
                        )
                        if warmed.pages is not None:
                            p.pages = warmed.pages
        pooled = [i for i in chosen if isinstance(i, (DecodeInstance, ColocatedInstance))]
        for inst in pooled:
            if not isinstance(inst.engine, BucketWarmable):
                continue
            # A colocated instance's prompt rows share a budget: the chunk, or (prefill priority) the token cap.
            chunk = (
                (inst.config.limits.chunk_size or inst.config.limits.max_batch_tokens)
                if isinstance(inst, ColocatedInstance)
                else None
            )
            with inst.cond:  # no request is running yet; the pool is the instance's own
                warmed = inst.engine.warmup(
                    num_blocks=inst.config.limits.require_num_kv_blocks(),
                    block_size=inst.config.limits.block_size,
                    max_decode_batch_size=inst.config.limits.max_decode_batch,
                    max_seq_len=max_seq_len,
                    chunk_size=chunk,
                    prefill=False,
                    pages=inst.pages,
                    decode_steps=inst.config.decode_steps_per_call,
                    logprobs=cfg.warmup.logprobs,
                )
                if warmed.pages is not None:
                    inst.pages = warmed.pages

    def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish for up to `drain_timeout_s`, abort the rest, stop."""
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        with self._lock:
            self._shutting_down = True
        deadline = now() + timeout
        while now() < deadline:
            with self._lock:
                if not self._live:
                    break
            threading.Event().wait(0.01)
        with self._lock:
            remaining = list(self._live)
        for rid in remaining:
            self.cancel(rid)
        for inst in self.instances:
            inst.stop()

    def __enter__(self) -> Controller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- requests ----------------------------------------------------------------
    def check_fits(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError unless `request` fits this deployment: its id, its prompt (vocabulary,
        length), its sampling's ranges (`SamplingParams.check_ranges`), logprobs, positions and KV pool."""
        mc = self.model_config
        if not isinstance(request.request_id, str) or not request.request_id:
            raise InvalidRequestError("request_id must be a non-empty string", field="request_id")
        prompt = request.prompt_token_ids
        if len(prompt) == 0:
            raise InvalidRequestError("the prompt is empty", field="prompt_token_ids")
        for tok in prompt:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < mc.vocab_size:
                raise InvalidRequestError(
                    f"prompt token id {tok!r} is outside the vocabulary [0, {mc.vocab_size})", field="prompt_token_ids"
                )
        if len(prompt) > self.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens, the limit is {self.max_prompt_tokens}", field="prompt_token_ids"
            )
        request.sampling.check_ranges(max_tokens_limit=self.max_tokens_limit, vocab_size=mc.vocab_size)
        if request.sampling.logprobs is not None and not self.computes_logprobs():
            raise InvalidRequestError(
                "logprobs are not available: this deployment's engines do not compute them (a fake or timed engine)",
                field="logprobs",
            )
        total = len(prompt) + request.sampling.max_tokens
        if total > mc.max_position_embeddings:
            raise InvalidRequestError(
                f"prompt ({len(prompt)}) + max_tokens ({request.sampling.max_tokens}) exceeds the model's "
                f"{mc.max_position_embeddings} positions",
                field="max_tokens",
            )
        capacity = self.config.limits.require_num_kv_blocks() * self.config.limits.block_size
        if self.config.prefix_policy.enabled and self.prefill_instances:
            prefill_capacity = self.config.prefill_pool_blocks * self.config.limits.block_size
            if len(prompt) > prefill_capacity:
                raise InvalidRequestError(
                    f"prompt ({len(prompt)}) exceeds a prefill instance's KV pool ({prefill_capacity} tokens)",
                    field="prompt_token_ids",
                )
        if total > capacity:
            raise InvalidRequestError(
                f"prompt + max_tokens ({total}) exceeds one instance's KV pool ({capacity} tokens)", field="max_tokens"
            )

    def computes_logprobs(self) -> bool:
        """Whether every instance's engine reports logprobs (`LogprobEngine`)."""
        return all(isinstance(i.engine, LogprobEngine) and i.engine.computes_logprobs() for i in self.instances)

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Queue a request; thread-safe. Raises InvalidRequestError, OverloadedError, ShuttingDownError."""
        if self._shutting_down:
            raise ShuttingDownError("the server is shutting down")
        if not self._started:
            raise ShuttingDownError("the controller is not started; call start()")
        self.check_fits(request)
        with self._lock:
            front: Sequence[PrefillInstance | ColocatedInstance] = self.prefill_instances or self.colocated_instances
            alive = [inst for inst in front if inst.error is None]
            if not alive or (self.prefill_instances and not any(d.error is None for d in self.decode_instances)):
                dead = next(inst for inst in self.instances if inst.error is not None)
                raise dead.dead_error()
            if self._shutting_down:
                raise ShuttingDownError("the server is shutting down")
            if request.request_id in self._live:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in flight", field="request_id")
            queued = sum(inst.num_waiting for inst in front)
            if queued >= self.config.admission.max_queued_requests:
                raise OverloadedError(
                    f"{queued} requests are queued (limit {self.config.admission.max_queued_requests}); retry later",
                    retry_after_s=self.config.admission.retry_after_s,
                )
            seed = request.sampling.seed if request.sampling.seed is not None else default_seed(request.request_id)
            live = LiveRequest(request=request, seed=seed, timings=RequestTimings(arrival_at=now()))
            stream = RequestStream(request.request_id, self)
            self._live[request.request_id] = (live, stream)
            local = self._local_prefill_target(live)
            # Under the lock: a switch never retires an instance in between.
            error = _enqueue_local(local, live) if local is not None else None
            if local is None or _died(local, error):
                error = self._enqueue_front(alive, live)
        if error is not None:
            self.fail(live, error)
        elif self.workload_hook is not None:
            self.workload_hook.on_arrival(live.timings.arrival_at, live.num_prompt_tokens)
        return stream

    # ---- routing -----------------------------------------------------------------
    def _choose_front(self, alive: Sequence[PrefillInstance | ColocatedInstance], live: LiveRequest) -> int:
        """The prefill (or colocated) instance for `live`: cache-aware when caching is on."""
        if not self.config.prefix_policy.enabled:
            return choose_prefill_instance([inst.load() for inst in alive])
        bs = self.config.limits.block_size
        loads = []
        for inst in alive:
            load = inst.load()
            loads.append(
                CachedPrefillLoad(inst.num_cached_tokens(live) // bs, load.num_queued_tokens, load.num_queued_requests)
            )
        return choose_prefill_instance_cached(loads, self.config.prefix_policy.weight(bs))

    def _enqueue_front(
        self, alive: list[PrefillInstance | ColocatedInstance], live: LiveRequest
    ) -> JaxServeError | None:
        """Queue `live` on the chosen front instance; one that died since `alive` was taken is skipped."""
        error: JaxServeError | None = EngineDeadError(f"no live instance is left to take {live.request_id!r}")
        while alive:
            target = alive[self._choose_front(alive, live)]
            error = _enqueue(target, live)
            if not _died(target, error):
                return error
            alive.remove(target)
        return error

    def _choose_decode(self, alive: Sequence[DecodeInstance], live: LiveRequest) -> int:
        if not self.config.prefix_policy.enabled:
            return choose_decode_instance([d.load() for d in alive])
        bs = self.config.limits.block_size
        loads = []
        for d in alive:
            load = d.load()
            cached = d.num_cached_tokens(live) // bs
            loads.append(CachedDecodeLoad(cached, load.num_running, load.num_waiting, load.num_free_blocks))
        return choose_decode_instance_cached(loads, self.config.prefix_policy.max_decode_imbalance)

    def _local_prefill_target(self, live: LiveRequest) -> DecodeInstance | None:
        """Conditional disaggregation: the decode instance that should prefill `live` itself, or None."""
        threshold = self.config.prefix_policy.local_prefill_tokens
        if not self.config.prefix_policy.enabled or threshold <= 0 or not self.prefill_instances:
            return None
        alive = [d for d in self.decode_instances if d.error is None]
        if not alive:
            return None
        decode = alive[self._choose_decode(alive, live)]
        if prefill_locally(live.num_prefill_tokens, decode.num_cached_tokens(live, 1), threshold):
            return decode
        return None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Async token stream; cancelling the consuming task cancels the request."""
        async for chunk in self.submit(request).async_chunks():
            yield chunk

    def cancel(self, request_id: str) -> None:
        """Abort a request wherever it is; its blocks or buffer slot are freed now. Unknown ids are ignored."""
        with self._lock:
            entry = self._live.pop(request_id, None)
        if entry is None:
            return
        live, stream = entry
        live.cancelled = True
        for inst in self.instances:
            inst.cancel(request_id)
        live.timings.finished_at = now()
        self._finish_observed(live, "abort")
        stream._push(TokenChunk(request_id, (), "abort", live.timings))

    # ---- worker callbacks (Emitter) ---------------------------------------------
    def emit(self, live: LiveRequest, token_ids: tuple[int, ...], finish_reason: FinishReason | None) -> None:
        with self._lock:
            entry = self._live.get(live.request_id)
            if entry is None or entry[0] is not live:
                return  # cancelled meanwhile
            if finish_reason is not None:
                del self._live[live.request_id]
        stream = entry[1]
        logprobs = live.logprobs_of_last(len(token_ids))
        if finish_reason is not None:
            live.finished = True
            live.timings.finished_at = now()
            self._finish_observed(live, finish_reason)
            stream._push(TokenChunk(live.request_id, token_ids, finish_reason, live.timings, logprobs))
        else:
            stream._push(TokenChunk(live.request_id, token_ids, logprobs=logprobs))

    def fail(self, live: LiveRequest, error: BaseException) -> None:
        with self._lock:
            entry = self._live.get(live.request_id)
            if entry is None or entry[0] is not live:
                return
            del self._live[live.request_id]
        for inst in self.instances:
            inst.cancel(live.request_id)
        entry[1]._push(error)

    def _finish_observed(self, live: LiveRequest, reason: FinishReason) -> None:
        if self.workload_hook is not None and live.request_id not in self._internal:
            self.workload_hook.on_finish(live.timings, len(live.output_ids), reason)
        if self.observer is not None:
            self.observer.on_request_finished(live.timings, live.num_prompt_tokens, len(live.output_ids), reason)

    def _on_kv_transfer(self, num_bytes: int, seconds: float) -> None:
        if self.observer is not None:
            self.observer.on_kv_transfer(num_bytes, seconds)

    def _on_prefilled(self, source: PrefillInstance, live: LiveRequest) -> None:
        if live.cancelled:  # cancelled between its prefill and this hand-off: drop it here
            source.release(live.request_id)
            return
        target: DecodeInstance | None = None
        with self._lock:
            alive = [d for d in self.decode_instances if d.error is None]
            pinned = self._pinned.pop(live.request_id, None)
            error: JaxServeError | None = EngineDeadError("every decode instance is dead")
            if pinned is not None:
                target = pinned
                error = _enqueue(pinned, live, source)
            elif alive:
                # An instance found alive above may die before it takes the request: try the next one.
                while alive:
                    target = alive[self._choose_decode(alive, live)]
                    error = _enqueue(target, live, source)
                    if not _died(target, error):
                        break
                    alive.remove(target)
        if error is not None:
            self.fail(live, error)
        elif target is not None:
            target.start_pulls()  # the pull starts now, off the controller's lock, not at the decode's next step

    def count_fault(self, kind: FaultKind, n: int = 1) -> None:
        self.faults.count(kind, n)

    def recompute(self, live: LiveRequest) -> None:
        """`live`'s KV was lost on its way (a failed pull): prefill it again on a live instance, continue it."""
        self._move(live, "its KV could not be pulled")

    def on_instance_dead(self, instance: Worker, held: Sequence[LiveRequest]) -> None:
        """`instance` died holding `held`: move each request to live instances (or fail it if none is left).

        A request a live instance still holds (e.g. one whose KV a decode instance already pulled)
        stays where it is; the others are queued again (not prefilled yet) or resumed (tokens
        streamed: see the module docstring).
        """
        log.error("instance %s died (%r); moving its %d requests", instance.name, instance.error, len(held))
        for live in held:
            if live.cancelled or live.finished or self._held_by_live_instance(live):
                continue
            self.faults.count("rerouted")
            self._move(live, f"instance {instance.name} died: {instance.error!r}")

    def _held_by_live_instance(self, live: LiveRequest) -> bool:
        for inst in self.instances:
            if inst.error is None:
                with inst.cond:
                    if any(r is live for r in inst.held_requests()):
                        return True
        return False

    def _move(self, live: LiveRequest, why: str) -> None:
        """Queue `live` on the live front instance with the shortest queue (resumed if tokens were streamed)."""
        with self._lock:
            entry = self._live.get(live.request_id)
            if entry is None or entry[0] is not live:
                return  # finished or cancelled meanwhile
        with self._lock:
            front: Sequence[PrefillInstance | ColocatedInstance] = self.prefill_instances or self.colocated_instances
            alive = [inst for inst in front if inst.error is None]
            if not alive or (self.prefill_instances and not any(d.error is None for d in self.decode_instances)):
                error: JaxServeError | None = EngineDeadError(
                    f"{why}, and no live instance is left to continue {live.request_id!r}"
                )
            else:
                log.warning("continuing %s (%d tokens streamed): %s", live.request_id, len(live.output_ids), why)
                error = self._enqueue_front(alive, live)
        if error is not None:
            self.fail(live, error)

    # ---- live switch (driven by jaxserve/runtime/switch.py) ------------------------
    def add_instances(self, placed: Sequence[PlacedInstance]) -> list[Instance]:
        """Build and start instances for `placed`, *staged*: they take no traffic until `route()` names them."""
        clash = {p.name for p in placed} & set(self.placed_of)
        if clash:
            raise ValueError(f"instance names already in use: {sorted(clash)}")
        new = [self._make_instance(p) for p in placed]
        with self._lock:
            self._staged.extend(new)
        if self._started:
            for inst in new:
                inst.start()
        return new

    def warm_up_staged(self, timeout_s: float = 600.0) -> float:
        """Warm every staged instance before it is routed; seconds.

        With `warmup.buckets` (as `serve` runs): first the bucket warm-up `warmup()` runs, on the staged
        instances (every padded shape their limits allow); then the hand-off path of every prefill ->
        decode pair a staged instance is part of, for every padded prompt length (a KV moved between
        meshes of other shapes or devices compiles its resharding per length): requests pinned to the
        pair with prompts of 1, 2, 4, ... tokens and of the longest prompt allowed. Without it: one
        short request pinned through each staged instance.
        """
        started = time.monotonic()
        with self._lock:
            staged = list(self._staged)
            routed_prefills = [p for p in self.prefill_instances if p.error is None]
            routed_decodes = [d for d in self.decode_instances if d.error is None]
        decodes = [i for i in staged if isinstance(i, DecodeInstance)]
        pairs: list[tuple[PrefillInstance | ColocatedInstance, DecodeInstance | None]] = []
        lengths = [2]
        if self.config.warmup.buckets:
            self._warm_buckets(staged)
            longest = min(self.max_prompt_tokens, self.model_config.max_position_embeddings - 2)  # + 2 tokens
            lengths = sorted({*(1 << k for k in range(longest.bit_length())), longest})
            fronts = [i for i in staged if isinstance(i, PrefillInstance | ColocatedInstance)]
            new_prefills = [i for i in fronts if isinstance(i, PrefillInstance)]
            pairs += [(c, None) for c in fronts if isinstance(c, ColocatedInstance)]
            pairs += [(p, d) for p in new_prefills for d in [*routed_decodes, *decodes]]
            pairs += [(p, d) for p in routed_prefills for d in decodes]
        else:
            for k, front in enumerate(i for i in staged if not isinstance(i, DecodeInstance)):
                pool = decodes or routed_decodes
                pairs.append((front, pool[k % len(pool)] if isinstance(front, PrefillInstance) else None))
            covered = {d.name for _, d in pairs if d is not None}
            for k, d in enumerate(d for d in decodes if d.name not in covered):
                pairs.append((routed_prefills[k % len(routed_prefills)], d))
        bos = self.model_config.bos_token_id
        streams = []
        for k, ((front, decode), n) in enumerate(itertools.product(pairs, lengths)):
            rid = f"switch-warmup-{front.name}-{k}-{time.monotonic_ns()}"
            request = GenerateRequest(rid, (bos,) * n, SamplingParams(max_tokens=2, ignore_eos=True))
            live = LiveRequest(request=request, seed=default_seed(rid), timings=RequestTimings(arrival_at=now()))
            stream = RequestStream(rid, self)
            with self._lock:
                self._live[rid] = (live, stream)
                self._internal.add(rid)
                if decode is not None:
                    self._pinned[rid] = decode
                error = _enqueue(front, live)
            if error is not None:
                self.fail(live, error)
            streams.append(stream)
        try:
            for stream in streams:
                stream.collect(timeout_s=timeout_s)
        finally:
            self._internal.difference_update(s.request_id for s in streams)
        return time.monotonic() - started

    def discard_staged(self) -> None:
        """Stop and drop every staged instance (a switch that failed before routing to them)."""
        with self._lock:
            staged, self._staged = self._staged, []
            for inst in staged:
                self.placed_of.pop(inst.name, None)
        for inst in staged:
            inst.stop()

    def route(self, names: Sequence[str]) -> list[Instance]:
        """Atomically make the routed instances exactly `names` (routed or staged ones), in that order.

        New requests (and hand-offs, re-routes) go only to routed instances from here on; the ones left
        out *retire*: they finish what they hold (see `retire_drained`). Returns them.
        """
        with self._lock:
            routed: list[Instance] = [*self.prefill_instances, *self.decode_instances, *self.colocated_instances]
            pool: dict[str, Instance] = {i.name: i for i in [*routed, *self._staged]}
            missing = [n for n in names if n not in pool]
            if missing:
                raise ValueError(f"no routed or staged instance named {missing}")
            chosen = [pool[n] for n in names]
            prefills = [i for i in chosen if isinstance(i, PrefillInstance)]
            decodes = [i for i in chosen if isinstance(i, DecodeInstance)]
            colocated = [i for i in chosen if isinstance(i, ColocatedInstance)]
            if not (bool(prefills) == bool(decodes) and bool(prefills) != bool(colocated)):
                raise ValueError("route either prefill and decode instances, or colocated ones only")
            retired = [i for i in routed if i.name not in names]
            self.prefill_instances[:] = prefills
            self.decode_instances[:] = decodes
            self.colocated_instances[:] = colocated
            self._staged = [i for i in self._staged if i.name not in names]
            self._retiring.extend(retired)
        return retired

    def routed_instances(self) -> list[Instance]:
        """The instances taking new requests now (staged and retiring ones left out)."""
        with self._lock:
            return [*self.prefill_instances, *self.decode_instances, *self.colocated_instances]

    @property
    def retiring(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(i.name for i in self._retiring)

    def num_held_by_retiring(self) -> int:
        with self._lock:
            retiring = list(self._retiring)
        total = 0
        for inst in retiring:
            with inst.cond:
                total += len(inst.held_requests())
        return total

    def retire_drained(self, force: bool = False) -> list[InstanceStats]:
        """Stop each retiring instance that holds nothing and let it go (engine, KV pool and buffers with it).

        With `force`, a retiring instance still holding requests is stopped too and they move to routed
        instances (the re-route path: resumed where their streams stand). Returns the stats each stopped
        instance had last (its KV blocks and buffer slots in use then: 0 unless something leaked).
        """
        with self._lock:
            candidates = list(self._retiring)
        done: list[InstanceStats] = []
        for inst in candidates:
            with self._lock, inst.cond:  # every enqueue happens under _lock: unrouted and empty stays empty
                empty = not inst.held_requests()
            if not empty and not force:
                continue
            inst.stop()
            with inst.cond:
                held = inst.held_requests()
                inst.drop_all()
            for live in held:
                if not (live.cancelled or live.finished or self._held_by_live_instance(live)):
                    self._move(live, f"instance {inst.name} retired by a deployment switch")
            stats = inst.stats()
            with self._lock:
                self._retiring.remove(inst)
                self.placed_of.pop(inst.name, None)
            done.append(stats)
        return done

    # ---- introspection -----------------------------------------------------------
    def stats(self) -> ControllerStats:
        """Every instance's own stats and the fault counters; only local locks, never a remote call."""
        with self._lock:
            num_live = len(self._live)
        return ControllerStats(
            instances=tuple(inst.stats() for inst in self.instances),
            num_live_requests=num_live,
            num_transfers=sum(d.num_transfers for d in self.decode_instances),
            kv_transfer_bytes=sum(d.kv_transfer_bytes for d in self.decode_instances),
            faults=self.faults.snapshot(),
            kv_transfer_tokens=sum(d.kv_transfer_tokens for d in self.decode_instances),
        )

    def fault_stats(self) -> FaultStats:
        """The fault counters alone (what `stats().faults` holds)."""
        return self.faults.snapshot()


def _enqueue(
    target: PrefillInstance | DecodeInstance | ColocatedInstance,
    live: LiveRequest,
    source: PrefillInstance | None = None,
) -> JaxServeError | None:
    """Hand `live` to `target` (a pull from `source` for a decode instance); the error instead of raising it."""
    try:
        if isinstance(target, DecodeInstance):
            assert source is not None
            target.enqueue_pull(live, source)
        else:
            target.enqueue(live)
    except JaxServeError as e:
        return e
    return None


def _died(target: Instance, error: JaxServeError | None) -> bool:
    """True when `target` refused a request because it died after it was chosen (a worker sets `error` on its own)."""
    return isinstance(error, EngineDeadError) and target.error is not None


def _enqueue_local(target: DecodeInstance, live: LiveRequest) -> JaxServeError | None:
    """Hand `live` to a decode instance that prefills its short uncached part itself; the error instead of raising."""
    try:
        target.enqueue_local(live)
    except JaxServeError as e:
        return e
    return None


def _is_a_serving_controller(controller: Controller) -> ServingController:
    return controller  # mypy checks that Controller (and so RayController) implements the Protocol
