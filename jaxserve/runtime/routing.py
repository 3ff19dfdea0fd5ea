"""Routing: which instance takes a request, at admission, at the prefill -> decode hand-off and on a move.

Inputs: the routed instances (the controller passes them, under its lock) and the request. Outputs: the
instance chosen, with the request queued on it, or the error that refused it (returned, never raised, so
the caller fails the request after releasing its lock). Nothing here blocks but the chosen instance's
own condition lock while it queues the request; there is no thread and no state of its own.

The choices themselves are `jaxserve/core/scheduling.py`'s pure policies over the instances' loads:
the shortest prefill queue (`choose_prefill_instance`) and the least-loaded decode instance
(`choose_decode_instance`), or with prefix caching their cache-aware forms (cached blocks against
queued work: `choose_prefill_instance_cached`, `choose_decode_instance_cached`) and conditional
disaggregation (`prefill_locally`: a decode instance prefills a prompt whose uncached part is short).
An instance found alive may die before it takes the request (a worker sets `error` on its own thread):
the next choice among the others is tried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxserve.core.errors import EngineDeadError, JaxServeError
from jaxserve.core.scheduling import (
    CachedDecodeLoad,
    CachedPrefillLoad,
    PrefixPolicy,
    choose_decode_instance,
    choose_decode_instance_cached,
    choose_prefill_instance,
    choose_prefill_instance_cached,
    prefill_locally,
)
from jaxserve.runtime.colocated_instance import ColocatedInstance
from jaxserve.runtime.decode_instance import DecodeInstance
from jaxserve.runtime.instances import Instance
from jaxserve.runtime.prefill_instance import PrefillInstance
from jaxserve.runtime.worker import LiveRequest

FrontInstance = PrefillInstance | ColocatedInstance


def live_fronts(
    prefills: Sequence[PrefillInstance], decodes: Sequence[DecodeInstance], colocated: Sequence[ColocatedInstance]
) -> list[FrontInstance]:
    """The live instances a new (or moved) request can start on; [] when the deployment cannot serve it
    (no live front instance, or a disaggregated one with no live decode instance)."""
    front: Sequence[FrontInstance] = prefills or colocated
    alive = [inst for inst in front if inst.error is None]
    if prefills and not any(d.error is None for d in decodes):
        return []
    return alive


@dataclasses.dataclass(frozen=True)
class Router:
    """The routing choices of one deployment (its prefix-caching policy; `policy.enabled` turns caching on)."""

    block_size: int
    policy: PrefixPolicy

    def choose_front(self, alive: Sequence[FrontInstance], live: LiveRequest) -> int:
        """The prefill (or colocated) instance for `live`: cache-aware when caching is on."""
        if not self.policy.enabled:
            return choose_prefill_instance([inst.load() for inst in alive])
        bs = self.block_size
        loads = []
        for inst in alive:
            load = inst.load()
            loads.append(
                CachedPrefillLoad(inst.num_cached_tokens(live) // bs, load.num_queued_tokens, load.num_queued_requests)
            )
        return choose_prefill_instance_cached(loads, self.policy.weight(bs))

    def choose_decode(self, alive: Sequence[DecodeInstance], live: LiveRequest) -> int:
        if not self.policy.enabled:
            return choose_decode_instance([d.load() for d in alive])
        bs = self.block_size
        loads = []
        for d in alive:
            load = d.load()
            cached = d.num_cached_tokens(live) // bs
            loads.append(CachedDecodeLoad(cached, load.num_running, load.num_waiting, load.num_free_blocks))
        return choose_decode_instance_cached(loads, self.policy.max_decode_imbalance)

    def enqueue_front(self, alive: list[FrontInstance], live: LiveRequest) -> JaxServeError | None:
        """Queue `live` on the chosen front instance; one that died since `alive` was taken is skipped."""
        error: JaxServeError | None = EngineDeadError(f"no live instance is left to take {live.request_id!r}")
        while alive:
            target = alive[self.choose_front(alive, live)]
            error = enqueue(target, live)
            if not died(target, error):
                return error
            alive.remove(target)
        return error

    def local_prefill_target(self, decodes: Sequence[DecodeInstance], live: LiveRequest) -> DecodeInstance | None:
        """Conditional disaggregation: the decode instance (of `decodes`, a disaggregated deployment's) that
        should prefill `live` itself, or None."""
        threshold = self.policy.local_prefill_tokens
        if not self.policy.enabled or threshold <= 0:
            return None
        alive = [d for d in decodes if d.error is None]
        if not alive:
            return None
        decode = alive[self.choose_decode(alive, live)]
        if prefill_locally(live.num_prefill_tokens, decode.num_cached_tokens(live, 1), threshold):
            return decode
        return None

    def admit(
        self, alive: list[FrontInstance], decodes: Sequence[DecodeInstance], live: LiveRequest
    ) -> JaxServeError | None:
        """Queue a new request: on a decode instance that prefills it itself (`local_prefill_target`; pass
        `decodes` empty for a colocated deployment), else on a front instance of `alive`."""
        local = self.local_prefill_target(decodes, live)
        error = enqueue_local(local, live) if local is not None else None
        if local is None or died(local, error):
            error = self.enqueue_front(alive, live)
        return error

    def hand_off(
        self, decodes: Sequence[DecodeInstance], live: LiveRequest, source: PrefillInstance
    ) -> tuple[DecodeInstance | None, JaxServeError | None]:
        """Queue the pull of prefilled `live` (from `source`) on a live decode instance: the one it went
        to, and the error that refused it (EngineDeadError when every decode instance is dead)."""
        alive = [d for d in decodes if d.error is None]
        target: DecodeInstance | None = None
        error: JaxServeError | None = EngineDeadError("every decode instance is dead")
        # An instance found alive above may die before it takes the request: try the next one.
        while alive:
            target = alive[self.choose_decode(alive, live)]
            error = enqueue(target, live, source)
            if not died(target, error):
                break
            alive.remove(target)
        return target, error


def enqueue(target: Instance, live: LiveRequest, source: PrefillInstance | None = None) -> JaxServeError | None:
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


def died(target: Instance, error: JaxServeError | None) -> bool:
    """True when `target` refused a request because it died after it was chosen (a worker sets `error` on its own)."""
    return isinstance(error, EngineDeadError) and target.error is not None


def enqueue_local(target: DecodeInstance, live: LiveRequest) -> JaxServeError | None:
    """Hand `live` to a decode instance that prefills its short uncached part itself; the error instead of raising."""
    try:
        target.enqueue_local(live)
    except JaxServeError as e:
        return e
    return None
