"""Errors the runtime raises to its callers (the gRPC/HTTP layer maps each to a status code).

* `InvalidRequestError` — the request itself is wrong (client error; `field` names the culprit).
* `OverloadedError` — admission control: queues are at their bound; retry after `retry_after_s`.
* `ShuttingDownError` — the controller is draining or stopped and takes no new requests.
* `EngineDeadError` — a worker thread died; requests it held fail with this instead of hanging.
"""

from __future__ import annotations


class JaxServeError(Exception):
    """Base class of every error the runtime raises on purpose."""


class InvalidRequestError(JaxServeError):
    """A request that can never be served as given; `field` names the offending field."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class OverloadedError(JaxServeError):
    """Admission control refused the request because the queues are full."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDownError(JaxServeError):
    """The controller is shutting down and accepts no new requests."""


class EngineDeadError(JaxServeError):
    """A worker (prefill, decode or colocated instance) died; the message says which and why."""
