"""Recovery: where a request goes when the instance holding it, or its KV on the way, is lost.

Both backends end in the controller's worker hooks (`Emitter`), which call in here:

* an instance dies (`Worker` caught its `step()` raising, or a Ray proxy's actor is gone for good): its
  requests come back to the controller (`on_instance_dead`). A request a live instance still holds
  (e.g. one whose KV a decode instance already pulled) stays there (`needs_moving` is False); a
  cancelled or finished one is dropped; every other one is *moved*.
* a KV pull fails beyond its retries (`decode_instance.py`) under the "recompute" policy
  (`ControllerConfig.pull_failure.on_failure`; "fail" fails it alone there), or whatever the policy
  when the KV's prefill instance died or a switch retired it: the request is moved (`Controller.recompute`).

A move (`move_error`) queues the request on the live front instance the router chooses: a request not
yet prefilled is simply queued again; one with tokens streamed is *resumed* (`worker.py`: prompt +
streamed tokens but the last are prefilled, the sample discarded, decoding continues at the same position
and sample index), so its stream neither loses nor repeats a token. With no live instance to take it,
the move's answer is an EngineDeadError and the controller fails that request alone.

Inputs: the request and the routed instances (under the controller's lock). Output: None (moved) or
the error to fail it with. What blocks: each instance's condition lock while its holdings are read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jaxserve.core.errors import EngineDeadError, JaxServeError
from jaxserve.runtime.colocated_instance import ColocatedInstance
from jaxserve.runtime.decode_instance import DecodeInstance
from jaxserve.runtime.instances import Instance
from jaxserve.runtime.prefill_instance import PrefillInstance
from jaxserve.runtime.routing import Router, live_fronts
from jaxserve.runtime.worker import LiveRequest

log = logging.getLogger(__name__)


def held_by_live_instance(instances: Sequence[Instance], live: LiveRequest) -> bool:
    """Whether a live instance of `instances` holds `live` (queued, buffered or running)."""
    for inst in instances:
        if inst.error is None:
            with inst.cond:
                if any(r is live for r in inst.held_requests()):
                    return True
    return False


def needs_moving(instances: Sequence[Instance], live: LiveRequest) -> bool:
    """A request an instance gave back (it died or retired) moves unless it ended or a live instance holds it."""
    return not (live.cancelled or live.finished or held_by_live_instance(instances, live))


def move_error(
    router: Router,
    prefills: Sequence[PrefillInstance],
    decodes: Sequence[DecodeInstance],
    colocated: Sequence[ColocatedInstance],
    live: LiveRequest,
    why: str,
) -> JaxServeError | None:
    """Queue `live` on a live front instance of the routed ones (resumed if tokens were streamed); the
    error to fail it with when none can take it. Call under the controller's lock."""
    alive = live_fronts(prefills, decodes, colocated)
    if not alive:
        return EngineDeadError(f"{why}, and no live instance is left to continue {live.request_id!r}")
    log.warning("continuing %s (%d tokens streamed): %s", live.request_id, len(live.output_ids), why)
    return router.enqueue_front(alive, live)
