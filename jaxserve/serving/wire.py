"""The one module that converts between the gRPC wire schema and jaxserve's dataclasses.

Server side: a `GenerateRequest` proto becomes `CompletionParams` (protocol-neutral,
checked for shape: exactly one prompt, no unknown fields; value ranges are checked
later by the controller), and each `OutputChunk` of a request becomes a
`GenerateResponse`. Client side: responses become `Chunk`s and a `Completion`.
`ModelInfo` and the deployment plan travel both ways.

Pure Python (protobuf only, no JAX), so the client library stays light.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import unknown_fields

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.plan import DeploymentPlan
from jaxserve.core.request import (
    MAX_STOP_TOKEN_IDS,
    FinishReason,
    GuidedSpec,
    RequestTimings,
    SamplingParams,
    TokenLogprobs,
    guided_spec,
)
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.serving.chat_template import JinjaChatTemplate, render_chat

_FINISH_TO_PROTO: dict[FinishReason | None, int] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO: dict[int, FinishReason | None] = {v: k for k, v in _FINISH_TO_PROTO.items()}
# A reply of tool calls ended as a stop does; its chunk's `tool_calls` say what it called.
_FINISH_FROM_PROTO[pb.FINISH_REASON_TOOL_CALLS] = "stop"

# Bounds of the wire's free-form repeated fields; beyond these the request is refused
# before any tokenizer or model work (the gRPC message size limit caps the rest).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_N = 16  # samples per prompt


# ---------------------------------------------------------------------------------------
# Protocol-neutral request and output
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompletionParams:
    """What a client asked for, before tokenization and range checks.

    `prompt_field` is the wire name of the prompt field the client used, so an error
    about the prompt names what the client actually sent.
    """

    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    prompt_field: str = "prompt"
    include_stop_str_in_output: bool = False
    fill_max_tokens: bool = False  # max_tokens unset (chat): as many as the context and limits allow
    cache_salt: str | None = None  # the client's (vLLM's `cache_salt`); the server adds its API key's salt
    # False for a prompt a checkpoint's chat template rendered: the template writes its own BOS, and the
    # tokenizer's post-processor would add a second one (transformers' apply_chat_template encodes it so too).
    add_special_tokens: bool = True


@dataclasses.dataclass(frozen=True)
class Timings:
    """Per-request durations in seconds (None: the phase did not happen). Server-measured."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prefill_queue_s: float | None = None
    prefill_s: float | None = None
    kv_transfer_s: float | None = None
    decode_queue_s: float | None = None
    kv_transfer_bytes: int = 0
    token_times_s: tuple[float, ...] = ()
    prefill_instance: str = ""
    decode_instance: str = ""
    cached_prompt_tokens: int = 0  # prompt tokens served from a prefix cache (not on the wire's timings)

    @property
    def inter_token_latencies_s(self) -> tuple[float, ...]:
        t = self.token_times_s
        return tuple(b - a for a, b in itertools.pairwise(t))

    @classmethod
    def from_request_timings(
        cls, t: RequestTimings, *, arrival_at: float | None = None, num_tokens: int | None = None
    ) -> Timings:
        """The engine's timestamps as durations; `arrival_at`: when the server received the request
        (default: when the controller did); `num_tokens`: count only the first tokens (a stop string
        ended the request there)."""
        arrival = t.arrival_at if arrival_at is None else arrival_at
        times = list(t.token_times if num_tokens is None else t.token_times[:num_tokens])
        decode_ready_at = t.transfer_end_at if t.transfer_end_at is not None else t.prefill_end_at
        return cls(
            ttft_s=times[0] - arrival if times else None,
            tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            e2e_s=_diff(t.finished_at, arrival),
            prefill_queue_s=_diff(t.prefill_start_at, t.arrival_at),
            prefill_s=_diff(t.prefill_end_at, t.prefill_start_at),
            kv_transfer_s=t.kv_transfer_s if t.transfer_end_at is not None or t.kv_transfer_bytes else None,
            decode_queue_s=_diff(t.decode_start_at, decode_ready_at),
            kv_transfer_bytes=int(t.kv_transfer_bytes),
            token_times_s=tuple(x - arrival for x in times),
            prefill_instance=t.prefill_instance or "",
            decode_instance=t.decode_instance or "",
            cached_prompt_tokens=int(t.cached_prompt_tokens),
        )


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call the model made: OpenAI's `tool_calls[i]`, the arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class Chunk:
    """New output of one request: token ids, their text, and on the last chunk why it ended."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    finish_reason: FinishReason | None = None
    timings: Timings | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far (all chunks), final value on the last chunk
    num_cached_tokens: int = 0  # on the last chunk: prompt tokens served from a prefix cache
    index: int = 0  # which sample of the request (n > 1)
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token id, when the request asked
    tool_calls: tuple[ToolCall, ...] = ()  # on the last chunk: the calls the reply made (its text is as written)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A whole response: every token, the whole text, why it ended, and timings."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    timings: Timings | None
    num_prompt_tokens: int
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token id, when the request asked
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the reply made (tools); its `text` is what the model wrote

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> Completion:
        if not chunks:
            raise ValueError("a completion needs at least one chunk")
        last = chunks[-1]
        return cls(
            request_id=last.request_id,
            token_ids=tuple(t for c in chunks for t in c.token_ids),
            text="".join(c.text for c in chunks),
            finish_reason=last.finish_reason,
            timings=last.timings,
            num_prompt_tokens=last.num_prompt_tokens,
            num_cached_tokens=last.num_cached_tokens,
            tool_calls=last.tool_calls,
            logprobs=None
            if all(c.logprobs is None for c in chunks)
            else tuple(lp for c in chunks for lp in c.logprobs or ()),
        )


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a client may want to know about the served model and the request limits."""

    name: str
    vocab_size: int
    max_position_embeddings: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    dtype: str
    has_tokenizer: bool
    bos_token_id: int  # -1: the model has none
    eos_token_id: int  # the first EOS id (Llama 3 has several; every one ends a sequence); -1: none
    max_prompt_tokens: int
    max_tokens_limit: int


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------
def reject_unknown_fields(message: Any, path: str = "") -> None:
    """Raise `InvalidRequestError` if the message (or a sub-message) carries fields this schema lacks."""
    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        where = f"{path}." if path else ""
        raise InvalidRequestError(
            f"unknown field number(s) {numbers} in {message.DESCRIPTOR.name}; the client's schema is newer than "
            "the server's",
            field=f"{where}#{numbers[0]}",
        )
    for field, value in message.ListFields():
        if field.message_type is not None:
            values = value if field.is_repeated else [value]
            for v in values:
                reject_unknown_fields(v, f"{path}.{field.name}" if path else field.name)


def params_from_proto(
    req: pb.GenerateRequest,
    template: JinjaChatTemplate | None = None,
    chat: tuple[str, GuidedSpec | None] | None = None,
) -> CompletionParams:
    """Check the request's shape (not its value ranges) and convert it; `messages` go through the checkpoint's
    chat `template` (None: the built-in one), or are `chat` already: the prompt a request with tools rendered to,
    and its forced call's grammar (`jaxserve.serving.openai_protocol.chat_prompt`)."""
    reject_unknown_fields(req)
    has_text = bool(req.prompt)
    has_ids = len(req.prompt_token_ids) > 0
    has_messages = len(req.messages) > 0
    if has_text + has_ids + has_messages > 1:
        raise InvalidRequestError("send one of prompt, prompt_token_ids and messages", field="prompt")
    if not has_text and not has_ids and not has_messages:
        raise InvalidRequestError("the prompt is empty: set prompt, prompt_token_ids or messages", field="prompt")
    if req.HasField("n") and not 1 <= req.n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {req.n}", field="n")
    text = req.prompt if has_text else None
    add_special_tokens = not (has_messages and template is not None)
    if has_messages and chat is not None:
        text = chat[0]
    elif has_messages:
        try:
            text = render_chat(((m.role, m.content) for m in req.messages), template)
        except ValueError as e:
            raise InvalidRequestError(str(e), field="messages") from None
    if len(req.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in req.stop):
        raise InvalidRequestError(
            f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} characters", field="stop"
        )
    if any(s == "" for s in req.stop):
        raise InvalidRequestError("stop strings must not be empty", field="stop")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids", field="stop_token_ids")
    if req.HasField("cache_salt") and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters (leave it unset for none)", field="cache_salt"
        )
    defaults = SamplingParams()
    sampling = SamplingParams(
        max_tokens=req.max_tokens if req.HasField("max_tokens") else defaults.max_tokens,
        temperature=req.temperature if req.HasField("temperature") else defaults.temperature,
        top_p=req.top_p if req.HasField("top_p") else defaults.top_p,
        top_k=req.top_k if req.HasField("top_k") else defaults.top_k,
        seed=req.seed if req.HasField("seed") else None,
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        guided=_guided_from_proto(req.response_format) if req.HasField("response_format") else None,
    )
    if chat is not None and chat[1] is not None:
        if sampling.guided is not None:
            raise InvalidRequestError(
                "response_format and a forced tool call both constrain the output: send one", field="response_format"
            )
        sampling = dataclasses.replace(sampling, guided=chat[1])
    return CompletionParams(
        prompt_text=text,
        prompt_token_ids=tuple(req.prompt_token_ids) if has_ids else None,
        sampling=sampling,
        stop=tuple(req.stop),
        prompt_field="prompt" if has_text else "prompt_token_ids" if has_ids else "messages",
        include_stop_str_in_output=req.include_stop_str_in_output,
        cache_salt=req.cache_salt if req.HasField("cache_salt") else None,
        add_special_tokens=add_special_tokens,
    )


def uses_tools(req: pb.GenerateRequest) -> bool:
    """Whether a request's prompt depends on tools: tools or a tool_choice, or tool calls and results in its
    messages (then `chat_request_from_proto` and the OpenAI path render it)."""
    return bool(
        len(req.tools)
        or req.HasField("tool_choice")
        or any(m.role == "tool" or len(m.tool_calls) or m.tool_call_id for m in req.messages)
    )


def chat_request_from_proto(req: pb.GenerateRequest) -> dict[str, Any]:
    """A request's messages, tools and tool choice as OpenAI's chat request body holds them (JSON-shaped)."""
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content if m.content or not m.tool_calls else None}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    body: dict[str, Any] = {"messages": messages}
    if len(req.tools):
        body["tools"] = [{"type": "function", "function": _function_from_proto(i, t)} for i, t in enumerate(req.tools)]
    if req.HasField("tool_choice"):
        choice = req.tool_choice
        named = {"type": "function", "function": {"name": choice}}
        body["tool_choice"] = choice if choice in ("none", "auto", "required") else named
    if req.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = req.parallel_tool_calls
    return body


def _function_from_proto(index: int, tool: pb.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except ValueError as e:
            raise InvalidRequestError(f"tools[{index}].parameters is not JSON: {e}", field="tools") from None
    return function


def tool_calls_of(calls: Sequence[Mapping[str, Any]]) -> tuple[ToolCall, ...]:
    """OpenAI `tool_calls` entries (`{"id", "type", "function": {"name", "arguments"}}`) as `ToolCall`s."""
    return tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls)


def _guided_from_proto(fmt: pb.ResponseFormat) -> GuidedSpec | None:
    schema = None
    if fmt.json_schema:
        try:
            schema = json.loads(fmt.json_schema)
        except ValueError as e:
            raise InvalidRequestError(
                f"response_format.json_schema is not JSON: {e}", field="response_format"
            ) from None
    return guided_spec(fmt.type or "text", schema, strict=fmt.strict)


def response_format_to_proto(fmt: Mapping[str, Any]) -> pb.ResponseFormat:
    """OpenAI's `response_format` mapping (`{"type": "json_schema", "json_schema": {"schema": ..., "strict": ...}}`)
    as the proto message."""
    spec = fmt.get("json_schema") or {}
    schema = spec.get("schema")
    return pb.ResponseFormat(
        type=str(fmt.get("type", "text")),
        json_schema="" if schema is None else json.dumps(schema),
        strict=bool(spec.get("strict", False)),
    )


def request_to_proto(
    *,
    prompt: str | None = None,
    prompt_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] | str = (),
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    n: int | None = None,
    echo: bool = False,
    messages: Sequence[tuple[str, str] | Mapping[str, Any]] = (),
    logprobs: int | None = None,
    cache_salt: str | None = None,
    response_format: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> pb.GenerateRequest:
    """Build a request message (client side). Unset optional fields take the server's defaults.

    `messages`: (role, content) pairs or OpenAI's message mappings (with `tool_calls` and `tool_call_id`);
    `tools` and `tool_choice` as OpenAI's chat request takes them."""
    req = pb.GenerateRequest(
        prompt=prompt or "",
        prompt_token_ids=list(prompt_ids or ()),
        stop_token_ids=list(stop_token_ids),
        stop=[stop] if isinstance(stop, str) else list(stop),
        ignore_eos=ignore_eos,
        include_stop_str_in_output=include_stop_str_in_output,
        echo=echo,
        messages=[_message_to_proto(m) for m in messages],
        tools=[_tool_to_proto(t) for t in tools or ()],
    )
    if tool_choice is not None:
        req.tool_choice = tool_choice if isinstance(tool_choice, str) else str(tool_choice["function"]["name"])
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    if n is not None:
        req.n = n
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if temperature is not None:
        req.temperature = temperature
    if top_p is not None:
        req.top_p = top_p
    if top_k is not None:
        req.top_k = top_k
    if seed is not None:
        req.seed = seed
    if logprobs is not None:
        req.logprobs = logprobs
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if response_format is not None:
        req.response_format.CopyFrom(response_format_to_proto(response_format))
    return req


def _message_to_proto(m: tuple[str, str] | Mapping[str, Any]) -> pb.ChatMessage:
    if isinstance(m, tuple):
        return pb.ChatMessage(role=m[0], content=m[1])
    calls = [
        pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in m.get("tool_calls") or ()
    ]
    return pb.ChatMessage(
        role=m["role"], content=m.get("content") or "", tool_calls=calls, tool_call_id=m.get("tool_call_id") or "",
        name=m.get("name") or "",
    )  # fmt: skip


def _tool_to_proto(tool: Mapping[str, Any]) -> pb.Tool:
    f = tool["function"]
    parameters = f.get("parameters")
    return pb.Tool(
        name=f["name"], description=f.get("description") or "",
        parameters="" if parameters is None else json.dumps(parameters),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------
def timings_to_proto(t: Timings) -> pb.RequestTimings:
    out = pb.RequestTimings(
        kv_transfer_bytes=t.kv_transfer_bytes,
        token_times_s=list(t.token_times_s),
        prefill_instance=t.prefill_instance,
        decode_instance=t.decode_instance,
    )
    for name in ("ttft_s", "tpot_s", "e2e_s", "prefill_queue_s", "prefill_s", "kv_transfer_s", "decode_queue_s"):
        value = getattr(t, name)
        if value is not None:
            setattr(out, name, value)
    return out


def timings_from_proto(m: pb.RequestTimings) -> Timings:
    def opt(name: str) -> float | None:
        return getattr(m, name) if m.HasField(name) else None

    return Timings(
        ttft_s=opt("ttft_s"),
        tpot_s=opt("tpot_s"),
        e2e_s=opt("e2e_s"),
        prefill_queue_s=opt("prefill_queue_s"),
        prefill_s=opt("prefill_s"),
        kv_transfer_s=opt("kv_transfer_s"),
        decode_queue_s=opt("decode_queue_s"),
        kv_transfer_bytes=m.kv_transfer_bytes,
        token_times_s=tuple(m.token_times_s),
        prefill_instance=m.prefill_instance,
        decode_instance=m.decode_instance,
    )


def chunk_to_proto(chunk: Chunk) -> pb.GenerateResponse:
    out = pb.GenerateResponse(
        request_id=chunk.request_id,
        token_ids=list(chunk.token_ids),
        text=chunk.text,
        finish_reason=_FINISH_TO_PROTO[chunk.finish_reason],  # type: ignore[arg-type]
        index=chunk.index,
        logprobs=[logprobs_to_proto(lp) for lp in chunk.logprobs or ()],
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in chunk.tool_calls],
    )
    if chunk.tool_calls and chunk.finish_reason == "stop":
        out.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    if chunk.finished:
        if chunk.timings is not None:
            out.timings.CopyFrom(timings_to_proto(chunk.timings))
        out.usage.prompt_tokens = chunk.num_prompt_tokens
        out.usage.completion_tokens = chunk.num_output_tokens
        out.usage.cached_tokens = chunk.num_cached_tokens
    return out


def chunk_from_proto(m: pb.GenerateResponse, num_output_tokens_before: int = 0) -> Chunk:
    finished = m.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return Chunk(
        request_id=m.request_id,
        token_ids=tuple(m.token_ids),
        text=m.text,
        finish_reason=_FINISH_FROM_PROTO.get(m.finish_reason, "abort"),
        timings=timings_from_proto(m.timings) if m.HasField("timings") else None,
        num_prompt_tokens=m.usage.prompt_tokens if finished else 0,
        num_output_tokens=m.usage.completion_tokens if finished else num_output_tokens_before + len(m.token_ids),
        num_cached_tokens=m.usage.cached_tokens if finished else 0,
        index=m.index,
        logprobs=tuple(logprobs_from_proto(lp) for lp in m.logprobs) if len(m.logprobs) else None,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
    )


def logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprobs_from_proto(m: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(m.logprob, tuple((int(t.token_id), t.logprob) for t in m.top))


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**dataclasses.asdict(info))


def model_info_from_proto(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(**{f.name: getattr(m, f.name) for f in dataclasses.fields(ModelInfo)})


def deployment_to_proto(plan: DeploymentPlan, instance_names: Sequence[str] = ()) -> pb.Deployment:
    names = list(instance_names) or [f"{i.role}-{n}" for n, i in enumerate(plan.instances)]
    return pb.Deployment(
        kind=plan.kind,
        spec=plan.describe(),
        instances=[
            pb.Instance(
                name=name,
                role=inst.role,
                tp=inst.tp,
                pp=inst.pp,
                devices=list(inst.devices or ()),
                chunk_size=inst.chunk_size or 0,
            )
            for name, inst in zip(names, plan.instances, strict=True)
        ],
        plan_json=plan.to_json(indent=None),
    )


def deployment_from_proto(m: pb.Deployment) -> DeploymentPlan:
    return DeploymentPlan.from_json(m.plan_json)
