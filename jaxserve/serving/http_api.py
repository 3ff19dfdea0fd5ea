"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/models, /health, /metrics.

`POST /v1/completions` takes OpenAI's completion request (prompt as text or token ids,
max_tokens, temperature, top_p, seed, stop, stream, stream_options.include_usage; the
OpenAI fields jaxserve does not implement are accepted only at their neutral value)
plus vLLM-style extensions (top_k, ignore_eos, stop_token_ids, return_token_ids).
Unknown fields are refused. Responses and server-sent events have OpenAI's shape;
errors have OpenAI's body `{"error": {"message", "type", "param", "code"}}` with 400
(bad field, named in `param`), 401 (API key), 404 (unknown model or route), 413 (body
too large), 429 (overloaded, with `Retry-After`), 503 (shutting down), 500.

A streaming request waits for its first output before answering, so admission errors
still get their status code; a failure after that arrives as an `error` event. While it
waits (queued, prefilling) and while a non-streaming request runs, the handler watches the
connection: a client that disconnects gets its request cancelled at once. Nothing slow runs
on the event loop: tokenization and `/metrics` rendering run on worker threads. The
request path itself is `jaxserve.serving.frontend`, shared with gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.errors import EngineDeadError, InvalidRequestError, OverloadedError, ShuttingDownError
from jaxserve.runtime.request import SamplingParams
from jaxserve.serving.frontend import Frontend, error_kind
from jaxserve.serving.grpc_service import bearer_ok
from jaxserve.serving.wire import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, Chunk, CompletionParams

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; gRPC's default is greedy (0)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """OpenAI's completion request; the fields after `suffix` are jaxserve/vLLM extensions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    suffix: str | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None)
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        self.headers: dict[str, str] = {}


def _error_for(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, f"{exc.field}: {exc}", type_="invalid_request_error", param=exc.field)
    if isinstance(exc, OverloadedError):
        err = APIError(429, str(exc), type_="rate_limit_error", code="overloaded")
        err.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return err
    if isinstance(exc, ShuttingDownError):
        return APIError(503, f"server is shutting down: {exc}", type_="server_error", code="service_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(500, f"engine failure: {exc}", type_="server_error", code="engine_dead")
    return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error", code="internal_error")


def _json_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body, status_code=err.status, headers=err.headers)


def _params_from_http(body: CompletionRequest) -> CompletionParams:
    """Check the OpenAI request's shape and the fields jaxserve does not implement."""

    def bad(field: str, message: str) -> InvalidRequestError:
        return InvalidRequestError(message, field=field)

    if body.n != 1:
        raise bad("n", "only n=1 is supported")
    if body.best_of not in (None, 1):
        raise bad("best_of", "only best_of=1 is supported")
    if body.echo:
        raise bad("echo", "echo is not supported")
    if body.logprobs is not None:
        raise bad("logprobs", "logprobs are not supported")
    if body.suffix:
        raise bad("suffix", "suffix is not supported")
    if body.logit_bias:
        raise bad("logit_bias", "logit_bias is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0.0):
            raise bad(name, f"{name} is not supported (only 0)")
    if body.stream_options is not None and not body.stream:
        raise bad("stream_options", "stream_options is only allowed with stream=true")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad("prompt", "batches of prompts are not supported: send one request per prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        text, ids = prompt, None
    else:
        text, ids = None, tuple(prompt)
    if (text is not None and not text) or (ids is not None and not ids):
        raise bad("prompt", "the prompt is empty")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} characters")
    if any(s == "" for s in stop):
        raise bad("stop", "stop strings must not be empty")
    if body.stop_token_ids and len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    if body.max_tokens is None:
        raise bad("max_tokens", "max_tokens must be set")
    sampling = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
    )
    return CompletionParams(
        prompt_text=text,
        prompt_token_ids=ids,
        sampling=sampling,
        stop=stop,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def create_app(
    frontend: Frontend,
    *,
    api_key: str | None = None,
    max_request_bytes: int = 1 << 20,
    is_serving: Callable[[], bool] = lambda: True,
) -> ASGIApp:
    """The ASGI app: FastAPI routes wrapped in the request-body size limit."""
    app = FastAPI(title="jaxserve", version="0.1.0", docs_url=None, redoc_url=None)
    model_name = frontend.model_name
    created_at = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _json_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            err = APIError(400, "the request body is not valid JSON", type_="invalid_request_error")
        else:
            param = loc[0] if loc else None
            if first.get("type") == "extra_forbidden":
                message = f"{param}: unknown field"
            elif first.get("type") == "missing":
                message = f"{param}: field required"
            else:
                message = f"{param}: {first.get('msg', 'invalid value')}"
            err = APIError(400, message, type_="invalid_request_error", param=param)
        frontend.metrics.observe_error("invalid_argument")
        return _json_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _json_response(APIError(exc.status_code, str(exc.detail), type_=type_))

    def authorize(request: Request) -> None:
        if not bearer_ok(request.headers.get("authorization"), api_key):
            frontend.metrics.observe_error("unauthenticated")
            raise APIError(
                401,
                "missing or wrong API key (send Authorization: Bearer KEY)",
                type_="invalid_request_error",
                code="invalid_api_key",
            )

    @app.get("/health")
    async def health_check() -> Response:
        if is_serving():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "shutting_down"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Rendering reads controller.stats() and formats every histogram: a worker thread's job.
        text = await asyncio.get_running_loop().run_in_executor(None, frontend.metrics.render)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/steps")
    async def debug_steps(request: Request, since: float = 0.0) -> JSONResponse:
        """Each instance's recent steps: shape and wall time (what `jaxserve profile --from-server` fits)."""
        authorize(request)
        records = frontend.controller.step_records(since)
        return JSONResponse({"now": time.monotonic(), "instances": records})

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": model_name, "object": "model", "created": created_at, "owned_by": "jaxserve"}],
            }
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival_at = time.monotonic()
        authorize(request)
        if body.model is not None and body.model != model_name:
            frontend.metrics.observe_error("model_not_found")
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                type_="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        try:
            params = _params_from_http(body)
            prepared = await frontend.prepare(params, arrival_at)
        except InvalidRequestError as e:
            frontend.metrics.observe_error("invalid_argument")
            raise _error_for(e) from None
        created = int(time.time())
        chunks = frontend.stream(prepared)
        disconnected = asyncio.create_task(_wait_for_disconnect(request))
        try:
            first = await _unless_disconnected(chunks.__anext__(), disconnected)
            if first is None:  # the client left while its request was queued: cancelled, nothing computed
                await chunks.aclose()
                return Response(status_code=499)
        except BaseException as e:
            disconnected.cancel()
            await chunks.aclose()
            if isinstance(e, Exception):
                frontend.metrics.observe_error(error_kind(e))
                raise _error_for(e) from None
            raise
        if body.stream:
            disconnected.cancel()  # from here on the streaming response watches the connection
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = _sse_events(first, chunks, model_name, created, include_usage, body.return_token_ids)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            rest = await _unless_disconnected(_collect(chunks, first), disconnected)
        finally:
            disconnected.cancel()
            await chunks.aclose()
        if rest is None:  # the client left; its request was cancelled and its blocks freed
            return Response(status_code=499)
        return JSONResponse(_completion_body(rest, model_name, created, body.return_token_ids))

    return BodySizeLimit(app, max_request_bytes)


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


T = TypeVar("T")


async def _unless_disconnected(work: Awaitable[T], disconnected: asyncio.Task[None]) -> T | None:
    """`work`'s result, or None (work cancelled, so its request too) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None


async def _collect(rest: AsyncGenerator[Chunk, None], first: Chunk) -> list[Chunk]:
    collected = [first]
    if not first.finished:
        async for chunk in rest:
            collected.append(chunk)
    return collected


def _finish_reason(chunk: Chunk) -> str | None:
    return chunk.finish_reason


def _completion_body(chunks: list[Chunk], model: str, created: int, return_token_ids: bool) -> dict[str, Any]:
    last = chunks[-1]
    choice: dict[str, Any] = {
        "index": 0,
        "text": "".join(c.text for c in chunks),
        "logprobs": None,
        "finish_reason": _finish_reason(last),
    }
    if return_token_ids:
        choice["token_ids"] = [t for c in chunks for t in c.token_ids]
    return {
        "id": last.request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(last),
        "system_fingerprint": None,
    }


def _usage(last: Chunk) -> dict[str, int]:
    return {
        "prompt_tokens": last.num_prompt_tokens,
        "completion_tokens": last.num_output_tokens,
        "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
    }


async def _sse_events(
    first: Chunk,
    rest: AsyncGenerator[Chunk, None],
    model: str,
    created: int,
    include_usage: bool,
    return_token_ids: bool,
) -> AsyncIterator[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def chunk_event(chunk: Chunk) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "text": chunk.text,
            "logprobs": None,
            "finish_reason": _finish_reason(chunk),
        }
        if return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
        payload: dict[str, Any] = {
            "id": chunk.request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            payload["usage"] = None
        return event(payload)

    last = first
    try:
        yield chunk_event(first)
        if not first.finished:
            async for chunk in rest:
                last = chunk
                yield chunk_event(chunk)
    except Exception as e:  # after the 200 header: report in-band, as OpenAI-compatible servers do
        yield event(_error_for(e).body)
    finally:
        await rest.aclose()
    if include_usage and last.finished:
        yield event(
            {
                "id": last.request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(last),
            }
        )
    yield b"data: [DONE]\n\n"


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413 before the app sees them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._reject(send)
            return
        # Read the body here (bounded), then replay it: a chunked body has no length header.
        body = bytearray()
        more = scope["method"] in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            body.extend(message.get("body", b""))
            if len(body) > self.max_bytes:
                await self._reject(send)
                return
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        err = APIError(
            413,
            f"request body larger than {self.max_bytes} bytes",
            type_="invalid_request_error",
            code="request_too_large",
        )
        payload = json.dumps(err.body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})
