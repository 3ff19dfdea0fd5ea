"""The request path both servers share: wire params in, text-bearing chunks out.

A gRPC `Generate` call and an HTTP `/v1/completions` call both become
`CompletionParams` (see `jaxserve.serving.wire`), and from there take the same road:

1. `prepare(params, arrival_at)`: tokenize a text prompt (on a worker thread, so a long
   prompt never stalls the event loop), build a `GenerateRequest` with a fresh request
   id, and let the controller check every value (prompt length, vocabulary, max_tokens,
   temperature, ...). Errors are `InvalidRequestError`s whose `field` is the name the
   client used on the wire. `arrival_at` is when the transport received the request: the
   TTFT clock starts there, before tokenization and validation (as vLLM measures it).
2. `stream(prepared)`: submit to the controller and iterate its `TokenChunk`s, turning
   token ids into text incrementally (held back while a byte-level token sequence is
   mid-character or may be the start of a stop string), ending the request early when a
   stop string appears, and recording metrics once at the end. Admission errors
   (`OverloadedError`, `ShuttingDownError`) surface on the first iteration, before any
   output. Cancelling the consuming task cancels the request in the controller, which
   frees its KV blocks.

Stop semantics are vLLM's: a stop string's text is left out of the output unless
`include_stop_str_in_output`; a stop token id's text stays in the output unless the token
is a special token (EOS and the like are never rendered). A request ended by a stop string
reports the same engine timestamps as any other (the controller's, cut at the stop).

The frontend is transport-free: the servers only map errors to status codes. It takes the
controller as a `ServingController` (jaxserve.runtime.api) and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Protocol

from jaxserve.core.errors import EngineDeadError, InvalidRequestError, OverloadedError, ShuttingDownError
from jaxserve.core.request import MAX_SEED, FinishReason, GenerateRequest, RequestTimings, TokenChunk
from jaxserve.runtime.api import ServingController
from jaxserve.serving.chat_template import JinjaChatTemplate, check_template
from jaxserve.serving.metrics import ServingMetrics
from jaxserve.serving.tool_parsers import detect_format
from jaxserve.serving.wire import Chunk, CompletionParams, ModelInfo, Timings

# Internal field names -> what the client sent (the prompt field is per request).
_PROMPT_FIELDS = {"prompt", "prompt_token_ids", "prompt_ids"}


class TextTokenizer(Protocol):
    """What the frontend needs of a `tokenizers.Tokenizer`."""

    def encode(self, text: str, /, *, add_special_tokens: bool = True) -> object: ...  # has `.ids`

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A checked request and what the frontend itself does with its output."""

    request: GenerateRequest
    arrival_at: float  # monotonic; when the transport received it
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
    """One output of a request: sample `j` of prompt `i` is choice `i * n + j`."""

    index: int
    prepared: PreparedRequest
    echo: str  # text put before the output (completions with echo=true)
    counts_prompt: bool  # the first sample of its prompt: its prompt tokens count in usage


def key_salt(api_key: str | None) -> str | None:
    """The prefix-cache salt of requests made with `api_key` (a digest: the key itself never goes into a name);
    None without a key."""
    if api_key is None:
        return None
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


def cache_salt_for(key: str | None, client: str | None) -> str | None:
    """A request's salt: the API key's and the client's own `cache_salt` (either may be None). Requests share
    cached blocks only when both agree, so two keys never share, and a client's salt never matches a bare key's."""
    if key is None and client is None:
        return None
    return f"{key or ''}|{client if client is not None else ''}"


class Frontend:
    """Shared request handling over one running `ServingController`."""

    def __init__(
        self,
        controller: ServingController,
        metrics: ServingMetrics | None = None,
        *,
        model_name: str | None = None,
        api_key: str | None = None,
    ):
        """`api_key`: the server's inference key; prefix-cache blocks are salted by it (`cache_salt_for`)."""
        self.controller = controller
        self.key_salt = key_salt(api_key)
        self.metrics = metrics if metrics is not None else ServingMetrics(stats=controller.stats)
        self.model_name = model_name or controller.model_config.name
        self.tokenizer = controller.tokenizer
        self.chat_template = controller.chat_template  # the checkpoint's (None: the built-in template)
        if self.chat_template is not None:  # a broken one stops the start, not every chat request (a 500 each)
            check_template(self.chat_template)
        self.kept_tokens = marker_tokens(self.tokenizer, self.chat_template)

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
            bos_token_id=-1 if cfg.bos_token_id is None else cfg.bos_token_id,
            eos_token_id=-1 if cfg.eos_token_id is None else cfg.eos_token_id,
            max_prompt_tokens=limits[0],
            max_tokens_limit=limits[1],
        )

    def limits(self) -> tuple[int, int]:
        """(longest prompt, largest max_tokens) the controller accepts."""
        return int(self.controller.max_prompt_tokens), int(self.controller.max_tokens_limit)

    # ---- the request path -------------------------------------------------------
    async def prepare(self, params: CompletionParams, arrival_at: float | None = None) -> PreparedRequest:
        """Tokenize (off the event loop) and check a request; raise `InvalidRequestError` naming the wire field."""
        arrival = time.monotonic() if arrival_at is None else arrival_at
        if params.prompt_token_ids is not None and params.sampling.guided is None:
            request = self.check(params, tuple(params.prompt_token_ids))
        else:
            # off the event loop: tokenizing, and compiling a guided request's grammar (bounded in time)
            ids = None if params.prompt_token_ids is None else tuple(params.prompt_token_ids)
            loop = asyncio.get_running_loop()
            request = await loop.run_in_executor(None, self.check, params, ids)
        return PreparedRequest(request, arrival, params.stop, params.include_stop_str_in_output)

    def check(self, params: CompletionParams, ids: tuple[int, ...] | None) -> GenerateRequest:
        """Tokenize a text prompt (blocking) and validate; the synchronous half of `prepare`."""
        if ids is None:
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
            if params.add_special_tokens:
                ids = tuple(self.tokenizer.encode(text).ids)
            else:  # a checkpoint's chat template wrote the special tokens itself (its BOS)
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids", field="stop")
        sampling = params.sampling
        if params.fill_max_tokens:
            room = self.controller.model_config.max_position_embeddings - len(ids)
            sampling = dataclasses.replace(sampling, max_tokens=max(1, min(self.controller.max_tokens_limit, room)))
        request = GenerateRequest(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            prompt_token_ids=ids,
            sampling=sampling,
            cache_salt=cache_salt_for(self.key_salt, params.cache_salt),
        )
        try:
            self.controller.check_fits(request)
        except InvalidRequestError as e:
            if e.field in _PROMPT_FIELDS:
                raise InvalidRequestError(str(e), field=params.prompt_field) from None
            raise
        return request

    async def prepare_choices(
        self, prompts: Sequence[CompletionParams], n: int, echo: bool, arrival_at: float
    ) -> list[Choice]:
        """Prepare every prompt once and fork it into n samples (choice `i * n + j`)."""
        choices: list[Choice] = []
        for params in prompts:
            prepared = await self.prepare(params, arrival_at)
            echo_text = ""
            if echo:
                echo_text = params.prompt_text if params.prompt_text is not None else self.decode_prompt(prepared)
            for j in range(n):
                choices.append(Choice(len(choices), self.fork(prepared, j), echo_text, j == 0))
        return choices

    def fork(self, prepared: PreparedRequest, sample: int) -> PreparedRequest:
        """Sample `sample` of n of one prompt: its own request id and, with a seed, seed + sample."""
        if sample == 0:
            return prepared
        r = prepared.request
        seed = None if r.sampling.seed is None else (r.sampling.seed + sample) % (MAX_SEED + 1)
        sampling = dataclasses.replace(r.sampling, seed=seed)
        request = GenerateRequest(f"cmpl-{uuid.uuid4().hex}", r.prompt_token_ids, sampling, r.cache_salt)
        return dataclasses.replace(prepared, request=request)

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs (special tokens included); `token_id:<id>` without a tokenizer.

        A token holding part of a multi-byte character decodes to U+FFFD, as in vLLM's per-token text.
        """
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def decode_prompt(self, prepared: PreparedRequest) -> str:
        """The prompt as text (for echo); empty without a tokenizer."""
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(prepared.request.prompt_token_ids), skip_special_tokens=True))

    async def stream(self, prepared: PreparedRequest) -> AsyncGenerator[Chunk, None]:
        """Run the request; yield chunks with new token ids and new text; the last one has timings."""
        request = prepared.request
        detok = Detokenizer(
            self.tokenizer, prepared.stop, include_stop=prepared.include_stop_str_in_output, keep=self.kept_tokens
        )
        num_out = 0
        finished = False
        gen = self.controller.submit(request).async_chunks()
        try:
            async for tc in gen:
                num_out += len(tc.token_ids)
                text, stopped = detok.push(tc.token_ids, final=tc.finished)
                if stopped and not tc.finished:
                    # A stop string ended the request here: cancel the rest in the controller and
                    # take its timestamps (the final chunk of a cancelled request carries them).
                    finished = True
                    self.controller.cancel(request.request_id)
                    engine_timings = tc.timings
                    async for rest in gen:
                        engine_timings = rest.timings or engine_timings
                    timings = _timings(engine_timings, prepared.arrival_at, num_out)
                    yield self._finish(request, tc, text, "stop", timings, num_out)
                    return
                if tc.finished:
                    finished = True
                    reason: FinishReason = "stop" if stopped else tc.finish_reason or "abort"
                    timings = _timings(tc.timings, prepared.arrival_at, num_out)
                    yield self._finish(request, tc, text, reason, timings, num_out)
                    return
                yield Chunk(
                    request.request_id, tuple(tc.token_ids), text, num_output_tokens=num_out, logprobs=tc.logprobs
                )
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
        tc: TokenChunk,
        text: str,
        reason: FinishReason,
        timings: Timings | None,
        num_out: int,
    ) -> Chunk:
        num_prompt = len(request.prompt_token_ids)
        self.metrics.observe_finished(timings, num_prompt, num_out, reason)
        return Chunk(
            request_id=request.request_id,
            token_ids=tuple(tc.token_ids),
            text=text,
            finish_reason=reason,
            timings=timings,
            num_prompt_tokens=num_prompt,
            num_output_tokens=num_out,
            num_cached_tokens=timings.cached_prompt_tokens if timings is not None else 0,
            logprobs=tc.logprobs,
        )


async def first_chunks(streams: list[AsyncGenerator[Chunk, None]]) -> list[Chunk]:
    """Every stream's first chunk (admission errors surface here, before any answer)."""
    results = await asyncio.gather(*(st.__anext__() for st in streams), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, Chunk)]


async def merge_streams(
    streams: list[AsyncGenerator[Chunk, None]], firsts: list[Chunk]
) -> AsyncIterator[tuple[int, Chunk]]:
    """(stream number, chunk) from every stream as chunks arrive; the first chunks first."""
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            if not firsts[i].finished:
                async for chunk in streams[i]:
                    queue.put_nowait((i, chunk))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    for i, first in enumerate(firsts):
        yield i, first
    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def marker_tokens(tokenizer: TextTokenizer | None, template: JinjaChatTemplate | None) -> dict[int, str]:
    """The tool-call markers of the template's format that are special tokens of the vocabulary (Mistral's
    `[TOOL_CALLS]` and `[ARGS]`, Llama 3's `<|python_tag|>`): the detokenizer writes them, so the tool parser can see them."""
    fmt = None if template is None else detect_format(template.template)
    token_to_id = getattr(tokenizer, "token_to_id", None)
    if fmt is None or token_to_id is None:
        return {}
    ids = {text: token_to_id(text) for text in fmt.texts}
    return {int(i): marker for marker, i in ids.items() if i is not None}


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


def _timings(t: RequestTimings | None, arrival_at: float, num_tokens: int) -> Timings | None:
    """The engine's timestamps of a request's first `num_tokens` tokens, measured from its arrival at the server."""
    if t is None:
        return None
    return Timings.from_request_timings(t, arrival_at=min(arrival_at, t.arrival_at), num_tokens=num_tokens)


class Detokenizer:
    """Incremental detokenization with stop strings, in time linear in the output length.

    Decodes only a small window of tokens per step (vLLM's prefix/read offsets): the
    tokens since the last settled point, with the previous step's tokens as context so
    tokenizers that treat a leading space specially still decode right. Text whose
    window ends in U+FFFD (a multi-byte character split across tokens) waits for the
    next tokens; text that could be the start of a stop string is held back from the
    client until the next tokens decide it. The emitted pieces concatenate to the
    whole output's decode, cut before the first stop string (after it with `include_stop`).
    Special tokens (EOS and the like) are never rendered, except those in `keep` (id -> text: a tool-call
    format's markers).
    """

    def __init__(
        self,
        tokenizer: TextTokenizer | None,
        stop: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        keep: Mapping[int, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._keep = keep or {}
        self._stop = stop
        self._include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window (context)
        self._read_offset = 0  # tokens before this are part of `_text`
        self._text = ""  # settled text of the output so far
        self._sent = 0  # characters of `_text` already emitted

    def _decode(self, ids: Sequence[int]) -> str:
        assert self._tok is not None
        if not any(i in self._keep for i in ids):
            return str(self._tok.decode(list(ids), skip_special_tokens=True))
        parts: list[str] = []
        run: list[int] = []
        for i in ids:  # the kept tokens' texts between the decoded runs around them
            if i in self._keep:
                parts += [str(self._tok.decode(run, skip_special_tokens=True)), self._keep[i]]
                run = []
            else:
                run.append(i)
        return "".join([*parts, str(self._tok.decode(run, skip_special_tokens=True))])

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
            start = max(0, self._sent - self._hold)
            hits = [(i, len(s)) for s in self._stop if (i := text.find(s, start)) >= 0]
            if hits:
                at, length = min(hits)
                cut = at + length if self._include_stop else at
                out = text[self._sent : cut] if cut > self._sent else ""
                self._sent = max(self._sent, cut)
                return out, True
        end = len(text) if final else len(text) - self._hold
        if end <= self._sent:
            return "", False
        out = text[self._sent : end]
        self._sent = end
        return out, False
