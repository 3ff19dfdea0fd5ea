"""Offline generation: `LLM(model=..., deployment=...).generate(prompts, SamplingParams)`.

A thin layer over the `Controller`: it places the deployment on this
process's devices, submits every prompt (waiting and retrying when admission
control says the queues are full), and collects each request's tokens in
prompt order. Text prompts need a tokenizer next to the checkpoint; a model
without one (a preset name) falls back to a byte-level stand-in, with a
warning, so that random-weight smoke runs still work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from jaxserve.core.errors import OverloadedError
from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.plan import DeploymentPlan, parse_deployment
from jaxserve.core.request import (
    FinishReason,
    GenerateRequest,
    RequestTimings,
    SamplingParams,
    TokenChunk,
    TokenLogprobs,
)
from jaxserve.model_registry import resolve_model_source
from jaxserve.runtime.controller import Controller, ControllerConfig, RequestStream
from jaxserve.runtime.instances import EngineFactory
from jaxserve.runtime.pool_sizing import DEFAULT_KV_MEMORY_FRACTION
from jaxserve.serving.wire import ToolCall

if TYPE_CHECKING:
    from jaxserve.runtime.ray_backend.deployment import RayConfig
    from models.paged_attention import BlockLayout, Impl

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]

# Offline defaults: the KV pool sized from memory as `serve` sizes it (num_kv_blocks None), and a decode batch
# twice serving's (offline work has no latency target; a wider batch reads the weights once for more tokens).
OFFLINE_LIMITS = dataclasses.replace(DEFAULT_LIMITS, num_kv_blocks=None, max_decode_batch=64)


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteCodec:
    """UTF-8 bytes as token ids (offset past OPT's special ids); only for models without a tokenizer."""

    OFFSET = 4

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256 + self.OFFSET:
            raise ValueError(f"vocabulary of {vocab_size} is too small for the byte fallback")

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode()]

    def decode(self, token_ids: Sequence[int]) -> str:
        data = bytes(t - self.OFFSET for t in token_ids if self.OFFSET <= t < 256 + self.OFFSET)
        return data.decode(errors="replace")


class HFTokenizerCodec:
    """A `tokenizers.Tokenizer` (adds OPT's BOS through its post-processor)."""

    def __init__(self, tokenizer: object) -> None:
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)  # type: ignore[attr-defined]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: FinishReason
    timings: RequestTimings | None
    # With `SamplingParams(logprobs=k)`: one per output token (its log-softmax and the k most likely), else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # `chat` with tools: the calls the reply made (`text` is as written)


class LLM:
    """An in-process deployment for offline generation."""

    def __init__(
        self,
        model: str = "opt-tiny",
        deployment: str | DeploymentPlan = "colocated:tp1",
        *,
        config: ControllerConfig | None = None,
        limits: ServingLimits | None = None,
        dtype: str = "float32",
        engine_factory: EngineFactory | None = None,
        backend: Literal["embedded", "ray"] = "embedded",
        ray_config: RayConfig | None = None,
        block_layout: BlockLayout | None = None,
        attention_impl: Impl | None = None,
        kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
        quantization: str | None = None,
    ) -> None:
        """`config`: the deployment's knobs (`ControllerConfig`); `limits`: just its serving limits (block_size,
        num_kv_blocks, max_decode_batch, ...), the rest default — not both. Without either: `OFFLINE_LIMITS`.
        `num_kv_blocks=None` (the default): the KV pool holds what `kv_memory_fraction` of the memory the loaded
        weights leave holds, as `jaxserve serve` sizes it (`runtime.pool_sizing`; capped at a full decode batch of
        the model's longest sequences). `attention_impl`: every instance's paged decode attention
        (`models.paged_attention.IMPLS`); default: the backend's (`default_impl`). `block_layout`: the KV pool's
        block layout on every instance ("tokens" or "heads"); default: the one that attention reads best
        (`models.paged_attention.block_layout_for`). `quantization`: serve a float checkpoint's weights at this
        precision ("int8", "int4": `models.quantize`); default: the checkpoint's own (a GGUF as stored)."""
        model = resolve_model_source(model)  # a pulled registry name -> its cached file
        plan = parse_deployment(deployment) if isinstance(deployment, str) else deployment
        if limits is not None and config is not None:
            raise ValueError("give config (with its limits) or limits, not both")
        if config is None:
            limits = limits or OFFLINE_LIMITS
        self.controller: Controller
        own_engines = block_layout is not None or attention_impl is not None or quantization is not None
        if own_engines and (engine_factory is not None or backend == "ray"):
            raise ValueError(
                "block_layout, attention_impl and quantization apply to the embedded backend's own engines "
                "(no engine_factory)"
            )
        from_memory = config is None and limits is not None and limits.num_kv_blocks is None
        if (own_engines or from_memory) and engine_factory is None and backend == "embedded":
            from jaxserve.runtime.engines.model import model_engine_factory

            engine_factory = model_engine_factory(
                model, dtype=dtype, block_layout=block_layout, attention_impl=attention_impl, quantization=quantization
            )
        if config is None:
            assert limits is not None
            if from_memory:
                blocks = None
                if backend == "embedded" and engine_factory is not None:
                    from jaxserve.runtime.pool_sizing import kv_blocks_from_memory

                    blocks, engine_factory = kv_blocks_from_memory(plan, engine_factory, limits, kv_memory_fraction)
                # an engine that cannot say (or Ray's actors, sized where they run): the serving default
                limits = dataclasses.replace(limits, num_kv_blocks=blocks or DEFAULT_LIMITS.num_kv_blocks)
                log.info("KV pool: %s blocks x %d tokens per instance", limits.num_kv_blocks, limits.block_size)
            config = ControllerConfig(limits=limits)
        if backend == "ray":  # every instance a Ray actor; see jaxserve/runtime/ray_backend
            from jaxserve.runtime.ray_backend.deployment import RayController

            self.controller = RayController.launch(model, plan, config, ray_config, dtype=dtype)
        else:
            self.controller = Controller.from_plan(
                model, plan, engine_factory=engine_factory, config=config, dtype=dtype
            )
        self.controller.start()
        self.codec: TextCodec
        if self.controller.tokenizer is not None:
            self.codec = HFTokenizerCodec(self.controller.tokenizer)
            self.has_tokenizer = True
        else:
            self.codec = ByteCodec(self.controller.model_config.vocab_size)
            self.has_tokenizer = False

    def encode(self, text: str) -> list[int]:
        if not self.has_tokenizer:
            log.warning("model has no tokenizer: encoding text as UTF-8 bytes (only useful for smoke tests)")
        return self.codec.encode(text)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | None = None, timeout_s: float = 600.0
    ) -> list[RequestOutput]:
        """Generate for one prompt or many (text or token ids); outputs in prompt order."""
        sampling = sampling or SamplingParams()
        batch: list[Prompt]
        if isinstance(prompts, str) or (len(prompts) > 0 and all(isinstance(t, int) for t in prompts)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        token_lists = [tuple(self.encode(p)) if isinstance(p, str) else tuple(int(t) for t in p) for p in batch]
        prefix = uuid.uuid4().hex[:8]
        requests = [GenerateRequest(f"llm-{prefix}-{i}", ids, sampling) for i, ids in enumerate(token_lists)]
        for r in requests:
            self.controller.check_fits(r)
        streams: list[RequestStream] = []
        deadline = time.monotonic() + timeout_s
        for r in requests:
            while True:
                try:
                    streams.append(self.controller.submit(r))
                    break
                except OverloadedError as e:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(min(e.retry_after_s, 0.05))
        outputs = []
        for r, s in zip(requests, streams, strict=True):
            asked = r.sampling.logprobs is not None
            ids, logprobs, last = _collect(s, max(deadline - time.monotonic(), 1.0), asked)
            assert last.finish_reason is not None
            text = self.codec.decode(ids) if self.has_tokenizer or any(isinstance(p, str) for p in batch) else None
            outputs.append(
                RequestOutput(
                    r.request_id, r.prompt_token_ids, tuple(ids), text, last.finish_reason, last.timings, logprobs
                )
            )
        return outputs

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        timeout_s: float = 600.0,
    ) -> RequestOutput:
        """One chat reply: OpenAI's `messages` (tool calls and `role: "tool"` results too), `tools` and
        `tool_choice`, rendered and read as the HTTP server's chat completions are (docs/serving.md); the reply's
        calls are its `tool_calls`. `InvalidRequestError` for a request the server would answer with a 400
        (pydantic's ValidationError, a ValueError, for a message of the wrong shape)."""
        from jaxserve.serving.frontend import Detokenizer, marker_tokens
        from jaxserve.serving.openai_protocol import ChatCompletionRequest, chat_prompt

        tokenizer = self.controller.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs the model's tokenizer")
        body: dict[str, Any] = {"messages": [dict(m) for m in messages]}
        if tools is not None:
            body["tools"] = [dict(t) for t in tools]
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            body["parallel_tool_calls"] = parallel_tool_calls
        template = self.controller.chat_template
        prompt = chat_prompt(ChatCompletionRequest.model_validate(body), template)
        sampling = sampling or SamplingParams()
        if prompt.call is not None:
            if sampling.guided is not None:
                raise ValueError("sampling.guided and a forced tool call both constrain the output: send one")
            sampling = dataclasses.replace(sampling, guided=prompt.call)
        # A checkpoint's template writes its own BOS; the built-in one relies on the tokenizer's.
        ids = tokenizer.encode(prompt.text, add_special_tokens=template is None).ids
        (out,) = self.generate([list(ids)], sampling, timeout_s=timeout_s)
        text, _ = Detokenizer(tokenizer, keep=marker_tokens(tokenizer, template)).push(out.token_ids, final=True)
        made = prompt.reply(text, out.finish_reason)
        calls = () if made is None else tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                                             for c in made[1])  # fmt: skip
        return dataclasses.replace(out, text=text, tool_calls=calls)

    def shutdown(self) -> None:
        self.controller.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _collect(
    stream: RequestStream, timeout_s: float, asked: bool
) -> tuple[list[int], tuple[TokenLogprobs, ...] | None, TokenChunk]:
    """Every token id, every token's logprobs (None unless the request `asked`) and the final chunk."""
    ids: list[int] = []
    logprobs: list[TokenLogprobs] = []
    while (chunk := stream.next_chunk(timeout_s)) is not None:
        ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs or ())
        if chunk.finish_reason is not None:
            return ids, (tuple(logprobs) if asked else None), chunk
    raise RuntimeError("stream ended without a final chunk")
