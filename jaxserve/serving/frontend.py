"""The request path both servers share: wire params in, text-bearing chunks out.

A gRPC `Generate` call and an HTTP `/v1/completions` call both become
`CompletionParams` (see `jaxserve.serving.wire`), and from there take the same road:

1. `prepare(params)`: tokenize a text prompt, build a `GenerateRequest` with a fresh
   request id, and let the controller check every value (prompt length, vocabulary,
   max_tokens, temperature, ...). Errors are `InvalidRequestError`s whose `field` is
   the name the client used on the wire.
2. `stream(request, stop)`: submit to the controller and iterate its `TokenChunk`s,
   turning token ids into text incrementally (held back while a byte-level token
   sequence is mid-character or may be the start of a stop string), ending the
   request early when a stop string appears, and recording metrics once at the end.
   Admission errors (`OverloadedError`, `ShuttingDownError`) surface on the first
   iteration, before any output. Cancelling the consuming task cancels the request
   in the controller, which frees its KV blocks.

The frontend is transport-free: the servers only map errors to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from jaxserve.errors import EngineDeadError, InvalidRequestError, OverloadedError, ShuttingDownError
from jaxserve.runtime.request import GenerateRequest, TokenChunk
from jaxserve.serving.metrics import InstanceStats, ServingMetrics
from jaxserve.serving.wire import Chunk, CompletionParams, ModelInfo, Timings

# Internal field names -> what the client sent (the prompt field is per request).
_PROMPT_FIELDS = {"prompt", "prompt_token_ids", "prompt_ids"}


class Frontend:
    """Shared request handling over one running `Controller`."""

    def __init__(self, controller: Any, metrics: ServingMetrics | None = None, *, model_name: str | None = None):
        self.controller = controller
        self.metrics = metrics if metrics is not None else ServingMetrics(stats=self)
        self.model_name = model_name or controller.model_config.name
        self.tokenizer = getattr(controller, "tokenizer", None)

    # ---- what the servers report ------------------------------------------------
    def model_info(self) -> ModelInfo:
        cfg = self.controller.model_config
        limits = self.limits()
        return ModelInfo(
            name=self.model_name,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            ffn_dim=cfg.ffn_dim,
            dtype=cfg.dtype,
            has_tokenizer=self.tokenizer is not None,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=cfg.eos_token_id,
            max_prompt_tokens=limits[0],
            max_tokens_limit=limits[1],
        )

    def limits(self) -> tuple[int, int]:
        """(longest prompt, largest max_tokens) the controller accepts."""
        return int(self.controller.max_prompt_tokens), int(self.controller.max_tokens_limit)

    def instance_stats(self) -> list[InstanceStats]:
        return [_instance_stats(s) for s in _stats_instances(self.controller.stats())]

    # ---- the request path -------------------------------------------------------
    def prepare(self, params: CompletionParams) -> GenerateRequest:
        """Tokenize and check a request; raise `InvalidRequestError` naming the wire field."""
        if params.prompt_token_ids is not None:
            ids = tuple(params.prompt_token_ids)
        else:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: send the prompt as token ids", field=params.prompt_field
                )
            text = params.prompt_text or ""
            if not text:
                raise InvalidRequestError("the prompt is empty", field=params.prompt_field)
            # A pathologically long text would make the tokenizer the bottleneck; a token is
            # at least one byte, so more bytes than 16x the position limit is certainly too long.
            if len(text) > 16 * self.controller.model_config.max_position_embeddings:
                raise InvalidRequestError(
                    f"the prompt ({len(text)} characters) is longer than the model's context", field=params.prompt_field
                )
            ids = tuple(self.tokenizer.encode(text).ids)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids", field="stop")
        request = GenerateRequest(request_id=f"cmpl-{uuid.uuid4().hex}", prompt_token_ids=ids, sampling=params.sampling)
        try:
            self.controller.validate(request)
        except InvalidRequestError as e:
            if e.field in _PROMPT_FIELDS:
                raise InvalidRequestError(str(e), field=params.prompt_field) from None
            raise
        return request

    async def stream(self, request: GenerateRequest, stop: Sequence[str] = ()) -> AsyncGenerator[Chunk, None]:
        """Run the request; yield chunks with new token ids and new text; the last one has timings."""
        detok = Detokenizer(self.tokenizer, tuple(stop))
        arrival_at = time.monotonic()
        token_times: list[float] = []
        num_out = 0
        gen = self.controller.generate(request)
        finished = False
        try:
            async for tc in gen:
                tc_: TokenChunk = tc
                now = time.monotonic()
                token_times.extend([now] * len(tc_.token_ids))
                num_out += len(tc_.token_ids)
                text, stopped = detok.push(tc_.token_ids, final=tc_.finished)
                if stopped and not tc_.finished:
                    # A stop string ended the request here: cancel the rest in the controller.
                    finished = True
                    self.controller.cancel(request.request_id)
                    timings = _frontend_timings(arrival_at, token_times)
                    yield self._finish(request, tc_.token_ids, text, "stop", timings, num_out)
                    return
                if tc_.finished:
                    finished = True
                    reason = "stop" if stopped else tc_.finish_reason
                    final = Timings.from_request_timings(tc_.timings) if tc_.timings is not None else None
                    yield self._finish(request, tc_.token_ids, text, reason, final, num_out)
                    return
                yield Chunk(request.request_id, tuple(tc_.token_ids), text, num_output_tokens=num_out)
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away (cancel, deadline, disconnect) mid-request.
            if not finished:
                self.metrics.observe_finished(None, len(request.prompt_token_ids), num_out, "abort")
            raise
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    self.controller.cancel(request.request_id)
            with contextlib.suppress(Exception):
                await gen.aclose()

    def _finish(
        self,
        request: GenerateRequest,
        token_ids: Sequence[int],
        text: str,
        reason: Any,
        timings: Timings | None,
        num_out: int,
    ) -> Chunk:
        num_prompt = len(request.prompt_token_ids)
        self.metrics.observe_finished(timings, num_prompt, num_out, reason)
        return Chunk(
            request_id=request.request_id,
            token_ids=tuple(token_ids),
            text=text,
            finish_reason=reason,
            timings=timings,
            num_prompt_tokens=num_prompt,
            num_output_tokens=num_out,
        )


def error_kind(exc: BaseException) -> str:
    """The `kind` label of `jaxserve:request_errors_total` for a runtime error."""
    if isinstance(exc, InvalidRequestError):
        return "invalid_argument"
    if isinstance(exc, OverloadedError):
        return "overloaded"
    if isinstance(exc, ShuttingDownError):
        return "shutting_down"
    if isinstance(exc, EngineDeadError):
        return "engine_dead"
    return "internal"


def _frontend_timings(arrival_at: float, token_times: list[float]) -> Timings:
    """Timings measured at the frontend, for a request the frontend itself ended (stop string)."""
    now = time.monotonic()
    n = len(token_times)
    return Timings(
        ttft_s=token_times[0] - arrival_at if token_times else None,
        tpot_s=(token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None,
        e2e_s=now - arrival_at,
        token_times_s=tuple(t - arrival_at for t in token_times),
    )


class Detokenizer:
    """Incremental detokenization with stop strings, in time linear in the output length.

    Decodes only a small window of tokens per step (vLLM's prefix/read offsets): the
    tokens since the last settled point, with the previous step's tokens as context so
    tokenizers that treat a leading space specially still decode right. Text whose
    window ends in U+FFFD (a multi-byte character split across tokens) waits for the
    next tokens; text that could be the start of a stop string is held back from the
    client until the next tokens decide it. The emitted pieces concatenate to the
    whole output's decode, cut before the first stop string.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window (context)
        self._read_offset = 0  # tokens before this are part of `_text`
        self._text = ""  # settled text of the output so far
        self._sent = 0  # characters of `_text` already emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def _settle(self, final: bool) -> None:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) > len(prefix_text) and (final or not window_text.endswith("\ufffd")):
            self._text += window_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """Add tokens; return (new text to emit, whether a stop string was found)."""
        if self._tok is None:
            return "", False
        self._ids.extend(int(t) for t in token_ids)
        self._settle(final)
        text = self._text
        if self._stop:
            hits = [i for i in (text.find(s, max(0, self._sent - self._hold)) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                out = text[self._sent : cut] if cut > self._sent else ""
                self._sent = max(self._sent, cut)
                return out, True
        end = len(text) if final else len(text) - self._hold
        if end <= self._sent:
            return "", False
        out = text[self._sent : end]
        self._sent = end
        return out, False


def _stats_instances(stats: Any) -> list[Any]:
    for attr in ("instances", "per_instance"):
        value = getattr(stats, attr, None)
        if value is not None:
            return list(value.values()) if isinstance(value, dict) else list(value)
    return list(stats)


def _instance_stats(s: Any) -> InstanceStats:
    def get(*names: str) -> int:
        for n in names:
            v = getattr(s, n, None)
            if v is not None:
                return int(v)
        return 0

    return InstanceStats(
        name=str(s.name),
        role=str(s.role),
        num_waiting=get("num_waiting", "waiting"),
        num_running=get("num_running", "running"),
        kv_blocks_used=get("kv_blocks_used", "num_kv_blocks_used"),
        kv_blocks_free=get("kv_blocks_free", "num_kv_blocks_free"),
        prefill_buffer_used=get("num_prefill_buffer_used", "prefill_buffer_used"),
        prefill_buffer_capacity=get("prefill_buffer_capacity"),
        alive=bool(getattr(s, "alive", True)),
    )
