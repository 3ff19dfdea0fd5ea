"""Guided decoding: grammars compiled from a request's `GuidedSpec`, each row's token mask, applied on the device.

The library is xgrammar (chosen by `scripts/bench_guided.py`: on this machine its mask costs ~4x less host time
per token than llguidance's, and both write the same packed int32 bitmask; docs/serving.md has the numbers).

* `GrammarCache` compiles a spec once (keyed by the spec) within bounds: the schema's size (`MAX_SCHEMA_BYTES`,
  checked on the request), the keywords it may use (a keyword the library would silently ignore is refused by
  name), and the compile's wall time (a compile still running at `compile_timeout_s` is a 400; it finishes on its
  daemon thread, and the same spec is refused at once afterwards). `InvalidRequestError` for each.
* `GuidedDecoder.bitmask(rows)` is the host half of a step: one packed bitmask row per batch row, all ones for
  an unconstrained row. A request's matcher is never sent anywhere: it is *replayed*. Each engine call names, per
  row, the tokens it appends and the index of the output token it samples (`sample_index`); the decoder keeps
  every token it has seen of a guided request, and its output so far is the last `sample_index` of them. So the
  same code serves a first token on a prefill instance, the next ones on a decode instance (which sees the first
  token as its first row's input), and a request resumed on a colocated instance (prompt + streamed tokens but
  the last are prefilled there, then the last comes as a decode row).
* `apply_bitmask` is the device half: one `device_put` of [B, ceil(V / 32)] int32 words, unpacked by `jax.jit`
  into -inf over the forbidden logits, before sampling (so logprobs are those of the masked distribution).

Constrained rows take single decode steps (`ModelEngine.decode_steps` falls back to one step per call when a
row is guided): the mask of step k+1 needs step k's token on the host.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.request import GuidedSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# JSON Schema keywords xgrammar enforces, and annotations that constrain nothing. Anything else would be
# ignored by the grammar, so the output could break the schema: refused by name instead.
_ENFORCED = frozenset(
    [
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "enum",
        "const",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minItems",
        "maxItems",
        "anyOf",
        "oneOf",
        "$ref",
        "$defs",
        "definitions",
    ]
)
_ANNOTATIONS = frozenset(
    ["title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly"]
)
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})  # values are name -> schema
_SCHEMA_LISTS = frozenset({"prefixItems", "anyOf", "oneOf"})


def check_schema_keywords(schema: Any, path: str = "#") -> None:
    """Raise `InvalidRequestError` naming the first keyword of `schema` the grammar would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"schema at {path} must be an object or a boolean", field="response_format")
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            raise InvalidRequestError(
                f"unsupported JSON Schema keyword {key!r} at {path}: its constraint could not be enforced",
                field="response_format",
            )
        if key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise InvalidRequestError(f"{path}/{key} must be an object", field="response_format")
            for name, sub in value.items():
                check_schema_keywords(sub, f"{path}/{key}/{name}")
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list):
                raise InvalidRequestError(f"{path}/{key} must be an array", field="response_format")
            for i, sub in enumerate(value):
                check_schema_keywords(sub, f"{path}/{key}/{i}")
        elif key in ("items", "additionalProperties") and not isinstance(value, bool):
            check_schema_keywords(value, f"{path}/{key}")


@dataclasses.dataclass(frozen=True)
class GuidedLimits:
    """Bounds on grammar compilation: its wall time per spec, and how many compiled grammars stay cached."""

    compile_timeout_s: float = 10.0
    max_cached_grammars: int = 256
    max_tracked_requests: int = 4096  # requests whose matchers are kept (least recently stepped dropped first)


class GrammarCache:
    """Compiled grammars by spec, compiled within `GuidedLimits` (thread-safe)."""

    def __init__(self, compiler: Any, limits: GuidedLimits) -> None:
        self._compiler = compiler
        self._limits = limits
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[GuidedSpec, Any] = collections.OrderedDict()
        self._too_slow: set[GuidedSpec] = set()

    def get(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of `spec` (xgrammar's `CompiledGrammar`); `InvalidRequestError` if it is invalid,
        uses a keyword that cannot be enforced, or does not compile within the time bound."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            if spec in self._too_slow:
                raise self._slow_error()
        spec.check()
        if spec.kind == "json_schema":
            try:
                parsed = json.loads(spec.schema or "")
            except ValueError as e:
                raise InvalidRequestError(f"the schema is not valid JSON: {e}", field="response_format") from None
            check_schema_keywords(parsed)
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                if spec.kind == "json_object":
                    # Compact JSON (no free whitespace): a small model cannot pad its output with spaces forever.
                    result["grammar"] = self._compiler.compile_json_schema(
                        '{"type": "object"}', strict_mode=False, any_whitespace=False
                    )
                else:
                    result["grammar"] = self._compiler.compile_json_schema(
                        spec.schema, strict_mode=spec.strict, any_whitespace=False
                    )
            except Exception as e:  # the library's own message says what is wrong with the schema
                result["error"] = e

        worker = threading.Thread(target=work, name="grammar-compile", daemon=True)
        worker.start()
        worker.join(self._limits.compile_timeout_s)
        if worker.is_alive():
            with self._lock:
                self._too_slow.add(spec)
            raise self._slow_error()
        if "error" in result:
            raise InvalidRequestError(f"invalid schema: {result['error']}", field="response_format")
        with self._lock:
            self._cache[spec] = result["grammar"]
            while len(self._cache) > self._limits.max_cached_grammars:
                self._cache.popitem(last=False)
        return result["grammar"]

    def _slow_error(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"the schema does not compile to a grammar within {self._limits.compile_timeout_s:g} s",
            field="response_format",
        )


@dataclasses.dataclass(frozen=True)
class GuidedRow:
    """One batch row as the mask sees it: the tokens the engine call appends, the output index it samples."""

    request_id: str
    spec: GuidedSpec | None  # None: unconstrained
    new_tokens: tuple[int, ...]
    sample_index: int


@dataclasses.dataclass
class _Track:
    """A guided request as one process has seen it: every token its engine calls appended, and its matcher,
    which has accepted the first `accepted` output tokens."""

    spec: GuidedSpec
    matcher: Any
    seen: list[int]
    accepted: int = 0


class GuidedDecoder:
    """The host half of guided decoding for one tokenizer: compiled grammars and each guided request's matcher."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], limits: GuidedLimits | None = None
    ) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgr
        self.tokenizer = tokenizer  # kept: a Ray actor builds its own decoder from it (`to_str()`)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.limits = limits or GuidedLimits()
        info = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer),
            vocab_size=vocab_size,
            stop_token_ids=list(eos_token_ids),
        )
        self.grammars = GrammarCache(xgr.GrammarCompiler(info, max_threads=1), self.limits)
        self._no_control = _packed_without_control_bytes(info.decoded_vocab, vocab_size, eos_token_ids)
        self._tracks: collections.OrderedDict[str, _Track] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def num_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def check(self, spec: GuidedSpec) -> None:
        """Compile `spec` now (cached): `InvalidRequestError` for a spec the runtime would refuse."""
        self.grammars.get(spec)

    def bitmask(self, rows: Sequence[GuidedRow]) -> np.ndarray:
        """Packed int32 bitmask [len(rows), ceil(V / 32)] of the tokens each row may sample next."""
        mask = np.full((len(rows), self.num_words), -1, np.int32)
        with self._lock:
            for i, row in enumerate(rows):
                if row.spec is None:
                    continue
                matcher = self._advance(row)
                if matcher is not None:
                    matcher.fill_next_token_bitmask(mask, i)
                    mask[i] &= self._no_control
        return mask

    def _advance(self, row: GuidedRow) -> Any:
        """The row's matcher, having accepted the row's output so far (rebuilt from the tokens seen where the
        matcher is behind, ahead, or new); None (the row goes unconstrained, logged) where this process has not
        seen enough of the request's tokens to rebuild it."""
        assert row.spec is not None
        track = self._tracks.get(row.request_id)
        if track is None or track.spec != row.spec:
            track = _Track(row.spec, self._xgr.GrammarMatcher(self.grammars.get(row.spec)), [])
            self._tracks[row.request_id] = track
        self._tracks.move_to_end(row.request_id)
        while len(self._tracks) > self.limits.max_tracked_requests:
            self._tracks.popitem(last=False)
        track.seen.extend(row.new_tokens)
        n = row.sample_index
        if n > len(track.seen):
            log.error(
                "guided request %s: %d output tokens but only %d tokens seen here; its step is unconstrained",
                row.request_id,
                n,
                len(track.seen),
            )
            return None
        output = track.seen[len(track.seen) - n :] if n else []
        if track.accepted > n:  # a step taken again: replay from the start
            track.matcher.reset()
            track.accepted = 0
        for tok in output[track.accepted :]:
            if track.matcher.is_terminated():  # it ended (its stop token); later tokens (ignore_eos) are free
                break
            if not track.matcher.accept_token(tok):
                log.error(
                    "guided request %s: token %d breaks its grammar; its step is unconstrained", row.request_id, tok
                )
                del self._tracks[row.request_id]
                return None
            track.accepted += 1
        if track.matcher.is_terminated():  # nothing more to mask (kept: a step taken again replays it)
            return None
        return track.matcher


def _packed_without_control_bytes(
    decoded_vocab: Sequence[bytes], vocab_size: int, stop_token_ids: Sequence[int]
) -> np.ndarray:
    """Packed int32 bitmask [ceil(V / 32)]: the tokens with no byte below 0x20, and the stop tokens.

    JSON forbids raw control characters in strings, but xgrammar's JSON strings let them through (a byte-level
    vocabulary has a token per control byte): `json.loads` of such an output fails. The outputs are compact
    (`any_whitespace=False`), so no JSON token ever needs one: they are masked out of every guided row."""
    bits = np.zeros(32 * ((vocab_size + 31) // 32), np.uint8)
    for t in range(min(vocab_size, len(decoded_vocab))):
        bits[t] = not any(b < 0x20 for b in decoded_vocab[t])
    bits[[t for t in stop_token_ids if 0 <= t < vocab_size]] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@jax.jit
def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """`logits` [B, V] with every token the packed `bitmask` [B, ceil(V / 32)] (int32, bit t % 32 of word
    t // 32 set = allowed) forbids set to -inf. A row of all ones (an unconstrained row) is unchanged."""
    vocab = logits.shape[-1]
    ids = jnp.arange(vocab, dtype=jnp.int32)
    words = bitmask[:, ids // 32]  # [B, V]
    allowed = ((words >> (ids % 32)) & 1) == 1
    return jnp.where(allowed, logits, -jnp.inf)


def padded_bitmask(mask: np.ndarray, rows: int) -> np.ndarray:
    """`mask` [B, W] with all-ones rows appended up to `rows` (padding rows are unconstrained)."""
    if mask.shape[0] >= rows:
        return mask
    return np.concatenate([mask, np.full((rows - mask.shape[0], mask.shape[1]), -1, np.int32)])
