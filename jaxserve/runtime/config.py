"""A deployment's knobs and hooks: `ControllerConfig`, one small config per concern composed at the top.

The knob table (docs/architecture.md) names where each knob is declared: the serving limits in
`jaxserve/core/limits.py`, the pull-failure policy with the KV connectors (`kv_connectors/base.py`), the warm-up
with the compilation room (`compilation/deployment.py`), prefix caching in `jaxserve/core/scheduling.py`;
admission and the controller's own plain knobs here. `Observer` and `WorkloadHook` are what the controller
tells the metrics and the workload monitor.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.request import FinishReason, RequestTimings
from jaxserve.core.scheduling import DEFAULT_PREFIX_CACHING, PrefixPolicy
from jaxserve.runtime.compilation.deployment import WarmupConfig
from jaxserve.runtime.kv_connectors.base import PullFailureConfig


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
class ControllerConfig:
    """A deployment's knobs, one small config per concern (the knob table: docs/architecture.md): the serving
    limits (block_size, num_kv_blocks, max_decode_batch, max_batch_tokens, prefill_buffer_slots;
    jaxserve/core/limits.py, which the simulator and plan files share), what a failed KV pull does, admission,
    warm-up, prefix caching."""

    limits: ServingLimits = DEFAULT_LIMITS  # num_kv_blocks: per decode / colocated instance, must be a number here
    pull_failure: PullFailureConfig = dataclasses.field(default_factory=PullFailureConfig)
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)
    warmup: WarmupConfig = dataclasses.field(default_factory=WarmupConfig)
    # Prefix caching (docs/prefix_caching.md): `enabled` turns on content-addressed KV blocks on every instance and
    # cache-aware routing (on by default; `NO_PREFIX_CACHING` turns it off); the routing weights and the
    # local-prefill threshold. The simulator's too.
    prefix_policy: PrefixPolicy = DEFAULT_PREFIX_CACHING
    prefill_num_kv_blocks: int | None = None  # a caching prefill instance's pool (default: num_kv_blocks)
    decode_steps_per_call: int = 1  # decode / colocated: up to N decode steps per engine call (multi-step)
    drain_timeout_s: float = 30.0  # shutdown(): in-flight requests get this long before they are aborted
    # Every KV connector (in-process, Ray) also checks a checksum of each pulled KV's contents (one extra read of
    # the KV per side); off by default. Shape, dtype and length are always checked (`base.check_pulled_kv`).
    kv_checksum: bool = False

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
