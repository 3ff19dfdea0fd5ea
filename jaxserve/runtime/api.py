"""The serving boundary: what any front (gRPC, HTTP, the offline `LLM`) needs from a runtime backend.

Pure types and Protocols (`RequestStream`, what `submit` returns, is `streams.py`'s; nothing here imports
the controller or an instance). `Controller` (embedded) and `RayController` (Ray)
implement `ServingController`; each instance builds its own `InstanceStats`;
the controller keeps `FaultStats` counters as events happen, so `stats()` and
everything an event loop calls return at once (no remote call, no device sync).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, Protocol

from jaxserve.core.plan import DeploymentPlan
from jaxserve.core.request import GenerateRequest
from jaxserve.runtime.streams import RequestStream
from models.config import ModelConfig

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from models.checkpoint import CheckpointChatTemplate

InstanceRole = Literal["prefill", "decode", "colocated"]


@dataclasses.dataclass(frozen=True)
class InstanceStats:
    """One instance's state, built by the instance itself (`instance.stats()`)."""

    role: InstanceRole
    name: str
    alive: bool
    num_waiting: int  # requests queued at the instance, not yet running
    num_running: int  # prefill: in the batch being computed; decode/colocated: in the batch (pulls included)
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    num_prefill_buffer_used: int = 0  # prefilled sequences held until pulled
    prefill_buffer_capacity: int = 0
    num_cached_blocks: int = 0  # prefix cache: named blocks held (pinned or evictable)
    num_prefix_query_tokens: int = 0  # prefix cache: prompt tokens looked up since start
    num_prefix_hit_tokens: int = 0  # ... and found cached
    num_prefix_evictions: int = 0


@dataclasses.dataclass(frozen=True)
class FaultStats:
    """Fault counters, updated by the controller as events happen (never an RPC)."""

    num_failed_pulls: int = 0
    num_pull_retries: int = 0
    num_recomputed: int = 0  # pulls answered by recomputing the KV
    num_expired_leases: int = 0
    num_rerouted_requests: int = 0
    num_instance_restarts: int = 0


@dataclasses.dataclass(frozen=True)
class ControllerStats:
    instances: tuple[InstanceStats, ...]
    num_live_requests: int
    num_transfers: int
    kv_transfer_bytes: int
    faults: FaultStats
    kv_transfer_tokens: int = 0  # positions pulled (a prefix cache on the decode side moves fewer)


class ServingController(Protocol):
    """What any front (gRPC, HTTP, the offline LLM) needs from a runtime backend (embedded or Ray)."""

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def chat_template(self) -> CheckpointChatTemplate | None: ...  # the checkpoint's; None: the built-in one

    @property
    def plan(self) -> DeploymentPlan: ...

    @property
    def max_prompt_tokens(self) -> int: ...

    @property
    def max_tokens_limit(self) -> int: ...

    @property
    def instance_names(self) -> tuple[str, ...]: ...

    def start(self) -> None: ...

    def warmup(self, *, start_background: bool = True) -> float:
        """Compile/prime every shape the limits allow before `ready`; seconds taken. The compiles left to the
        background start at the end, or with `start_background=False` at `start_background_compiles()`."""
        ...

    def start_background_compiles(self) -> None:
        """Start the background compiles `warmup(start_background=False)` left waiting."""
        ...

    def shutdown(self, drain_timeout_s: float | None = None) -> None: ...

    def check_fits(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError naming the first field that does not fit this deployment."""
        ...

    def submit(self, request: GenerateRequest) -> RequestStream: ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> ControllerStats:
        """Never blocks on a remote call (cached counters)."""
        ...

    def step_records(self, since: float = 0.0) -> list[dict[str, object]]: ...
