"""The gRPC service: `jaxserve.v1.JaxServe` (Generate, GetModelInfo, GetDeployment), health, reflection.

Why `grpc.aio` and not a thread-pool server: a `Generate` stream spends nearly all its
life waiting for the next token. On an asyncio server each open stream is a coroutine
parked on the controller's async iterator, so thousands of concurrent streams cost no
threads, and a client cancel or an expired deadline cancels the handler's task, which
cancels the request in the controller and frees its KV blocks at once. A thread-pool
server would need one thread per open stream (a pool sized to the worst case, or
streams refused when it runs out) and a separate cancel callback per call. The HTTP
server (uvicorn) runs on the same event loop, so both protocols share one frontend.

`GetDeployment` (deployment internals) takes the admin credential under HTTP's operator-route rule
(`jaxserve.serving.admin.AdminAccess`): UNAUTHENTICATED without it, PERMISSION_DENIED for the inference key or
when the operator routes are off.

A `Generate` call's life: check the API key (metadata `authorization: Bearer KEY`) ->
`wire.params_from_proto` (shape; unknown fields refused; chat messages rendered) ->
`Frontend.prepare_choices` (tokenize, controller.check_fits, n samples) -> one
`Frontend.stream` per sample, merged: one `GenerateResponse` per controller chunk,
tagged with its sample's `index`; each sample's last carries finish reason, usage and timings. Any runtime error
becomes a status code through `status_for` (the same table the HTTP server uses).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pydantic
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.core.errors import EngineDeadError, InvalidRequestError, OverloadedError, ShuttingDownError
from jaxserve.core.plan import DeploymentPlan
from jaxserve.proto import SERVICE_NAME
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.runtime.api import ServingController
from jaxserve.serving import wire
from jaxserve.serving.admin import AdminAccess, bearer_ok
from jaxserve.serving.chat_template import JinjaChatTemplate
from jaxserve.serving.frontend import Frontend, error_kind, first_chunks, merge_streams
from jaxserve.serving.openai_protocol import ChatCompletionRequest, ChatPrompt, chat_prompt

log = logging.getLogger(__name__)

FIELD_METADATA_KEY = "jaxserve-field"
RETRY_METADATA_KEY = "retry-after-s"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The gRPC status, message and trailing metadata for a runtime error."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc}", ((FIELD_METADATA_KEY, exc.field),)
    if isinstance(exc, OverloadedError):
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{exc} (retry after {exc.retry_after_s:g} s)",
            ((RETRY_METADATA_KEY, f"{exc.retry_after_s:g}"),),
        )
    if isinstance(exc, ShuttingDownError):
        return grpc.StatusCode.UNAVAILABLE, f"server is shutting down: {exc}", ()
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.INTERNAL, f"engine failure: {exc}", ()
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", ()


def _chat_prompt(request: pb.GenerateRequest, template: JinjaChatTemplate | None) -> ChatPrompt:
    """A request with tools rendered as HTTP's chat request is (the same checks, the same prompt)."""
    try:
        body = ChatCompletionRequest.model_validate(wire.chat_request_from_proto(request))
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "messages"
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequestError(f"{where}: {first.get('msg', 'invalid value')}", field=field) from None
    return chat_prompt(body, template)


class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, frontend: Frontend, api_key: str | None, admin_access: AdminAccess | None = None):
        """`admin_access`: who may call `GetDeployment` (the HTTP operator routes' rule; default: off)."""
        self._frontend = frontend
        self._api_key = api_key
        self._admin = admin_access if admin_access is not None else AdminAccess(api_key=api_key)

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self._api_key is None:
            return
        md = {k: v for k, v in (context.invocation_metadata() or ())}
        if not bearer_ok(md.get("authorization"), self._api_key):
            self._frontend.metrics.observe_error("unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (authorization: Bearer KEY)")

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        code, message, trailers = status_for(exc)
        self._frontend.metrics.observe_error(error_kind(exc))
        if code == grpc.StatusCode.INTERNAL:
            log.error("Generate failed", exc_info=exc)
        context.set_trailing_metadata(trailers)
        await context.abort(code, message)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival_at = time.monotonic()
        await self._authorize(context)
        try:
            chat: ChatPrompt | None = None
            if len(request.messages):  # rendering runs the checkpoint's template (untrusted code): off the loop
                loop = asyncio.get_running_loop()
                if wire.uses_tools(request):
                    chat = await loop.run_in_executor(None, _chat_prompt, request, self._frontend.chat_template)
                params = await loop.run_in_executor(
                    None, wire.params_from_proto, request, self._frontend.chat_template,
                    None if chat is None else (chat.text, chat.call),
                )  # fmt: skip
            elif wire.uses_tools(request):
                raise InvalidRequestError("tools need a chat request (messages)", field="tools")
            else:
                params = wire.params_from_proto(request, self._frontend.chat_template)
            n = request.n if request.HasField("n") else 1
            choices = await self._frontend.prepare_choices([params], n, request.echo, arrival_at)
            streams = [self._frontend.stream(c.prepared) for c in choices]
            try:
                firsts = await first_chunks(streams)
                started: set[int] = set()
                texts = [""] * len(choices)  # each reply so far, for its tool calls at the end
                async for i, chunk in merge_streams(streams, firsts):
                    echo = choices[i].echo if i not in started else ""
                    started.add(i)
                    texts[i] += chunk.text
                    made = None if chat is None or not chunk.finished else chat.reply(texts[i], chunk.finish_reason)
                    calls = () if made is None else wire.tool_calls_of(made[1])
                    yield wire.chunk_to_proto(
                        dataclasses.replace(chunk, text=echo + chunk.text, index=choices[i].index, tool_calls=calls)
                    )
            finally:
                for st in streams:
                    await st.aclose()
        except (InvalidRequestError, OverloadedError, ShuttingDownError, EngineDeadError) as e:
            await self._abort(context, e)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # keep serving others; the client gets INTERNAL, the log the traceback
            await self._abort(context, e)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._authorize(context)
        return wire.model_info_to_proto(self._frontend.model_info())

    async def GetDeployment(self, request: pb.GetDeploymentRequest, context: grpc.aio.ServicerContext) -> pb.Deployment:
        # Deployment internals: the admin credential, as HTTP's /debug/* (never the inference key).
        md = {k: v for k, v in (context.invocation_metadata() or ())}
        verdict = self._admin.check(md.get("authorization"))
        if verdict != "ok":
            self._frontend.metrics.observe_error("unauthenticated")
            if verdict == "unauthenticated":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin key (Bearer ADMIN_KEY)")
            reason = self._admin.off_reason if verdict == "off" else "the inference API key does not grant admin"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"GetDeployment needs the admin key: {reason}")
        return wire.deployment_to_proto(*current_deployment(self._frontend.controller))


def current_deployment(controller: ServingController) -> tuple[DeploymentPlan, tuple[str, ...]]:
    """The plan the controller serves now (live switches replace it) and its instances' names, in plan order.

    Read per call, never captured at start-up. The routed instances come first in `instance_names`, in
    routing order (= the plan's order); staged and retiring ones follow and are left out.
    """
    plan = controller.plan.assign_devices()
    return plan, controller.instance_names[: len(plan.instances)]


def build_grpc_server(
    frontend: Frontend,
    *,
    api_key: str | None = None,
    max_message_bytes: int = 1 << 20,
    admin_access: AdminAccess | None = None,
) -> tuple[grpc.aio.Server, Any]:
    """An (unstarted) aio server with the service, health and reflection; returns (server, health servicer)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", 16 * max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_JaxServeServicer_to_server(JaxServeServicer(frontend, api_key, admin_access), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["JaxServe"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    assert names[0] == SERVICE_NAME
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


async def set_serving(health_servicer: Any, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, status)
