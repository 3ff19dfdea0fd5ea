"""A deployment's warm-up: compile what instances will run before a client (or a switch's traffic) waits on XLA.

When: `warm_up_deployment` is the controller's `warmup()` at start (the bucket warm-up, then one short request
through every front instance, which also warms the hand-off path, then the engines' background compiles);
`BucketWarmup.run` is also what a live switch's `warm_up_staged()` runs on the staged instances. What each
engine compiles is its own (`model_engine.py`, from `plan.py`); `WarmupConfig` is the knob.

The parts:

* `warm_buckets(instances, ...)`: every engine that can (its `bucket_warmup` capability) runs each padded shape its
  instance's limits allow (prefill rows x tokens up to the token cap; decode rows x block-table widths
  up to the longest sequence; chunk shapes). The instances warm concurrently (a thread each) and the call
  blocks until all are compiled; pooled instances warm under their condition lock on their own KV pool (no
  request runs yet).
* `handoff_warmups(...)`: which requests a switch sends through its staged instances to warm the
  hand-off path: (front instance, decode instance or None, prompt length) triples. Pure; the
  controller submits them, pinned to the pair, each with its own `handoff_prompt` (with prefix caching,
  warm-up prompts that shared a prefix would pull only their rest, and leave the full pull of their length
  cold on a new pair: the first partial pull of a real request would then compile its resharding).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol

from jaxserve.core.errors import EngineDeadError
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.runtime.colocated_instance import ColocatedInstance
from jaxserve.runtime.decode_instance import DecodeInstance
from jaxserve.runtime.engines.contract import WarmupSpec
from jaxserve.runtime.instances import Instance
from jaxserve.runtime.prefill_instance import PrefillInstance
from jaxserve.runtime.streams import RequestStream
from models.config import ModelConfig

log = logging.getLogger("jaxserve.runtime.controller")  # the switch's warm-up reads as the controller's, as before

HandOff = tuple[PrefillInstance | ColocatedInstance, DecodeInstance | None, int]


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """What `Controller.warmup()` compiles before the first client (and a live switch before routing)."""

    buckets: bool = False  # every padded shape the limits allow (`serve` turns it on)
    logprobs: bool = False  # with buckets: the logprob programs of those shapes too
    # with buckets: compile the buckets that hold all others first, the rest on a background thread while work
    # runs padded up to compiled buckets (`ModelEngine.warmup` with `background`; `serve` turns it on)
    background: bool = False


@dataclasses.dataclass(frozen=True)
class BucketWarmup:
    """A deployment's bucket warm-up: the knob and the limits the controller resolved (`max_seq_len`: the longest
    sequence a decode row holds)."""

    config: WarmupConfig
    max_prompt_tokens: int
    max_seq_len: int

    def run(self, instances: Sequence[Instance], *, start_background: bool = True) -> None:
        warm_buckets(
            instances,
            max_prompt_tokens=self.max_prompt_tokens,
            max_seq_len=self.max_seq_len,
            logprobs=self.config.logprobs,
            background=self.config.background,
            start_background=start_background,
        )


def warm_up_deployment(
    routed: Sequence[Instance],
    fronts: Sequence[PrefillInstance | ColocatedInstance],
    submit: Callable[[GenerateRequest], RequestStream],
    buckets: BucketWarmup,
    filler_token_id: int,
    *,
    start_background: bool = True,
) -> float:
    """Compile before the first client; seconds taken.

    With `buckets.config.buckets`, every engine that can (`bucket_warmup`) first runs each padded shape its
    instance's limits allow (`warm_buckets`), so no user waits on XLA. Then one short request goes through every
    front instance (`submit`: the controller's), which also warms the hand-off path. The background compiles
    (`WarmupConfig.background`) start after it, or with `start_background=False` at the caller's
    `start_background_warmups(routed)` (the server: once it listens, so that neither the warm-up request nor its
    own start waits on them for the cores and the GIL).
    """
    started = time.monotonic()
    if buckets.config.buckets:
        buckets.run(routed, start_background=False)
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    fill = (filler_token_id, filler_token_id)
    streams = [submit(GenerateRequest(f"warmup-{i}", fill, sampling)) for i in range(len(fronts))]
    for stream in streams:
        stream.collect(timeout_s=600)
    if start_background:
        start_background_warmups(routed)
    return time.monotonic() - started


def warm_buckets(
    instances: Sequence[Instance],
    *,
    max_prompt_tokens: int,
    max_seq_len: int,
    logprobs: bool,
    background: bool = False,
    start_background: bool = True,
) -> None:
    """Compile every padded shape of `instances`; `max_seq_len`: the longest sequence a decode row holds,
    `logprobs`: the logprob programs of those shapes too, `background`: only the buckets that hold all others
    before returning, the rest on each engine's background thread (`ModelEngine.warmup`), started once every
    engine's foreground part is done (or, with `start_background=False`, by the caller's
    `start_background_warmups`).

    The instances warm concurrently, one thread each (their engines, pools and locks are their own; XLA
    compiles release the GIL), so the foreground part takes about the longest instance's time on a machine
    with a core per instance, not the sum.
    """
    work: list[Callable[[], None]] = []
    for p in (i for i in instances if isinstance(i, PrefillInstance)):
        if p.engine.capabilities.bucket_warmup:
            work.append(partial(_warm_prefill_instance, p, max_prompt_tokens, logprobs, background))
    for inst in (i for i in instances if isinstance(i, (DecodeInstance, ColocatedInstance))):
        if inst.engine.capabilities.bucket_warmup:
            work.append(partial(_warm_pooled_instance, inst, max_seq_len, logprobs, background))
    if len(work) > 1:
        with ThreadPoolExecutor(len(work), thread_name_prefix="jaxserve-warmup") as pool:
            for future in [pool.submit(w) for w in work]:
                future.result()  # the first failure is raised, once every warm-up has ended
    elif work:
        work[0]()
    if start_background:  # once all foreground warm-ups are done: none slows another's
        start_background_warmups(instances)


def start_background_warmups(instances: Sequence[Instance]) -> None:
    """Start the background compiles `warm_buckets(..., start_background=False)` kept waiting."""
    for engine in [i.engine for i in instances if isinstance(i, (PrefillInstance, DecodeInstance, ColocatedInstance))]:
        engine.start_background_warmup()


def _warm_prefill_instance(p: PrefillInstance, max_prompt_tokens: int, logprobs: bool, background: bool) -> None:
    limits = p.config.limits
    # With prefix caching the same call warms the instance's pool (one background thread per engine): the
    # insert of a batch with no hit, the gather and the paged prompt-row steps of a batch with one.
    caching = p.config.prefix_policy.enabled
    p.engine.hold_background_warmup()  # started by `warm_buckets` once every engine's foreground part is done
    with p.cond:  # no request is running yet; the pool is the instance's own
        spec = WarmupSpec(
            num_blocks=limits.require_num_kv_blocks() if caching else 1,
            block_size=limits.block_size,
            max_decode_batch=limits.prefill_buffer_slots,
            max_batch_tokens=limits.max_batch_tokens,
            max_seq_len=max_prompt_tokens,
            chunk_size=limits.max_batch_tokens if caching else None,
            max_prefill_rows=limits.prefill_buffer_slots,  # a batch never outgrows the buffer's free slots
            decode=False,
            logprobs=logprobs,
            background=background,
            prefix_prefill=caching,
        )
        warmed = p.engine.warmup(spec, p.pages if caching else None)
        if caching and warmed.pages is not None:
            p.pages = warmed.pages


def _warm_pooled_instance(
    inst: DecodeInstance | ColocatedInstance, max_seq_len: int, logprobs: bool, background: bool
) -> None:
    # A colocated instance's prompt rows share a budget: the chunk, or (prefill priority) the token cap.
    limits = inst.config.limits
    chunk = (limits.chunk_size or limits.max_batch_tokens) if isinstance(inst, ColocatedInstance) else None
    inst.engine.hold_background_warmup()
    with inst.cond:  # no request is running yet; the pool is the instance's own
        spec = WarmupSpec(
            num_blocks=limits.require_num_kv_blocks(),
            block_size=limits.block_size,
            max_decode_batch=limits.max_decode_batch,
            max_seq_len=max_seq_len,
            chunk_size=chunk,
            prefill=False,
            decode_steps=inst.config.decode_steps_per_call,
            logprobs=logprobs,
            background=background,
        )
        warmed = inst.engine.warmup(spec, inst.pages)
        if warmed.pages is not None:
            inst.pages = warmed.pages


def handoff_warmups(
    staged: Sequence[Instance],
    routed_prefills: Sequence[PrefillInstance],
    routed_decodes: Sequence[DecodeInstance],
    *,
    every_length: bool,
    longest_prompt: int,
) -> list[HandOff]:
    """The warm-up requests of a switch's `staged` instances: (front, decode or None, prompt length).

    With `every_length` (bucket warm-up on): the hand-off of every prefill -> decode pair a staged instance
    is part of (and each staged colocated instance), for every padded prompt length 1, 2, 4, ... and
    `longest_prompt` (a KV moved between meshes of other shapes or devices compiles its resharding per
    length). Without it: one 2-token request through each staged instance.
    """
    decodes = [i for i in staged if isinstance(i, DecodeInstance)]
    pairs: list[tuple[PrefillInstance | ColocatedInstance, DecodeInstance | None]] = []
    lengths = [2]
    if every_length:
        lengths = sorted({*(1 << k for k in range(longest_prompt.bit_length())), longest_prompt})
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
    return [(front, decode, n) for (front, decode), n in itertools.product(pairs, lengths)]


def handoff_prompt(index: int, num_tokens: int, filler_token_id: int, vocab_size: int) -> tuple[int, ...]:
    """The prompt of hand-off warm-up `index`: `num_tokens` tokens whose first block no other warm-up shares
    (its first token is the index, mod the vocabulary; the rest filler), so no prefix cache serves any of it
    and every warm-up moves its whole KV."""
    return ((filler_token_id + 1 + index) % vocab_size,) + (filler_token_id,) * (num_tokens - 1)


class StagedWarmupHost(Protocol):
    """What a live switch's warm-up needs (`switch.SwitchSteps`): views of the staged instances, the pinned requests."""

    @property
    def model_config(self) -> ModelConfig: ...

    def staged_and_routed(self) -> tuple[list[Instance], list[PrefillInstance], list[DecodeInstance]]: ...

    def submit_pinned(
        self,
        index: int,
        prompt: tuple[int, ...],
        front: PrefillInstance | ColocatedInstance,
        decode: DecodeInstance | None,
    ) -> RequestStream: ...

    def end_pinned(self, request_ids: Sequence[str]) -> None: ...

    def check_still_staged(self, staged: Sequence[Instance]) -> None: ...


def warm_up_staged(host: StagedWarmupHost, buckets: BucketWarmup, longest_prompt: int, timeout_s: float) -> float:
    """Warm a switch's staged instances before they are routed; seconds (`SwitchSteps.warm_up_staged`).

    With `buckets.config.buckets` (as `serve` runs): first the bucket warm-up `warm_up_deployment` runs, on the
    staged instances (every padded shape their limits allow); then the hand-off path of every prefill -> decode
    pair a staged instance is part of, for every padded prompt length up to `longest_prompt` (`handoff_warmups`):
    requests pinned to the pair. Without it: one short request pinned through each staged instance. A warm-up
    request lost with a routed instance that died (a retiring one the switch replaces anyway: nothing routed was
    left to continue it) does not fail the switch; a staged instance that died, a timeout or any other error does
    (the requests still in flight are then the controller's `discard_staged`'s to end).
    """
    started = time.monotonic()
    staged, routed_prefills, routed_decodes = host.staged_and_routed()
    if buckets.config.buckets:
        buckets.run(staged)
    host.check_still_staged(staged)
    warmups = handoff_warmups(
        staged, routed_prefills, routed_decodes, every_length=buckets.config.buckets, longest_prompt=longest_prompt
    )
    cfg = host.model_config
    streams: list[RequestStream] = []
    routes: list[tuple[Instance, ...]] = []  # the instances each warm-up request goes through
    for k, (front, decode, n) in enumerate(warmups):
        prompt = handoff_prompt(k, n, cfg.filler_token_id, cfg.vocab_size)  # no warm-up hits another's prefix
        streams.append(host.submit_pinned(k, prompt, front, decode))
        routes.append((front,) if decode is None else (front, decode))
    deadline = time.monotonic() + timeout_s
    lost: list[str] = []
    for stream, route in zip(streams, routes, strict=True):
        try:
            stream.collect(timeout_s=max(deadline - time.monotonic(), 0.0))
        except TimeoutError as e:
            raise TimeoutError(_warmup_timeout_message(stream.request_id, route, staged, timeout_s)) from e
        except EngineDeadError as e:
            # An instance it went through died and nothing could continue it: a routed one (e.g. a retiring
            # instance that the switch would replace anyway) costs the switch nothing; a staged one fails it
            # just below.
            lost.append(f"{stream.request_id}: {e}")
    host.check_still_staged(staged)
    if lost:
        log.warning("switch warm-up: %d of %d warm-up requests lost with a routed instance (%s)",
                    len(lost), len(streams), lost[0])  # fmt: skip
    host.end_pinned([s.request_id for s in streams])
    return time.monotonic() - started


def _warmup_timeout_message(
    request_id: str, route: Sequence[Instance], staged: Sequence[Instance], timeout_s: float
) -> str:
    """What a switch's warm-up timeout tells the operator: which new instance did not answer, and what to do."""
    new = [i.name for i in route if i in staged] or [i.name for i in route]
    through = " -> ".join(i.name for i in route)
    return (
        f"the new instance {' / '.join(new)} gave no token for its warm-up request ({through}, {request_id!r}) within "
        f"the switch's warm-up timeout of {timeout_s:g} s: it may still be compiling or it hangs. If its compile is "
        f"slow (a large model, bucket warm-up), raise the warm-up timeout (`PlanSwitcher(warmup_timeout_s=...)`); "
        f"otherwise check {' / '.join(new)}'s log (and its device) for a stuck step"
    )
