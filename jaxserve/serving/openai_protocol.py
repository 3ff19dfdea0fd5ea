"""OpenAI's request schemas (completions and chat completions) and their conversion to `CompletionParams`.

Strict pydantic models: unknown fields are refused; the OpenAI fields jaxserve does not
implement are accepted only at their neutral value. Extensions as in vLLM: `top_k`,
`ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `return_token_ids`.

A request becomes an `OpenAIJob`: one `CompletionParams` per prompt (a completions
request may carry a list of prompts), `n` samples of each, and how to render the output
(echo, token ids, usage in the stream). Choice `i * n + j` is sample `j` of prompt `i`.

Chat messages become one prompt through `jaxserve.serving.chat_template` (see
docs/serving.md); `chat_prompt` renders them as the request's `tools` and `tool_choice` ask (a forced call's
grammar, "auto"'s tools handed to a template with a tool-call format) and its `ChatPrompt` reads the reply's
calls, for HTTP and gRPC alike.

Logprobs: completions' `logprobs` (0..5, OpenAI's legacy limit) and chat's `logprobs` +
`top_logprobs` (0..20) become `SamplingParams.logprobs`; the values are the log-softmax of the
model's raw logits (see docs/serving.md). Completions with both `echo` and `logprobs` are refused:
the prompt's own logprobs would cost a log-softmax over every prompt position, which the engine
does not compute.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.request import DEFAULT_MAX_TOKENS, MAX_STOP_TOKEN_IDS, GuidedSpec, SamplingParams, guided_spec
from jaxserve.serving import chat_template, tool_calls, tool_parsers
from jaxserve.serving.wire import (
    MAX_CACHE_SALT_CHARS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    CompletionParams,
)

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; gRPC's default is greedy (0)
MAX_CHOICES = 64  # prompts x n in one request
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions API
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (= jaxserve.core.request.MAX_LOGPROBS)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema the output must be valid against (`strict`: and nothing beyond)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def guided(self) -> GuidedSpec | None:
        """The constraint this asks for (None: free text)."""
        if self.json_schema is not None and self.type != "json_schema":
            raise _bad("response_format", "json_schema is only allowed with type json_schema")
        schema = None if self.json_schema is None else self.json_schema.schema_
        return guided_spec(self.type, schema, strict=bool(self.json_schema and self.json_schema.strict))


class _SamplingFields(_Strict):
    """The fields completions and chat share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    max_completion_tokens: int | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None)
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only with requests of the same salt
    response_format: ResponseFormat | None = None  # on completions too, as vLLM takes it


class CompletionRequest(_SamplingFields):
    """OpenAI's completion request (`POST /v1/completions`)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(p.text for p in self.content or ())
        if self.role == "tool" or self.tool_calls:  # tool follow-ups, in the generic words (tool_calls.py)
            calls = [(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ()]
            return tool_calls.followup_text(self.role, text, calls, self.tool_call_id)
        return text

    def template_dict(self) -> dict[str, Any]:
        """The message as a template that renders tools takes it (`transformers`' chat format): OpenAI's fields
        (developer turns as system ones, the content's text parts joined), an earlier call's arguments as the
        mapping they encode (OpenAI sends JSON text; such templates write `arguments | tojson`, as vLLM hands
        them)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        out["content"] = None if self.content is None else (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )  # fmt: skip
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def template_role(self) -> str:
        """The role the template renders: a tool result is the user's turn in the generic format."""
        return "user" if self.role == "tool" else self.role


def _arguments(call: AssistantToolCall) -> Any:
    if not call.function.arguments.strip():
        return {}
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        raise InvalidRequestError(f"tool call {call.id!r}: its arguments are not JSON", field="messages") from None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """OpenAI's chat completion request (`POST /v1/chat/completions`)."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: only the first call of an "auto" reply (a forced call is one)


def render_chat(
    messages: list[ChatMessage],
    template: chat_template.JinjaChatTemplate | None = None,
    tools: list[Tool] | None = None,
) -> str:
    """OpenAI messages through the checkpoint's chat `template` (None: jaxserve's built-in one).

    A template with a tool-call format (`tool_parsers.detect_format`) gets the messages whole (tool calls,
    tool results) and `tools`, as `transformers` hands them; any other renders each message's text, tool
    follow-ups in the generic words (`tool_calls.followup_text`)."""
    if template is not None and tool_parsers.detect_format(template.template) is not None:
        tool_dicts = None if tools is None else [t.model_dump(exclude_none=True) for t in tools]
        return chat_template.render_structured([m.template_dict() for m in messages], template, tool_dicts)
    return chat_template.render_chat(((m.template_role, m.text()) for m in messages), template)


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt, and what its tools make of the reply (HTTP's and gRPC's)."""

    text: str
    call: GuidedSpec | None = None  # a forced call (tool_calls.py): the grammar the reply must follow
    tool_format: tool_parsers.ToolFormat | None = None  # tool_choice "auto": the reply is parsed in this format
    parallel_tool_calls: bool = True  # false: an "auto" reply's first call only

    @property
    def streams_calls(self) -> bool:
        """Whether the reply is read as it streams ("auto"); a forced call is held until it is whole."""
        return self.tool_format is not None

    def reply(self, text: str, reason: str | None) -> tuple[str | None, list[dict[str, Any]]] | None:
        """A finished reply's content and OpenAI `tool_calls` entries when it made calls (None: it is text, or a
        forced call cut short)."""
        if self.call is not None:
            call = tool_calls.parse_call(text) if reason == "stop" else None
            return None if call is None else (None, [call])
        if self.tool_format is None:
            return None
        content, calls = tool_parsers.parse_reply(self.tool_format, text)
        if not calls:
            return None
        return content, calls if self.parallel_tool_calls else calls[:1]


def chat_prompt(body: ChatCompletionRequest, template: chat_template.JinjaChatTemplate | None) -> ChatPrompt:
    """Render a chat request's messages (the checkpoint's `template`, if any) as its `tools` and `tool_choice`
    ask: a forced call's tools in a system message and its grammar, "auto"'s tools to a template that knows a
    tool-call format (a 400 if it knows none), "none" without tools."""
    fmt = None if template is None else tool_parsers.detect_format(template.template)
    messages, call, auto = _tool_choice(body, fmt)
    return ChatPrompt(
        render_chat(messages, template, body.tools if auto else None),
        call,
        fmt if auto else None,
        body.parallel_tool_calls is not False,
    )


@dataclasses.dataclass(frozen=True)
class OpenAIJob:
    """What one OpenAI request asks for, transport-neutral."""

    prompts: tuple[CompletionParams, ...]
    n: int
    echo: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: int | None = None  # alternatives per token when the client asked for logprobs, else None
    chat: ChatPrompt | None = None  # a chat request's: what its tools make of the reply


def _bad(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, field=field)


def _check_common(body: _SamplingFields) -> tuple[tuple[str, ...], bool]:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0.0):
            raise _bad(name, f"{name} is not supported (only 0)")
    if body.logit_bias:
        raise _bad("logit_bias", "logit_bias is not supported")
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options", "stream_options is only allowed with stream=true")
    if not 1 <= body.n <= MAX_N:
        raise _bad("n", f"n must be in [1, {MAX_N}], got {body.n}")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} characters")
    if any(s == "" for s in stop):
        raise _bad("stop", "stop strings must not be empty")
    if body.stop_token_ids and len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return stop, include_usage


def _sampling(body: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        guided=None if body.response_format is None else body.response_format.guided(),
    )


def completion_job(body: CompletionRequest) -> OpenAIJob:
    """Check a completions request's shape and the fields jaxserve does not implement."""
    stop, include_usage = _check_common(body)
    if body.best_of not in (None, 1, body.n):
        raise _bad("best_of", "best_of must equal n (no server-side ranking)")
    if body.logprobs is not None:
        if not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise _bad("logprobs", f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {body.logprobs}")
        if body.echo:
            raise _bad("logprobs", "logprobs with echo=true is not supported (the prompt's logprobs are not computed)")
    if body.suffix:
        raise _bad("suffix", "suffix is not supported")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        raise _bad("max_tokens", "max_tokens must be set")
    raw = body.prompt
    prompts: list[str | tuple[int, ...]]
    if isinstance(raw, str):
        prompts = [raw]
    elif raw and isinstance(raw[0], str):
        prompts = [str(p) for p in raw]
    elif raw and isinstance(raw[0], list):
        prompts = [tuple(p) for p in raw]  # type: ignore[arg-type]
    else:
        prompts = [tuple(raw)]  # type: ignore[arg-type]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise _bad("prompt", "the prompt is empty")
    if len(prompts) * body.n > MAX_CHOICES:
        raise _bad("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(prompts)} x {body.n}")
    sampling = _sampling(body, max_tokens, body.logprobs)
    params = tuple(
        CompletionParams(
            prompt_text=p if isinstance(p, str) else None,
            prompt_token_ids=None if isinstance(p, str) else p,
            sampling=sampling,
            stop=stop,
            include_stop_str_in_output=body.include_stop_str_in_output,
            cache_salt=_salt(body.cache_salt),
        )
        for p in prompts
    )
    return OpenAIJob(params, body.n, body.echo, body.stream, include_usage, body.return_token_ids, body.logprobs)


def _salt(salt: str | None) -> str | None:
    if salt is not None and not salt:
        raise _bad("cache_salt", "cache_salt must not be empty (leave it out for none)")
    if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
        raise _bad("cache_salt", f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters")
    return salt


def chat_job(body: ChatCompletionRequest, template: chat_template.JinjaChatTemplate | None = None) -> OpenAIJob:
    """Check a chat request and render its messages into one prompt (the checkpoint's `template`, if any)."""
    stop, include_usage = _check_common(body)
    logprobs: int | None = None
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise _bad("top_logprobs", "top_logprobs needs logprobs=true")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}")
    if body.logprobs:
        logprobs = body.top_logprobs or 0
    if not body.messages:
        raise _bad("messages", "messages must not be empty")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt = chat_prompt(body, template)
    sampling = _sampling(body, max_tokens or 1, logprobs)
    if prompt.call is not None:
        sampling = dataclasses.replace(sampling, guided=prompt.call)
    params = CompletionParams(
        prompt_text=prompt.text,
        prompt_token_ids=None,
        sampling=sampling,
        stop=stop,
        prompt_field="messages",
        include_stop_str_in_output=body.include_stop_str_in_output,
        fill_max_tokens=max_tokens is None,
        cache_salt=_salt(body.cache_salt),
        add_special_tokens=template is None,
    )
    return OpenAIJob((params,), body.n, False, body.stream, include_usage, body.return_token_ids, logprobs, prompt)


def _tool_choice(
    body: ChatCompletionRequest, fmt: tool_parsers.ToolFormat | None
) -> tuple[list[ChatMessage], GuidedSpec | None, bool]:
    """The messages to render, the grammar of the call the output must be (None: no forced call), and whether
    the model chooses ("auto": the tools go to the template, the output is parsed in its format `fmt`)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise _bad("tool_choice", "tool_choice needs tools")
        return body.messages, None, False
    if choice == "none":  # the tools stay out of the prompt: the model is not to call them
        return body.messages, None, False
    if choice is None or choice == "auto":
        if fmt is None:
            raise _bad("tool_choice", tool_calls.AUTO_UNSUPPORTED)
        return body.messages, None, True
    if body.response_format is not None and body.response_format.type != "text":
        raise _bad("response_format", "response_format and a forced tool call both constrain the output: send one")
    tools = [
        tool_calls.FunctionTool(
            t.function.name, t.function.description, t.function.parameters or {"type": "object", "properties": {}}
        )
        for t in body.tools
    ]
    forced = None if choice == "required" else choice.function.name
    spec = tool_calls.call_spec(tools, forced)
    described = tool_calls.tools_system_message(tools, forced)
    messages = list(body.messages)
    if messages[0].role in ("system", "developer"):  # one system turn: some templates allow no second one
        messages[0] = ChatMessage(role=messages[0].role, content=f"{messages[0].text()}\n\n{described}")
    else:
        messages.insert(0, ChatMessage(role="system", content=described))
    return messages, spec, False
