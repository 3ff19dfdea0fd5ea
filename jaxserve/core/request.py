"""Request-level types shared by the controller, the servers and the offline API.

Pure Python (no JAX): the gRPC/HTTP layer converts its wire messages into
`GenerateRequest` and streams `TokenChunk`s back. Times are `time.monotonic()`
seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from jaxserve.core.errors import InvalidRequestError

FinishReason = Literal["stop", "length", "abort"]

MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI chat's top_logprobs limit)
# Most stop token ids one request may name. Multi-step decode checks a row's stop ids on the device in a program
# compiled for one width (`runtime.compilation.plan.stop_width`): this bound, plus the model's EOS ids, is it.
MAX_STOP_TOKEN_IDS = 64


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability and the most likely alternatives at its position.

    Log-probabilities are the log-softmax of the model's raw logits (before temperature, top-k and
    top-p), as vLLM reports them by default: a greedy token's logprob is the top one. `top` holds the
    `SamplingParams.logprobs` most likely tokens, most likely first (it may or may not hold the token).
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


DEFAULT_MAX_TOKENS = 16  # a request that names no max_tokens (OpenAI's completions default too)
GuidedKind = Literal["json_object", "json_schema"]
MAX_SCHEMA_BYTES = 64 * 1024  # the largest JSON schema a request may constrain its output by (its JSON text)


@dataclasses.dataclass(frozen=True)
class GuidedSpec:
    """A constraint on a request's output (OpenAI's `response_format`): any JSON object (`json_object`), or JSON
    valid against `schema` (`json_schema`, the schema's JSON text; `strict`: no properties beyond the schema's).

    The runtime compiles it to a grammar (`jaxserve.runtime.guided`) and masks each sampled token by it; the
    matcher's state is never sent anywhere: whichever instance holds the request rebuilds it from the
    request's output tokens."""

    kind: GuidedKind
    schema: str | None = None
    strict: bool = False

    def check(self) -> None:
        """Raise `InvalidRequestError` (field `response_format`) for a spec that is malformed on its face (the
        schema's keywords are checked where it is compiled)."""
        if self.kind not in ("json_object", "json_schema"):
            raise InvalidRequestError(f"unknown response_format type {self.kind!r}", field="response_format")
        if self.kind == "json_object":
            if self.schema is not None:
                raise InvalidRequestError("a json_object response_format takes no schema", field="response_format")
            return
        if not isinstance(self.schema, str) or not self.schema:
            raise InvalidRequestError("a json_schema response_format needs a schema", field="response_format")
        if len(self.schema.encode()) > MAX_SCHEMA_BYTES:
            raise InvalidRequestError(
                f"the schema ({len(self.schema.encode())} bytes) exceeds the limit of {MAX_SCHEMA_BYTES} bytes",
                field="response_format",
            )


def guided_spec(kind: str, schema: object = None, *, strict: bool = False) -> GuidedSpec | None:
    """The `GuidedSpec` of a `response_format` as the fronts receive it (`kind` "text", "json_object" or
    "json_schema"; `schema` a parsed JSON Schema); None for free text. The schema is kept as its canonical JSON
    text (sorted keys, no spaces), so equal schemas share one compiled grammar."""
    import json

    if kind == "text":
        if schema is not None:
            raise InvalidRequestError("a text response_format takes no schema", field="response_format")
        return None
    if kind == "json_object":
        if schema is not None:
            raise InvalidRequestError("a json_object response_format takes no schema", field="response_format")
        return GuidedSpec("json_object")
    if kind != "json_schema":
        raise InvalidRequestError(f"unknown response_format type {kind!r}", field="response_format")
    if schema is None:
        raise InvalidRequestError("type json_schema needs json_schema.schema", field="response_format")
    return GuidedSpec("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")), strict=strict)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. `temperature == 0` means greedy.

    `seed` makes sampling deterministic per request, independent of which other
    requests share its batch; `None` draws a seed from the request id.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: each token's logprob and its k most likely alternatives
    guided: GuidedSpec | None = None  # a grammar every output token must follow (logprobs: of the masked logits)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def check_ranges(self, *, max_tokens_limit: int, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError` naming the first field that is out of its range (this object alone;
        whether a request fits a deployment is `Controller.check_fits`)."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens must be an integer", field="max_tokens")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", field="max_tokens")
        if self.max_tokens > max_tokens_limit:
            raise InvalidRequestError(
                f"max_tokens {self.max_tokens} exceeds the limit {max_tokens_limit}", field="max_tokens"
            )
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
            raise InvalidRequestError(f"temperature must be a finite number, got {t!r}", field="temperature")
        if t < 0 or t > MAX_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {t}", field="temperature")
        p = self.top_p
        if not isinstance(p, int | float) or isinstance(p, bool) or not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}", field="top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}", field="top_k")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}", field="seed")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise InvalidRequestError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}", field="logprobs"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids", field="stop_token_ids")
        if self.guided is not None:
            self.guided.check()
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise InvalidRequestError(f"stop_token_ids must be token ids >= 0, got {tok!r}", field="stop_token_ids")
            if vocab_size is not None and tok >= vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids entry {tok} is outside the vocabulary (size {vocab_size})", field="stop_token_ids"
                )


def stop_token_ids(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The token ids that end a sequence: its `stop_token_ids`, and the model's EOS ids (Llama 3 has three)
    unless `ignore_eos` (the stop rule's token half, for an engine that checks it on the device)."""
    return tuple(sampling.stop_token_ids) + (() if sampling.ignore_eos else tuple(eos_token_ids))


def finish_reason(
    sampling: SamplingParams, token: int, num_output_tokens: int, eos_token_ids: Sequence[int]
) -> FinishReason | None:
    """The stop rule, written once: why a sequence stops once `token` is its `num_output_tokens`-th output
    token. "stop": a stop token id, or one of the model's EOS ids unless `ignore_eos` (the token is kept); "length": `max_tokens`
    reached; None: it goes on."""
    if token in stop_token_ids(sampling, eos_token_ids):
        return "stop"
    if num_output_tokens >= sampling.max_tokens:
        return "length"
    return None


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One generation request: an id unique among live requests, the prompt's token ids, sampling."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    # Prefix caching: blocks are named under this salt (`prefix_cache.salt_root`), so only requests with the same
    # salt share them (vLLM's `cache_salt`). None: unsalted. The server puts the API key's salt in front of it.
    cache_salt: str | None = None


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one deployment accepts: its model's vocabulary and positions, and its serving limits."""

    vocab_size: int
    max_positions: int  # the model's positions: prompt + max_tokens must fit
    max_prompt_tokens: int
    max_tokens_limit: int
    kv_pool_tokens: int  # one decode (or colocated) instance's KV pool: prompt + max_tokens must fit
    prefill_pool_tokens: int | None = None  # a caching prefill instance's pool: the prompt must fit (None: no pool)
    logprobs: bool = True  # the engines compute logprobs


def validate_request(request: GenerateRequest, limits: RequestLimits) -> None:
    """The one check of a request before it is admitted: raise `InvalidRequestError` naming the first bad field."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequestError("request_id must be a non-empty string", field="request_id")
    prompt = request.prompt_token_ids
    if len(prompt) == 0:
        raise InvalidRequestError("the prompt is empty", field="prompt_token_ids")
    for tok in prompt:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < limits.vocab_size:
            raise InvalidRequestError(
                f"prompt token id {tok!r} is outside the vocabulary [0, {limits.vocab_size})", field="prompt_token_ids"
            )
    if len(prompt) > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"prompt has {len(prompt)} tokens, the limit is {limits.max_prompt_tokens}", field="prompt_token_ids"
        )
    request.sampling.check_ranges(max_tokens_limit=limits.max_tokens_limit, vocab_size=limits.vocab_size)
    if request.sampling.logprobs is not None and not limits.logprobs:
        raise InvalidRequestError(
            "logprobs are not available: this deployment's engines do not compute them (a fake or timed engine)",
            field="logprobs",
        )
    total = len(prompt) + request.sampling.max_tokens
    if total > limits.max_positions:
        raise InvalidRequestError(
            f"prompt ({len(prompt)}) + max_tokens ({request.sampling.max_tokens}) exceeds the model's "
            f"{limits.max_positions} positions",
            field="max_tokens",
        )
    if limits.prefill_pool_tokens is not None and len(prompt) > limits.prefill_pool_tokens:
        raise InvalidRequestError(
            f"prompt ({len(prompt)}) exceeds a prefill instance's KV pool ({limits.prefill_pool_tokens} tokens)",
            field="prompt_token_ids",
        )
    if total > limits.kv_pool_tokens:
        raise InvalidRequestError(
            f"prompt + max_tokens ({total}) exceeds one instance's KV pool ({limits.kv_pool_tokens} tokens)",
            field="max_tokens",
        )


@dataclasses.dataclass
class RequestTimings:
    """Per-request timestamps (monotonic seconds); a phase that did not happen stays None.

    Colocated instances have no transfer. `token_times` holds the time each
    output token was produced, the first token included.
    """

    arrival_at: float
    prefill_start_at: float | None = None
    prefill_end_at: float | None = None
    transfer_start_at: float | None = None
    transfer_end_at: float | None = None
    decode_start_at: float | None = None
    first_token_at: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finished_at: float | None = None
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    prefill_instance: str | None = None
    decode_instance: str | None = None
    cached_prompt_tokens: int = 0  # prompt tokens served from a prefix cache where the prompt was computed
    kv_transfer_tokens: int = 0  # positions the pull moved (the prompt minus what the decode cache held)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: first token time minus arrival."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1); None with < 2 tokens."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival_at


@dataclasses.dataclass(frozen=True)
class TokenChunk:
    """New tokens of one request (never repeated); the final chunk has `finish_reason` and `timings`.

    `logprobs`: one entry per token when the request asked (`SamplingParams.logprobs`), else None.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    timings: RequestTimings | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
