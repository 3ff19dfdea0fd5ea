"""Controller: the front door of a deployment. Requests in, token streams out.

A request's life (disaggregated):

1. `submit()` checks it fits (`check_fits`: `core.request.validate_request`), applies admission control
   (OverloadedError when the prefill queues hold `admission.max_queued_requests`), stamps `arrival_at` and
   puts it on the prefill instance with the shortest queue
   (`scheduling.choose_prefill_instance`, through `routing.Router`). It returns a `RequestStream`
   (`streams.py`).
2. The prefill instance's thread prefills it in an FCFS batch, streams the
   first token through `emit()`, and keeps its KV in its buffer; `on_prefilled`
   then assigns the least-loaded decode instance
   (`scheduling.choose_decode_instance`).
3. That decode instance pulls the KV when it has blocks and batch room, then
   streams one token per step through `emit()` until a stop rule ends it.
4. The final `TokenChunk` carries `finish_reason` and the `RequestTimings`;
   the observer (metrics) hears about every finished request and transfer.

Prefix caching (`ControllerConfig.prefix_policy.enabled`, on by default; see docs/prefix_caching.md):
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

Where each job lives: routing choices in `routing.py`, the move / re-prefill rules in `recovery.py`,
bucket and hand-off warm-up in `compilation/deployment.py`, the steps of a live switch in `switch.py`
(`SwitchSteps`, the controller's `switch_steps`), the routed / staged / retiring instances in `instance_set.py`.
This file owns the request table (`_live`, with the switch's pinned warm-up requests) and the one lock that
guards it with the instance set, and calls them.

`shutdown()` stops new requests (ShuttingDownError), lets the in-flight ones
drain for `drain_timeout_s`, aborts the rest and stops threads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import jax

from jaxserve.core.errors import InvalidRequestError, OverloadedError, ShuttingDownError
from jaxserve.core.plan import DeploymentPlan
from jaxserve.core.request import (
    FinishReason,
    GenerateRequest,
    RequestLimits,
    RequestTimings,
    SamplingParams,
    TokenChunk,
    validate_request,
)
from jaxserve.runtime.api import ControllerStats, FaultStats, InstanceStats, ServingController
from jaxserve.runtime.colocated_instance import ColocatedConfig, ColocatedInstance
from jaxserve.runtime.compilation.deployment import (
    BucketWarmup,
    WarmupConfig,
    start_background_warmups,
    warm_up_deployment,
)
from jaxserve.runtime.config import AdmissionConfig, ControllerConfig, Observer, WorkloadHook
from jaxserve.runtime.decode_instance import DecodeConfig, DecodeInstance
from jaxserve.runtime.guided import GuidedDecoder
from jaxserve.runtime.instance_set import InstanceSet
from jaxserve.runtime.instances import (
    EngineFactory,
    Instance,
    PlacedInstance,
    build_engines,
    checkpoint_text_tools,
)
from jaxserve.runtime.kv_connectors.base import TransferFactory
from jaxserve.runtime.kv_connectors.in_process import InProcessTransfer
from jaxserve.runtime.prefill_instance import PrefillConfig, PrefillInstance
from jaxserve.runtime.recovery import move_error, needs_moving
from jaxserve.runtime.routing import Router, enqueue, live_fronts
from jaxserve.runtime.sampling import default_seed
from jaxserve.runtime.streams import RequestStream
from jaxserve.runtime.switch import SwitchableController, SwitchHost, SwitchSteps
from jaxserve.runtime.worker import FaultCounters, FaultKind, LiveRequest, Worker, now
from models.config import ModelConfig

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from models.checkpoint import CheckpointChatTemplate

__all__ = [  # the config types are `config.py`'s, named here too (where callers have always found them)
    "AdmissionConfig",
    "Controller",
    "ControllerConfig",
    "ControllerStats",
    "FaultStats",
    "Instance",
    "InstanceStats",
    "Observer",
    "RequestStream",
    "WarmupConfig",
    "WorkloadHook",
]

log = logging.getLogger(__name__)


class Controller:
    """Coordinates a deployment's instances: admission, streams, hand-offs and moves.

    The choices are made elsewhere (`routing.Router`, `recovery`, `compilation.deployment`,
    `instance_set.InstanceSet`, a live switch's `switch.SwitchSteps`); this class owns the request table (`_live`:
    request id -> (LiveRequest, RequestStream)) and the lock that guards it together with the instance set.
    """

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
        # the checkpoint's chat template (`models.checkpoint.load_chat_template`); None: jaxserve's built-in one
        self.chat_template: CheckpointChatTemplate | None = None
        self.model_config: ModelConfig = placed[0].engine.model_config
        self.faults = faults or FaultCounters()
        self.lock = threading.Lock()  # guards the request table and the instance set together
        self._guided: GuidedDecoder | None = None  # built on the first guided request (`guided_decoder`)
        self._guided_lock = threading.Lock()
        self._live: dict[str, tuple[LiveRequest, RequestStream]] = {}
        self.shutting_down = False
        self.started = False
        cfg = self.config
        self.router = Router(cfg.limits.block_size, cfg.prefix_policy)
        # routed, staged and retiring instances (the live switch: `jaxserve/runtime/switch.py`)
        self.instance_set = InstanceSet()
        self._make_transfer: TransferFactory = transfer or functools.partial(
            InProcessTransfer, checksum=self.config.kv_checksum
        )
        self._pinned: dict[str, DecodeInstance] = {}  # switch warm-up request -> the decode instance it must use
        self._internal: set[str] = set()  # switch warm-up request ids (not the workload's)
        self.workload_hook: WorkloadHook | None = None
        self.switch_steps = SwitchSteps(self)  # a live switch's steps on these instances (`switch.py`)
        for p in placed:
            self.instance_set.add_routed(self.make_instance(p))
            self.placed_of[p.name] = p
        mc = self.model_config
        self.max_prompt_tokens = cfg.admission.max_prompt_tokens or mc.max_position_embeddings - 1
        self.max_tokens_limit = cfg.admission.max_tokens_limit or mc.max_position_embeddings

    def make_instance(self, p: PlacedInstance) -> Instance:
        """An instance (not started) for a placed engine. Records nothing: the caller adds it to `placed_of` once
        built, so a build that raises (e.g. a pool that does not fit in memory) leaves no trace."""
        cfg = self.config
        if p.spec.role == "prefill":
            if not p.engine.capabilities.prefill:
                raise TypeError(f"{p.name} needs an engine with the prefill role, got {type(p.engine).__name__}")
            pc = PrefillConfig(
                limits=dataclasses.replace(cfg.limits, num_kv_blocks=cfg.prefill_pool_blocks),  # its own pool
                prefix_policy=cfg.prefix_policy,
            )
            return PrefillInstance(p.name, p.engine, pc, self, self._on_prefilled)
        if not p.engine.capabilities.decode:
            raise TypeError(f"{p.name} needs an engine with the decode role, got {type(p.engine).__name__}")
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
            from jaxserve.runtime.engines.model import model_engine_factory

            engine_factory = model_engine_factory(model_source, dtype=dtype)
        placed = build_engines(plan, engine_factory, devices)
        tokenizer, chat_template = checkpoint_text_tools(model_source)
        controller = cls(placed, plan, config, transfer=transfer, observer=observer, tokenizer=tokenizer)
        controller.chat_template = chat_template
        return controller

    # ---- the instances -------------------------------------------------------------
    @property
    def prefill_instances(self) -> list[PrefillInstance]:
        """The routed prefill instances."""
        return self.instance_set.prefill

    @property
    def decode_instances(self) -> list[DecodeInstance]:
        return self.instance_set.decode

    @property
    def colocated_instances(self) -> list[ColocatedInstance]:
        return self.instance_set.colocated

    @property
    def placed_of(self) -> dict[str, PlacedInstance]:
        """Every instance holding devices (routed, staged, retiring) -> what it was placed as."""
        return self.instance_set.placed_of

    @property
    def instances(self) -> list[Instance]:
        return self.instance_set.all()

    @property
    def instance_names(self) -> tuple[str, ...]:
        return tuple(inst.name for inst in self.instances)

    def _may_hold(self, request_id: str) -> list[Instance]:
        """The instances that may hold `request_id`: routed and retiring ones; the staged ones too for a
        switch's own warm-up request (the only kind a staged instance takes). So cancelling, failing or moving a
        client's request never waits on a staged instance's lock, which its bucket warm-up holds across a compile."""
        with self.lock:
            internal = request_id in self._internal
            return self.instance_set.all() if internal else self.instance_set.serving()

    def step_records(self, since: float = 0.0) -> list[dict[str, object]]:
        """Each instance's recent steps (`StepRecord`s that ended after `since`, monotonic seconds)."""
        out: list[dict[str, object]] = []
        for inst in self.instances:
            steps = [r.to_dict() for r in inst.step_log.copy() if r.at > since]  # copy: one C call
            out.append({"name": inst.name, "role": inst.role, "steps": steps})
        return out

    # ---- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        if self.started:
            return
        self.started = True
        for inst in self.instances:
            inst.start()

    def warmup(self, *, start_background: bool = True) -> float:
        """Compile before the first client; seconds taken. What and when: `compilation.deployment.warm_up_deployment`
        (the bucket warm-up, one short request through every front instance, then the background compiles, or with
        `start_background=False` at the caller's `start_background_compiles()`)."""
        front: Sequence[PrefillInstance | ColocatedInstance] = self.prefill_instances or self.colocated_instances
        return warm_up_deployment(
            self.instance_set.routed(),
            front,
            self.submit,
            self.bucket_warmup(),
            self.model_config.filler_token_id,
            start_background=start_background,
        )

    def start_background_compiles(self) -> None:
        """Start the background compiles `warmup(start_background=False)` left waiting (none: nothing)."""
        start_background_warmups(self.instance_set.routed())

    def bucket_warmup(self) -> BucketWarmup:
        """This deployment's bucket warm-up (the routed instances at start; a live switch: the staged)."""
        max_seq_len = min(self.max_prompt_tokens + self.max_tokens_limit, self.model_config.max_position_embeddings)
        return BucketWarmup(self.config.warmup, self.max_prompt_tokens, max_seq_len)

    def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish for up to `drain_timeout_s`, abort the rest, stop.

        During a live switch: the instances it staged are discarded at once and the switch fails at its next
        step (nothing of the new plan is routed after this); instances it already routed away drain with the rest.
        """
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        with self.lock:
            self.shutting_down = True  # a live switch in progress stops at its next step (ShuttingDownError)
        # a switch's new instances, not routed yet: stopped (a compile holding one is left behind), warm-ups ended
        self.switch_steps.discard_staged(join_timeout_s=2.0)
        deadline = now() + timeout
        while now() < deadline:
            with self.lock:
                if not self._live.keys() - self._internal:
                    break
            threading.Event().wait(0.01)
        with self.lock:
            remaining = list(self._live)
        for rid in remaining:
            self.cancel(rid)
        for inst in self.instances:
            inst.stop()
        # Every engine's background compiles are asked to stop first, so their programs in progress end together
        # (one 5 s wait in all, not one per engine); one still compiling then is joined at interpreter exit
        # (compilation/background.py: a process must not finalize while a thread is inside XLA).
        for inst in self.instances:
            inst.engine.stop_background_warmup(timeout_s=0.0)
        compiles_deadline = now() + 5.0
        for inst in self.instances:
            inst.engine.stop_background_warmup(timeout_s=max(0.0, compiles_deadline - now()))

    def __enter__(self) -> Controller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- requests ----------------------------------------------------------------
    def check_fits(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError naming the first bad field (`core.request.validate_request`)."""
        validate_request(request, self.request_limits(probe_logprobs=request.sampling.logprobs is not None))
        if request.sampling.guided is not None:  # compiles its grammar (cached; bounded in time): a 400 if it fails
            self.guided_decoder().check(request.sampling.guided)

    def guided_decoder(self) -> GuidedDecoder:
        """The masks of guided requests (`runtime/guided.py`), built on first use from the tokenizer and handed to
        every engine; `InvalidRequestError` where there is no tokenizer or an engine cannot mask its logits."""
        engines = [inst.engine for inst in self.instances]
        if not all(hasattr(e, "guided") for e in engines):
            names = sorted({type(e).__name__ for e in engines if not hasattr(e, "guided")})
            raise InvalidRequestError(
                f"response_format needs engines that mask logits; this deployment runs {', '.join(names)}",
                field="response_format",
            )
        with self._guided_lock:
            if self._guided is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("response_format needs the model's tokenizer", field="response_format")
                mc = self.model_config
                self._guided = GuidedDecoder(self.tokenizer, mc.vocab_size, mc.eos_token_ids)
            for e in engines:  # every call: a switch may have added engines
                e.guided = self._guided  # type: ignore[attr-defined]
            return self._guided

    def request_limits(self, *, probe_logprobs: bool = True) -> RequestLimits:
        """What this deployment accepts now. `probe_logprobs`: ask every instance's engine whether it computes
        logprobs (the instances change with a switch); without it (a request that asks none) they count as on."""
        mc, cfg = self.model_config, self.config
        caching_prefill = cfg.prefix_policy.enabled and bool(self.prefill_instances)
        return RequestLimits(
            vocab_size=mc.vocab_size,
            max_positions=mc.max_position_embeddings,
            max_prompt_tokens=self.max_prompt_tokens,
            max_tokens_limit=self.max_tokens_limit,
            kv_pool_tokens=cfg.limits.require_num_kv_blocks() * cfg.limits.block_size,
            prefill_pool_tokens=cfg.prefill_pool_blocks * cfg.limits.block_size if caching_prefill else None,
            logprobs=self.computes_logprobs() if probe_logprobs else True,
        )

    def computes_logprobs(self) -> bool:
        """Whether every instance's engine reports logprobs (its `logprobs` capability)."""
        return all(i.engine.capabilities.logprobs for i in self.instances)

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Queue a request; thread-safe. Raises InvalidRequestError, OverloadedError, ShuttingDownError."""
        if self.shutting_down:
            raise ShuttingDownError("the server is shutting down")
        if not self.started:
            raise ShuttingDownError("the controller is not started; call start()")
        self.check_fits(request)
        with self.lock:
            front: Sequence[PrefillInstance | ColocatedInstance] = self.prefill_instances or self.colocated_instances
            alive = live_fronts(self.prefill_instances, self.decode_instances, self.colocated_instances)
            if not alive:
                dead = next(inst for inst in self.instances if inst.error is not None)
                raise dead.dead_error()
            if self.shutting_down:
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
            stream = RequestStream(request.request_id, self.cancel)
            self._live[request.request_id] = (live, stream)
            # Under the lock: a switch never retires an instance in between.
            local_decodes = self.decode_instances if self.prefill_instances else []  # colocated: none
            error = self.router.admit(alive, local_decodes, live)
        if error is not None:
            self.fail(live, error)
        elif self.workload_hook is not None:
            self.workload_hook.on_arrival(live.timings.arrival_at, live.num_prompt_tokens)
        return stream

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Async token stream; cancelling the consuming task cancels the request."""
        async for chunk in self.submit(request).async_chunks():
            yield chunk

    def cancel(self, request_id: str) -> None:
        """Abort a request wherever it is; its blocks or buffer slot are freed now. Unknown ids are ignored."""
        with self.lock:
            entry = self._live.pop(request_id, None)
        if entry is None:
            return
        live, stream = entry
        live.cancelled = True
        for inst in self._may_hold(request_id):
            inst.cancel(request_id)
        live.timings.finished_at = now()
        self._finish_observed(live, "abort")
        stream.push(TokenChunk(request_id, (), "abort", live.timings))

    # ---- worker callbacks (Emitter) ---------------------------------------------
    def emit(self, live: LiveRequest, token_ids: tuple[int, ...], finish_reason: FinishReason | None) -> None:
        with self.lock:
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
            stream.push(TokenChunk(live.request_id, token_ids, finish_reason, live.timings, logprobs))
        else:
            stream.push(TokenChunk(live.request_id, token_ids, logprobs=logprobs))

    def fail(self, live: LiveRequest, error: BaseException) -> None:
        with self.lock:
            entry = self._live.get(live.request_id)
            if entry is None or entry[0] is not live:
                return
            del self._live[live.request_id]
        for inst in self._may_hold(live.request_id):
            inst.cancel(live.request_id)
        entry[1].push(error)

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
        with self.lock:
            pinned = self._pinned.pop(live.request_id, None)
            if pinned is not None:
                target, error = pinned, enqueue(pinned, live, source)
            else:
                target, error = self.router.hand_off(self.decode_instances, live, source)
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
        streamed: see `recovery.py`).
        """
        log.error("instance %s died (%r); moving its %d requests", instance.name, instance.error, len(held))
        self.move_held(held, f"instance {instance.name} died: {instance.error!r}", fault="rerouted")

    def move_held(self, held: Sequence[LiveRequest], why: str, *, fault: FaultKind | None = None) -> None:
        """Move each of `held` (requests a stopped or dead instance held) that no live instance holds to live
        instances (`_move`), counting `fault` for each one moved."""
        for live in held:
            if not needs_moving(self._may_hold(live.request_id), live):
                continue
            if fault is not None:
                self.faults.count(fault)
            self._move(live, why)

    def _move(self, live: LiveRequest, why: str) -> None:
        """Queue `live` on the live front instance with the shortest queue (resumed if tokens were streamed)."""
        with self.lock:
            entry = self._live.get(live.request_id)
            if entry is None or entry[0] is not live:
                return  # finished or cancelled meanwhile
        with self.lock:
            error = move_error(
                self.router, self.prefill_instances, self.decode_instances, self.colocated_instances, live, why
            )
        if error is not None:
            self.fail(live, error)

    # ---- the live switch's requests (its steps: `switch.SwitchSteps`) --------------------------
    def submit_pinned(
        self,
        index: int,
        prompt: tuple[int, ...],
        front: PrefillInstance | ColocatedInstance,
        decode: DecodeInstance | None,
    ) -> RequestStream:
        """A switch's own request (a warm-up): 2 tokens of `prompt` through `front` and, after its hand-off,
        exactly `decode`; internal (not the workload's, invisible to the monitor; a staged instance may take it).
        ShuttingDownError once `shutdown()` has begun."""
        rid = f"switch-warmup-{front.name}-{index}-{time.monotonic_ns()}"
        request = GenerateRequest(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        live = LiveRequest(request=request, seed=default_seed(rid), timings=RequestTimings(arrival_at=now()))
        stream = RequestStream(rid, self.cancel)
        with self.lock:
            if self.shutting_down:
                raise ShuttingDownError("the server is shutting down: the switch stops during its warm-up")
            self._live[rid] = (live, stream)
            self._internal.add(rid)
            if decode is not None:
                self._pinned[rid] = decode
            error = enqueue(front, live)
        if error is not None:
            self.fail(live, error)
        return stream

    def end_pinned(self, request_ids: Sequence[str]) -> None:
        """The switch is done with these requests: one that failed before its hand-off never reached
        `_on_prefilled`, so its pin goes here too."""
        with self.lock:
            for rid in request_ids:
                self._internal.discard(rid)
                self._pinned.pop(rid, None)

    def drop_pinned(self) -> list[str]:
        """Under `lock` (the switch discarding its staged instances): every switch request is the workload's
        like any other from here on (so cancelling it never waits on a staged instance) and loses its pin;
        returns their ids, for the caller to cancel."""
        warmups = sorted(self._internal)
        self._internal.clear()
        for rid in warmups:
            self._pinned.pop(rid, None)
        return warmups

    # ---- introspection -----------------------------------------------------------
    def stats(self) -> ControllerStats:
        """Every serving (routed or retiring) instance's own stats and the fault counters; only local locks, never a
        remote call, never a staged instance's (a live switch's new instance compiling under it)."""
        with self.lock:
            num_live = len(self._live)
            serving = self.instance_set.serving()  # staged instances are not serving (and may be compiling)
        return ControllerStats(
            instances=tuple(inst.stats() for inst in serving),
            num_live_requests=num_live,
            num_transfers=sum(d.num_transfers for d in self.decode_instances),
            kv_transfer_bytes=sum(d.kv_transfer_bytes for d in self.decode_instances),
            faults=self.faults.snapshot(),
            kv_transfer_tokens=sum(d.kv_transfer_tokens for d in self.decode_instances),
        )

    def fault_stats(self) -> FaultStats:
        """The fault counters alone (what `stats().faults` holds)."""
        return self.faults.snapshot()


def _is_a_serving_controller(controller: Controller) -> ServingController:
    return controller  # mypy checks that Controller (and so RayController) implements the Protocol


def _is_a_switchable_controller(controller: Controller) -> SwitchableController:
    return controller  # mypy checks that Controller (and so RayController) implements the switch's Protocols


def _is_a_switch_host(controller: Controller) -> SwitchHost:
    return controller
