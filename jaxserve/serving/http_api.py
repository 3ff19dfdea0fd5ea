"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Operator routes, behind the admin credential and never the API key (`jaxserve.serving.admin.AdminAccess`:
401 without it, 403 for the inference key, 404 when they are off): `GET /debug/steps`, `GET /debug/workload`
(the workload monitor, when the server has one) and `POST /admin/deployment` (a live switch: the body is
parsed on a worker thread and bounded by the devices there are; 400 for a bad plan or a switch that could not
be made, 409 while another switch runs, 501 on a backend that cannot switch, 503 when the server began
shutting down during the switch).

The request schemas and their checks are `jaxserve.serving.openai_protocol`; a request
becomes one `Frontend.stream` per choice (prompts x n), merged into OpenAI's response or
server-sent events (choice `i * n + j` is sample `j` of prompt `i`). Responses and events have OpenAI's shape;
errors have OpenAI's body `{"error": {"message", "type", "param", "code"}}` with 400
(bad field, named in `param`), 401 (API key), 404 (unknown model or route), 413 (body
too large), 429 (overloaded, with `Retry-After`), 503 (shutting down), 500.

A streaming request waits for the first output of every choice before answering, so admission errors
still get their status code; a failure after that arrives as an `error` event. While it
waits (queued, prefilling) and while a non-streaming request runs, the handler watches the
connection: a client that disconnects gets its request cancelled at once. Nothing slow runs
on the event loop: chat template rendering, tokenization and `/metrics` rendering run on worker threads. The
request path itself is `jaxserve.serving.frontend`, shared with gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.core.errors import EngineDeadError, InvalidRequestError, OverloadedError, ShuttingDownError
from jaxserve.core.plan import PlanError
from jaxserve.core.request import TokenLogprobs
from jaxserve.runtime.switch import SwitchAbortedError, SwitchError, SwitchInProgressError, SwitchUnsupportedError
from jaxserve.serving import tool_parsers
from jaxserve.serving.admin import AdminAccess, DeploymentAdmin, bearer_ok, parse_plan_body
from jaxserve.serving.browser_guard import BrowserGuard, BrowserPolicy
from jaxserve.serving.frontend import Choice, Frontend, error_kind, first_chunks, merge_streams
from jaxserve.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIJob,
    chat_job,
    completion_job,
)
from jaxserve.serving.wire import Chunk, Completion


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


def create_app(
    frontend: Frontend,
    *,
    api_key: str | None = None,
    max_request_bytes: int = 1 << 20,
    is_serving: Callable[[], bool] = lambda: True,
    admin: DeploymentAdmin | None = None,
    admin_access: AdminAccess | None = None,
    browser: BrowserPolicy | None = None,
) -> ASGIApp:
    """The ASGI app: FastAPI routes wrapped in the request-body size limit and the browser guard.

    `admin_access`: who may use `/admin/*` and `/debug/*` (`JaxServeServer` passes its config's; default: no
    admin key and a host not known to be loopback, so they are off). `browser`: which `Host` names and
    origins are served (`jaxserve.serving.browser_guard`; default: a loopback server's, no CORS)."""
    access = admin_access if admin_access is not None else AdminAccess(api_key=api_key)
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

    def authorize_admin(request: Request) -> None:
        verdict = access.check(request.headers.get("authorization"))
        if verdict == "ok":
            return
        frontend.metrics.observe_error("unauthenticated")
        if verdict == "off":
            raise APIError(404, access.off_reason, type_="invalid_request_error", code="admin_off")
        if verdict == "forbidden":
            raise APIError(
                403, "the inference API key does not grant admin: send the admin key", type_="permission_error",
                code="admin_key_required",
            )  # fmt: skip
        raise APIError(
            401,
            "missing or wrong admin key (send Authorization: Bearer ADMIN_KEY)",
            type_="invalid_request_error",
            code="invalid_admin_key",
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
        authorize_admin(request)
        records = frontend.controller.step_records(since)
        return JSONResponse({"now": time.monotonic(), "instances": records})

    @app.get("/debug/workload")
    async def debug_workload(request: Request) -> JSONResponse:
        """The workload monitor's windows, the shift detector's state and the last replan decision."""
        authorize_admin(request)
        if admin is None:
            raise APIError(404, "this server runs no workload monitor", type_="invalid_request_error")
        snapshot = await asyncio.get_running_loop().run_in_executor(None, admin.workload_snapshot)
        return JSONResponse(snapshot)

    @app.post("/admin/deployment")
    async def admin_deployment(request: Request) -> JSONResponse:
        """Switch the deployment live to a plan file (JSON body) or a spec string; answers when it is done."""
        authorize_admin(request)
        if admin is None:
            raise APIError(404, "this server cannot change its deployment", type_="invalid_request_error")
        # JSON only: a web page can send text/plain or a form anywhere without a preflight, never JSON.
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(
                415, "send the plan as Content-Type: application/json (a plan, {\"deployment\": SPEC} or a JSON "
                "string)", type_="invalid_request_error", code="unsupported_media_type",
            )  # fmt: skip
        body = await request.body()
        loop = asyncio.get_running_loop()
        try:  # off the event loop: the parse is bounded, but a megabyte of JSON is still work
            plan = await loop.run_in_executor(None, parse_plan_body, body, admin.max_plan_devices())
        except PlanError as e:
            raise APIError(400, f"bad plan: {e}", type_="invalid_request_error", code="bad_plan") from None
        if admin.switch_busy():
            raise APIError(
                409, "a deployment switch is already running; retry when it has finished", type_="conflict",
                code="switch_running",
            )  # fmt: skip
        try:
            report = await loop.run_in_executor(None, admin.apply_deployment, plan)
        except SwitchInProgressError as e:
            raise APIError(409, str(e), type_="conflict", code="switch_running") from None
        except SwitchUnsupportedError as e:
            raise APIError(501, str(e), type_="server_error", code="switch_unsupported") from None
        except SwitchAbortedError as e:  # shutdown began during the switch: it stopped, nothing new routed
            raise APIError(503, str(e), type_="server_error", code="shutting_down") from None
        except (SwitchError, PlanError) as e:
            raise APIError(400, f"cannot switch: {e}", type_="invalid_request_error", code="bad_plan") from None
        return JSONResponse(report)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": model_name, "object": "model", "created": created_at, "owned_by": "jaxserve"}],
            }
        )

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            frontend.metrics.observe_error("model_not_found")
            raise APIError(
                404,
                f"the model {requested!r} does not exist; this server serves {model_name!r}",
                type_="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    async def serve(job_of: Callable[[], OpenAIJob], request: Request, chat: bool) -> Response:
        arrival_at = time.monotonic()
        try:
            # A chat job renders the checkpoint's template: untrusted code that may run long, so off the loop.
            job = await asyncio.get_running_loop().run_in_executor(None, job_of) if chat else job_of()
            choices = await frontend.prepare_choices(job.prompts, job.n, job.echo, arrival_at)
        except InvalidRequestError as e:
            frontend.metrics.observe_error("invalid_argument")
            raise _error_for(e) from None
        created = int(time.time())
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        streams = [frontend.stream(c.prepared) for c in choices]
        disconnected = asyncio.create_task(_wait_for_disconnect(request))
        try:
            firsts = await _unless_disconnected(first_chunks(streams), disconnected)
        except BaseException as e:
            disconnected.cancel()
            for st in streams:
                await st.aclose()
            if isinstance(e, Exception):
                frontend.metrics.observe_error(error_kind(e))
                raise _error_for(e) from None
            raise
        if firsts is None:  # the client left while its requests were queued: cancelled, nothing computed
            for st in streams:
                await st.aclose()
            return Response(status_code=499)
        render = _Render(response_id, model_name, created, job, chat, frontend.token_text)
        if job.stream:
            disconnected.cancel()  # from here on the streaming response watches the connection
            events = _sse_events(render, choices, streams, firsts)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            collected = await _unless_disconnected(
                asyncio.gather(*(_collect(st, f) for st, f in zip(streams, firsts, strict=True))), disconnected
            )
        finally:
            disconnected.cancel()
            for st in streams:
                await st.aclose()
        if collected is None:  # the client left; its requests were cancelled and their blocks freed
            return Response(status_code=499)
        return JSONResponse(render.body(choices, list(collected)))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        authorize(request)
        check_model(body.model)
        return await serve(lambda: completion_job(body), request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        authorize(request)
        check_model(body.model)
        return await serve(lambda: chat_job(body, frontend.chat_template), request, chat=True)

    return BrowserGuard(BodySizeLimit(app, max_request_bytes), browser or BrowserPolicy())


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


T = TypeVar("T")


async def _unless_disconnected(work: Awaitable[T], disconnected: asyncio.Task[None]) -> T | None:
    """`work`'s result, or None (work cancelled, so its requests too) if the client disconnects first."""
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


LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token of probability 0 reports this (as vLLM does)


def _json_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if not math.isnan(value) else LOGPROB_FLOOR


class _Render:
    """OpenAI's response bodies and stream events, completions or chat."""

    def __init__(
        self, response_id: str, model: str, created: int, job: OpenAIJob, chat: bool, token_text: Callable[[int], str]
    ) -> None:
        self.id = response_id
        self.model = model
        self.created = created
        self.job = job
        self.chat = chat
        self.token_text = token_text
        self._text_offsets: dict[int, int] = {}  # completions logprobs: each choice's text offset so far
        self._held: dict[int, list[Chunk]] = {}  # a forced tool call's chunks, held until the call is whole
        self._readers: dict[int, tool_parsers.ToolCallStream] = {}  # tool_choice "auto": each choice's reader

    def logprobs(
        self, index: int, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None
    ) -> dict[str, Any] | None:
        """OpenAI's `logprobs` object for these tokens of choice `index` (None when the client did not ask).

        Completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`; chat:
        `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal}`.
        """
        if self.job.logprobs is None or logprobs is None:
            return None
        texts = [self.token_text(t) for t in token_ids]
        if self.chat:

            def entry(text: str, value: float) -> dict[str, Any]:
                return {"token": text, "logprob": _json_logprob(value), "bytes": list(text.encode())}

            content = [
                {**entry(text, lp.logprob), "top_logprobs": [entry(self.token_text(t), v) for t, v in lp.top]}
                for text, lp in zip(texts, logprobs, strict=True)
            ]
            return {"content": content, "refusal": None}
        offset = self._text_offsets.get(index, 0)
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {
            "tokens": texts,
            "token_logprobs": [_json_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [{self.token_text(t): _json_logprob(v) for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _envelope(self, chunk_object: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk_object else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, choices: list[Choice], lasts: list[Chunk]) -> dict[str, Any]:
        prompt = sum(last.num_prompt_tokens for c, last in zip(choices, lasts, strict=True) if c.counts_prompt)
        completion = sum(last.num_output_tokens for last in lasts)
        cached = sum(last.num_cached_tokens for c, last in zip(choices, lasts, strict=True) if c.counts_prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        reason: str | None,
        delta: bool,
        first: bool = False,
        logprobs: Sequence[TokenLogprobs] | None = None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index}
        if self.chat and delta:
            out["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        elif self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        out["logprobs"] = self.logprobs(index, token_ids, logprobs)
        out["finish_reason"] = reason
        if self.job.return_token_ids:
            out["token_ids"] = token_ids
        return out

    def body(self, choices: list[Choice], collected: list[list[Chunk]]) -> dict[str, Any]:
        out = self._envelope(chunk_object=False)
        out["choices"] = []
        for c, chunks in zip(choices, collected, strict=True):
            text = c.echo + "".join(ch.text for ch in chunks)
            reason = chunks[-1].finish_reason
            choice = self._choice(
                c.index,
                text,
                [t for ch in chunks for t in ch.token_ids],
                reason,
                delta=False,
                logprobs=Completion.from_chunks(chunks).logprobs,
            )
            made = None if self.job.chat is None else self.job.chat.reply(text, reason)
            if made is not None:
                choice["message"] = {"role": "assistant", "content": made[0], "tool_calls": made[1]}
                choice["finish_reason"] = "tool_calls" if reason == "stop" else reason
            out["choices"].append(choice)
        out["usage"] = self.usage(choices, [chunks[-1] for chunks in collected])
        out["system_fingerprint"] = None
        return out

    def events(self, choice: Choice, chunk: Chunk, first: bool) -> list[dict[str, Any]]:
        """The stream events of one chunk. A forced tool call's chunks are held until it ends, then sent as
        OpenAI sends a call: the call (id, name, whole arguments) in one delta, then `finish_reason: "tool_calls"`
        (an output cut short goes out as the text it is)."""
        chat = self.job.chat
        if chat is not None and chat.streams_calls:
            return self._auto_events(choice, chunk, first)
        if chat is None or chat.call is None:
            return [self.event(choice, chunk, first)]
        held = self._held.setdefault(choice.index, [])
        held.append(chunk)
        if not chunk.finished:
            return []
        whole = Completion.from_chunks(held)
        merged = dataclasses.replace(chunk, token_ids=whole.token_ids, text=whole.text, logprobs=whole.logprobs)
        made = chat.reply(whole.text, chunk.finish_reason)
        if made is None:
            return [self.event(choice, merged, True)]
        call_event = self.event(choice, dataclasses.replace(merged, finish_reason=None), True)
        call_event["choices"][0]["delta"] = {
            "role": "assistant", "content": None, "tool_calls": [{"index": 0, **made[1][0]}]
        }  # fmt: skip
        end = self.event(choice, dataclasses.replace(merged, token_ids=(), text="", logprobs=None), False)
        end["choices"][0]["delta"] = {}
        end["choices"][0]["finish_reason"] = "tool_calls"
        return [call_event, end]

    def _auto_events(self, choice: Choice, chunk: Chunk, first: bool) -> list[dict[str, Any]]:
        """tool_choice "auto": the chunk's text read by the format's parser. Content goes out as it comes (held
        only while it may be a marker's start); each call as OpenAI streams one: its id and name, then its
        arguments in pieces; the last event's reason is "tool_calls" when the reply made calls and stopped."""
        chat = self.job.chat
        assert chat is not None and chat.tool_format is not None
        reader = self._readers.setdefault(choice.index, tool_parsers.ToolCallStream(chat.tool_format))
        pieces = reader.push(chunk.text) + (reader.finish() if chunk.finished else [])
        content = "".join(p for kind, p in pieces if kind == tool_parsers.CONTENT)
        deltas = [p for kind, p in pieces if kind != tool_parsers.CONTENT]
        if not chat.parallel_tool_calls:
            deltas = [d for d in deltas if d["index"] == 0]
        reason: str | None = chunk.finish_reason
        if reason == "stop" and reader.calls:
            reason = "tool_calls"
        events = []
        if content or first or not deltas:
            events.append(self.event(choice, dataclasses.replace(chunk, text=content, finish_reason=None), first))
        for delta in deltas:
            # the chunk's tokens (and logprobs) ride on its first event; a call's delta holds no content
            source = chunk if not events else dataclasses.replace(chunk, token_ids=(), logprobs=None)
            event = self.event(choice, dataclasses.replace(source, text="", finish_reason=None), False)
            event["choices"][0]["delta"] = {"tool_calls": [delta]}
            events.append(event)
        events[-1]["choices"][0]["finish_reason"] = reason
        return events

    def event(self, choice: Choice, chunk: Chunk, first: bool) -> dict[str, Any]:
        out = self._envelope(chunk_object=True)
        text = (choice.echo if first else "") + chunk.text
        out["choices"] = [
            self._choice(
                choice.index,
                text,
                list(chunk.token_ids),
                chunk.finish_reason,
                delta=True,
                first=first,
                logprobs=chunk.logprobs,
            )
        ]
        if self.job.include_usage:
            out["usage"] = None
        return out

    def usage_event(self, choices: list[Choice], lasts: list[Chunk]) -> dict[str, Any]:
        out = self._envelope(chunk_object=True)
        out["choices"] = []
        out["usage"] = self.usage(choices, lasts)
        return out


async def _sse_events(
    render: _Render, choices: list[Choice], streams: list[AsyncGenerator[Chunk, None]], firsts: list[Chunk]
) -> AsyncIterator[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    lasts: list[Chunk | None] = [None] * len(choices)
    try:
        async for i, chunk in merge_streams(streams, firsts):
            for payload in render.events(choices[i], chunk, first=lasts[i] is None):
                yield event(payload)
            lasts[i] = chunk
    except Exception as e:  # after the 200 header: report in-band, as OpenAI-compatible servers do
        yield event(_error_for(e).body)
    finally:
        for st in streams:
            await st.aclose()
    finished = [last for last in lasts if last is not None and last.finished]
    if render.job.include_usage and len(finished) == len(choices):
        yield event(render.usage_event(choices, finished))
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
