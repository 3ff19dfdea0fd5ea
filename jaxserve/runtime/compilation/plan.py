"""The warm-up plan of a model engine: which padded shapes `ModelEngine.warmup` compiles, which of them before it
returns, and in which order the rest compile on the background thread.

Pure functions of the limits (no JAX, nothing compiled here): `model_engine.py` compiles what the plan names,
and `background.py` runs the background part. A shape is a bucket: prefill (rows, tokens), paged step
(rows, tokens, table width). With a background warm-up, only the buckets that hold all others of at most twice
the token budget compile first (`frontier`), plus a lone short prompt's and a lone stream's own bucket; work of
any other bucket runs padded up to a compiled one until its own is in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from jaxserve.core.request import MAX_STOP_TOKEN_IDS
from jaxserve.runtime.engines.contract import bucket

MIN_PROMPT_BUCKET = 16
SHORT_PROMPT_BUCKET = 128  # background warm-up: a single prompt of up to this many tokens has its own bucket at once

PrefillShape = tuple[int, int]  # (rows, tokens)


def stop_width(num_eos_ids: int) -> int:
    """Stop ids per row in a multi-step decode program: every row is padded to this one width, the most any
    admitted request can need (`MAX_STOP_TOKEN_IDS` of its own plus the model's EOS ids), so no count of stop ids
    a client sends compiles another program after ready. A row's check is one compare per padded id per step."""
    return MAX_STOP_TOKEN_IDS + num_eos_ids


StepShape = tuple[int, int, int]  # (rows, tokens, table width)


def powers_of_two(lo: int, hi: int) -> list[int]:
    """The powers of two from `bucket(lo)` to `bucket(hi)`."""
    out, n = [], bucket(lo)
    while n <= bucket(hi):
        out.append(n)
        n *= 2
    return out


def prompt_buckets(max_len: int, max_positions: int) -> list[int]:
    """The padded lengths `bucket(n, MIN_PROMPT_BUCKET, max_positions)` takes for 1 <= n <= max_len."""
    return sorted({bucket(t, MIN_PROMPT_BUCKET, max_positions) for t in powers_of_two(MIN_PROMPT_BUCKET, max_len)})


def prefill_buckets(
    max_len: int, max_positions: int, max_batch_tokens: int, max_rows: int | None
) -> list[PrefillShape]:
    """Every (rows, tokens) bucket some prefill batch can land in: the smallest batch of the bucket (rows/2 + 1
    prompts, the longest tokens/2 + 1 long, the others one token each) fits the token cap, rows up to `max_rows`
    (a prefill instance's buffer slots); a single prompt of every length bucket (a longer prompt than the cap
    runs alone)."""
    shapes: list[PrefillShape] = []
    for t_pad in prompt_buckets(max_len, max_positions):
        t_min = 1 if t_pad == MIN_PROMPT_BUCKET else t_pad // 2 + 1
        shapes += [
            (b, t_pad)
            for b in powers_of_two(1, max(1, min(max_rows or max_batch_tokens, max_batch_tokens)))
            if b == 1 or (b // 2 + 1) - 1 + t_min <= max_batch_tokens
        ]
    return shapes


def foreground_prefill(shapes: Sequence[PrefillShape], max_batch_tokens: int) -> list[PrefillShape]:
    """The prefill buckets a background warm-up compiles before returning: those holding all others of at most
    twice the token cap, and a lone short prompt's own (a lone chat turn must not pay a padded batch)."""
    single = [x for x in shapes if x[0] == 1 and x[1] <= SHORT_PROMPT_BUCKET][-1:]
    held = frontier([x for x in shapes if bucket_area(x) <= 2 * max_batch_tokens])
    return held + [x for x in single if x not in held]


def step_buckets(
    *, decode: bool, chunk_size: int | None, max_decode_batch: int, widths: Sequence[int], prompt_widths: Sequence[int]
) -> list[StepShape]:
    """Every paged step bucket: decode rows (`decode`) x table `widths`; with `chunk_size` (a step's prompt-token
    budget, which may be split over several prompts) prompt rows x `prompt_widths`."""
    shapes: list[StepShape] = []
    if decode:
        shapes += [(b, 1, m) for b in powers_of_two(2, max_decode_batch) for m in widths]
    if chunk_size:
        for t in powers_of_two(MIN_PROMPT_BUCKET, chunk_size):
            t_min = 1 if t == MIN_PROMPT_BUCKET else t // 2 + 1
            for b in powers_of_two(1, max(1, min(max_decode_batch, chunk_size))):
                if b == 1 or b // 2 + t_min <= chunk_size:
                    shapes += [(b, t, m) for m in prompt_widths]
    return shapes


def foreground_steps(shapes: Sequence[StepShape], *, chunk_size: int | None, max_decode_batch: int) -> list[StepShape]:
    """The step buckets a background warm-up compiles before returning: those holding all others of at most twice
    the budget (the chunk or the decode batch), and the smallest decode batch at full width (one stream pays no
    wide batch). A prefix-caching prefill instance's prompt-row steps too: a hit batch runs padded up to one of
    them, so a second chat turn right after ready reads its cached prefix (it was prefilled in full, caching
    nothing, while they compiled in the background)."""
    if not shapes:
        return []
    budget = 2 * max(chunk_size or 0, max_decode_batch)
    held = frontier([x for x in shapes if bucket_area(x) <= budget])
    lone = [x for x in shapes if x[1] == 1 and x[0] == min(s[0] for s in shapes)][-1:]
    return held + [x for x in lone if x not in held]


_Shape = TypeVar("_Shape", bound=tuple[int, ...])


def frontier(shapes: Sequence[_Shape]) -> list[_Shape]:
    """The shapes no other shape holds (>= in every dimension): padded up, they run everything in `shapes`."""
    unique = sorted(set(shapes))
    return [s for s in unique if not any(o != s and all(x >= y for x, y in zip(o, s, strict=True)) for o in unique)]


def bucket_area(shape: tuple[int, ...]) -> int:
    """Rows x tokens of a bucket (the work it pads to)."""
    return shape[0] * shape[1]


def compile_order(shapes: Sequence[_Shape], ready: frozenset[Any]) -> list[_Shape]:
    """`shapes` in the order the background compiles them: those no compiled bucket holds first (their work
    would otherwise compile its own), then the smallest (the most common work), the narrower table first."""
    return sorted(shapes, key=lambda x: (is_held(x, ready), bucket_area(x), x[2:]))


def is_held(shape: tuple[int, ...], ready: frozenset[Any]) -> bool:
    """Whether some compiled bucket holds `shape` (>= in every dimension)."""
    return any(all(x >= y for x, y in zip(r, shape, strict=True)) for r in ready)
