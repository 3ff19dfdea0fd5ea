"""Incremental detokenization: the streamed pieces concatenate to the full decode, cut at stop strings."""

from __future__ import annotations

import numpy as np
import pytest
from serving_helpers import tiny_tokenizer

from jaxserve.serving.frontend import Detokenizer


def _stream(tok, ids, chunk_sizes, stop=()):
    detok = Detokenizer(tok, tuple(stop))
    pieces, stopped, i = [], False, 0
    for n in chunk_sizes:
        chunk = ids[i : i + n]
        i += n
        text, stopped = detok.push(chunk, final=i >= len(ids))
        pieces.append(text)
        if stopped:
            break
    return pieces, stopped


@pytest.mark.parametrize("seed", range(20))
def test_pieces_concatenate_to_the_full_decode(seed):
    tok = tiny_tokenizer()
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, 512, size=int(rng.integers(1, 80)))]  # includes split multi-byte chars
    sizes = [int(n) for n in rng.integers(1, 4, size=len(ids))]
    pieces, stopped = _stream(tok, ids, sizes)
    assert not stopped
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_multibyte_characters_are_never_split():
    tok = tiny_tokenizer()
    ids = tok.encode("naïve café → ünïcödé ✓", add_special_tokens=False).ids
    pieces, _ = _stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == "naïve café → ünïcödé ✓"
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("seed", range(10))
def test_stop_strings_cut_exactly_before_the_first_match(seed):
    tok = tiny_tokenizer()
    text = "def f(x):\n    return x + 1\n\ndef g(y):\n    return f(y) * 2\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    rng = np.random.default_rng(seed)
    start = int(rng.integers(5, len(text) - 4))
    stop = text[start : start + int(rng.integers(1, 4))]
    sizes = [int(n) for n in rng.integers(1, 3, size=len(ids))]
    pieces, stopped = _stream(tok, ids, sizes, stop=[stop, "@@never@@"])
    assert stopped
    assert "".join(pieces) == text[: text.index(stop)]


def test_without_a_tokenizer_there_is_no_text():
    assert Detokenizer(None).push([5, 6], final=True) == ("", False)
