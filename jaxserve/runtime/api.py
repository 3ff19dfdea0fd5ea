"""The serving boundary: what any front (gRPC, HTTP, the offline LLM) needs from a runtime backend.

Pure Python types and Protocols (no JAX). Both backends (embedded `Controller`, Ray
`RayController`) satisfy `ServingController`; the servers take nothing else.
Rules: `stats()` and everything the HTTP event loop calls return at once (no ray.get,
no device sync).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from jaxserve.plan import DeploymentPlan
    from jaxserve.runtime.controller import RequestStream
    from jaxserve.runtime.request import GenerateRequest
    from models.config import OPTConfig


@dataclasses.dataclass(frozen=True)
class InstanceStats:  # one type; each instance builds its own (`instance.stats()`)
    role: Literal["prefill", "decode", "colocated"]
    name: str
    alive: bool
    num_waiting: int  # requests queued at the instance, not yet running
    num_running: int  # prefill: in the batch being computed; decode/colocated: in the batch
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    num_prefill_buffer_used: int = 0  # prefilled sequences held until pulled
    prefill_buffer_capacity: int = 0


@dataclasses.dataclass(frozen=True)
class FaultStats:  # counters, updated by the controller as events happen (never an RPC)
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


class ServingController(Protocol):
    """What any front (gRPC, HTTP, the offline LLM) needs from a runtime backend (embedded or Ray)."""

    @property
    def model_config(self) -> OPTConfig: ...
    @property
    def tokenizer(self) -> Tokenizer | None: ...  # tokenizers.Tokenizer
    @property
    def plan(self) -> DeploymentPlan: ...
    @property
    def max_prompt_tokens(self) -> int: ...
    @property
    def max_tokens_limit(self) -> int: ...
    @property
    def instance_names(self) -> tuple[str, ...]: ...
    def start(self) -> None: ...
    def warmup(self) -> float: ...  # compile/prime every shape the limits allow before `ready`; seconds taken
    def shutdown(self, drain_timeout_s: float | None = None) -> None: ...
    def validate(self, request: GenerateRequest) -> None: ...  # raises InvalidRequestError
    def submit(self, request: GenerateRequest) -> RequestStream: ...
    def cancel(self, request_id: str) -> None: ...
    def stats(self) -> ControllerStats: ...  # never blocks on a remote call (cached counters)
    def step_records(self, since: float = 0.0) -> list[dict[str, object]]: ...
