"""Python client for a jaxserve gRPC server: `Client` (blocking) and `AsyncClient` (asyncio).

    from jaxserve.client import Client

    with Client("127.0.0.1:50051") as client:
        result = client.generate(prompt="def fib(n):", max_tokens=32)
        print(result.text, result.finish_reason, result.timings.ttft_s)
        for chunk in client.stream(prompt_ids=[2, 100, 31], max_tokens=8):
            print(chunk.token_ids)

`generate` returns a `Completion` (`.token_ids`, `.text`, `.finish_reason`,
`.timings`); `stream` yields `Chunk`s with the new `.token_ids` and `.text`, the last
one with `.finish_reason` and `.timings`. `logprobs=k` (0..20) adds `.logprobs`: one
`TokenLogprobs` (`.logprob`, `.top` = k (token id, logprob) pairs) per token. `cache_salt="..."` (vLLM's):
prefix-cache blocks are shared only with requests of the same salt (and API key), so other clients cannot
learn from `.num_cached_tokens` or timings what you sent. Leaving a stream early (break, `cancel()`,
`close()`, or cancelling the task consuming an `AsyncClient` stream) cancels the call,
and the server cancels the request and frees its KV blocks. `timeout_s` is a gRPC
deadline. Failures raise a `ClientError` subclass chosen by the gRPC status code.
Only protobuf and grpcio are imported: no JAX on the client side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.core.plan import DeploymentPlan
from jaxserve.proto import SERVICE_NAME
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.serving import wire
from jaxserve.serving.wire import Chunk, Completion, ModelInfo, Timings

__all__ = [
    "AsyncClient",
    "CancelledError",
    "Chunk",
    "Client",
    "ClientError",
    "Completion",
    "DeadlineExceededError",
    "InternalError",
    "InvalidArgumentError",
    "ModelInfo",
    "PermissionDeniedError",
    "RequestParams",
    "ResourceExhaustedError",
    "Timings",
    "UnauthenticatedError",
    "UnavailableError",
]


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------
class ClientError(Exception):
    """A failed call; `code` is the gRPC status code, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode | None, details: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(f"{code.name if code else 'ERROR'}: {details}")
        self.code = code
        self.details = details
        self.metadata = metadata or {}


class InvalidArgumentError(ClientError):
    """The request is wrong; `field` names the field (INVALID_ARGUMENT)."""

    @property
    def field(self) -> str | None:
        return self.metadata.get("jaxserve-field")


class ResourceExhaustedError(ClientError):
    """The server is overloaded or the message is too large; retry after `retry_after_s` (RESOURCE_EXHAUSTED)."""

    @property
    def retry_after_s(self) -> float | None:
        value = self.metadata.get("retry-after-s")
        return float(value) if value is not None else None


class UnavailableError(ClientError):
    """The server is shutting down or unreachable (UNAVAILABLE)."""


class UnauthenticatedError(ClientError):
    """The API key is missing or wrong (UNAUTHENTICATED)."""


class PermissionDeniedError(ClientError):
    """The key is valid but does not grant this call, e.g. `deployment()` needs the admin key (PERMISSION_DENIED)."""


class DeadlineExceededError(ClientError):
    """`timeout_s` passed before the call finished (DEADLINE_EXCEEDED)."""


class CancelledError(ClientError):
    """The call was cancelled (CANCELLED)."""


class InternalError(ClientError):
    """The server failed (INTERNAL, UNKNOWN, or any other code)."""


_ERRORS: dict[grpc.StatusCode, type[ClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
}


def error_from_rpc(e: grpc.RpcError) -> ClientError:
    """The typed error for a failed gRPC call."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    metadata = {str(k): v if isinstance(v, str) else v.decode() for k, v in (trailing or ())}
    return _ERRORS.get(code, InternalError)(code, details, metadata)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Shared set-up
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Setup:
    target: str
    metadata: tuple[tuple[str, str], ...]
    credentials: grpc.ChannelCredentials | None
    options: tuple[tuple[str, Any], ...]


def _setup(
    target: str,
    api_key: str | None,
    tls: bool,
    root_certificates: bytes | str | Path | None,
    tls_server_name: str | None,
    max_message_bytes: int,
) -> _Setup:
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    credentials = None
    if tls or root_certificates is not None:
        roots = root_certificates
        if isinstance(roots, str | Path):
            roots = Path(roots).read_bytes()
        credentials = grpc.ssl_channel_credentials(root_certificates=roots)
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
    return _Setup(target, metadata, credentials, tuple(options))


class RequestParams(TypedDict, total=False):
    """What `stream` and `generate` take besides the prompt (keywords; unset ones take the server's defaults).

    `prompt_ids` instead of a text prompt, `messages` (role / content mappings) for a chat request; sampling:
    `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`; stopping: `stop` (strings), `stop_token_ids`,
    `ignore_eos`, `include_stop_str_in_output`; `n` samples (`stream` only), `echo` the prompt, `logprobs` (0..20
    alternatives per token), `cache_salt` (prefix-cache blocks shared only with requests of the same salt),
    `response_format` (OpenAI's mapping: `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
    {"schema": {...}, "strict": True}}`; the output is constrained to it); `tools`, `tool_choice` and
    `parallel_tool_calls` as OpenAI's chat request takes them (messages then may hold `tool_calls` and
    `role: "tool"` results; the final chunk's `tool_calls` are the calls the reply made)."""

    prompt_ids: Sequence[int] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: Sequence[str] | str
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    n: int | None
    echo: bool
    messages: Sequence[Mapping[str, Any]] | None
    logprobs: int | None
    cache_salt: str | None
    response_format: Mapping[str, Any] | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool | None


def _request(prompt: str | None, params: RequestParams) -> pb.GenerateRequest:
    unknown = sorted(set(params) - set(RequestParams.__annotations__))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    fields: dict[str, Any] = dict(params)
    return wire.request_to_proto(prompt=prompt, messages=fields.pop("messages", None) or (), **fields)


def _one(params: RequestParams) -> RequestParams:
    """`generate`'s parameters: one completion."""
    if params.get("n") not in (None, 1):
        raise ValueError("generate() returns one completion: use stream(n=...) for several samples")
    return params


# ---------------------------------------------------------------------------------------
# Blocking client
# ---------------------------------------------------------------------------------------
class Stream:
    """The chunks of one `Generate` call; iterate, or `cancel()` to stop it (server-side too)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False
        self._num_tokens: dict[int, int] = {}  # per sample index

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for message in self._call:
                chunk = wire.chunk_from_proto(message, self._num_tokens.get(message.index, 0))
                self._num_tokens[chunk.index] = chunk.num_output_tokens
                yield chunk
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(e) from None
        finally:
            if not self._call.done():
                self.cancel()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    close = cancel

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class _Channel:
    """What `Client` and `AsyncClient` share: the channel (`grpc` or `grpc.aio`: `_CHANNELS`), its credentials and
    key, and the stubs over it. The calls themselves stay twins: one blocks, the other awaits."""

    _CHANNELS: Any = grpc

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | str | Path | None = None,
        tls_server_name: str | None = None,
        timeout_s: float | None = None,
        max_message_bytes: int = 16 << 20,
    ) -> None:
        s = _setup(target, api_key, tls, root_certificates, tls_server_name, max_message_bytes)
        self._metadata = s.metadata
        self.timeout_s = timeout_s
        if s.credentials is not None:
            self._channel = self._CHANNELS.secure_channel(target, s.credentials, options=s.options)
        else:
            self._channel = self._CHANNELS.insecure_channel(target, options=s.options)
        self._stub = pb_grpc.JaxServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _call_options(self, timeout_s: float | None) -> dict[str, Any]:
        return {"timeout": timeout_s or self.timeout_s, "metadata": self._metadata}


class Client(_Channel):
    """Blocking client; thread-safe (one channel, many concurrent calls)."""

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout_s: float | None = None,
        **params: Unpack[RequestParams],
    ) -> Stream:
        request = _request(prompt, params)
        call = self._stub.Generate(request, **self._call_options(timeout_s))
        return Stream(call)

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout_s: float | None = None,
        **params: Unpack[RequestParams],
    ) -> Completion:
        chunks = list(self.stream(prompt, timeout_s=timeout_s, **_one(params)))
        return Completion.from_chunks(chunks)

    def model_info(self, timeout_s: float | None = None) -> ModelInfo:
        try:
            m = self._stub.GetModelInfo(pb.GetModelInfoRequest(), **self._call_options(timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return wire.model_info_from_proto(m)

    def deployment(self, timeout_s: float | None = None) -> DeploymentPlan:
        try:
            m = self._stub.GetDeployment(pb.GetDeploymentRequest(), **self._call_options(timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return wire.deployment_from_proto(m)

    def health(self, service: str = SERVICE_NAME, timeout_s: float | None = None) -> bool:
        """True when the server reports SERVING (the grpc.health.v1 protocol)."""
        try:
            r = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s or 5.0)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------
# asyncio client
# ---------------------------------------------------------------------------------------
class AsyncClient(_Channel):
    """asyncio client over `grpc.aio`; create and use it inside one event loop."""

    _CHANNELS = grpc.aio

    async def stream(
        self,
        prompt: str | None = None,
        *,
        timeout_s: float | None = None,
        **params: Unpack[RequestParams],
    ) -> AsyncIterator[Chunk]:
        """Chunks as they arrive; leaving the loop or cancelling the task cancels the call."""
        request = _request(prompt, params)
        call = self._stub.Generate(request, **self._call_options(timeout_s))
        num_tokens: dict[int, int] = {}  # per sample index
        try:
            async for message in call:
                chunk = wire.chunk_from_proto(message, num_tokens.get(message.index, 0))
                num_tokens[chunk.index] = chunk.num_output_tokens
                yield chunk
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            if not call.done():
                call.cancel()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        timeout_s: float | None = None,
        **params: Unpack[RequestParams],
    ) -> Completion:
        chunks = [c async for c in self.stream(prompt, timeout_s=timeout_s, **_one(params))]
        return Completion.from_chunks(chunks)

    async def model_info(self, timeout_s: float | None = None) -> ModelInfo:
        try:
            m = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), **self._call_options(timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return wire.model_info_from_proto(m)

    async def deployment(self, timeout_s: float | None = None) -> DeploymentPlan:
        try:
            m = await self._stub.GetDeployment(pb.GetDeploymentRequest(), **self._call_options(timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return wire.deployment_from_proto(m)

    async def health(self, service: str = SERVICE_NAME, timeout_s: float | None = None) -> bool:
        try:
            r = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s or 5.0)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
