"""Sampling: greedy, top-k, top-p, temperature, and per-request seeds independent of batch mates; the stop rule."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.request import RequestTimings, SamplingParams, finish_reason, stop_token_ids
from jaxserve.runtime.sampling import default_seed, pad_rows, sample

RNG = np.random.default_rng(0)
LOGITS = jnp.asarray(RNG.normal(size=(6, 40)).astype(np.float32))


def _draw(params: list[SamplingParams], seeds: list[int], index: int = 0, logits=LOGITS) -> list[int]:
    return [int(x) for x in np.asarray(sample(logits, params, seeds, [index] * len(params)))]


def test_greedy_is_argmax_and_padding_rows_are_greedy() -> None:
    argmax = [int(x) for x in np.argmax(np.asarray(LOGITS), axis=-1)]
    assert _draw([SamplingParams()] * 6, [0] * 6) == argmax
    # a sampled row next to padding rows: padding rows come back greedy
    hot = SamplingParams(temperature=1.0)
    assert _draw([hot], [5])[1:] == argmax[1:]


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    argmax = [int(x) for x in np.argmax(np.asarray(LOGITS), axis=-1)]
    for seed in range(5):
        assert _draw([SamplingParams(temperature=2.0, top_k=1)] * 6, [seed] * 6) == argmax
        assert _draw([SamplingParams(temperature=2.0, top_p=1e-6)] * 6, [seed] * 6) == argmax
        assert _draw([SamplingParams(temperature=1e-30)] * 6, [seed] * 6) == argmax  # a tiny temperature: the argmax


def test_seeded_sampling_is_independent_of_batch_mates() -> None:
    row = jnp.tile(LOGITS[2:3], (6, 1))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = _draw([p], [42], logits=LOGITS[2:3])[0]
    others = [SamplingParams(temperature=1.0, top_k=5)] * 5
    for pos in range(6):
        params = [*others[:pos], p, *others[pos:]]
        seeds = [*range(100, 100 + pos), 42, *range(200, 205 - pos)]
        assert _draw(params, seeds, logits=row)[pos] == alone
    # different sample indices give different draws (the stream moves on)
    draws = {int(np.asarray(sample(LOGITS[2:3], [p], [42], [i]))[0]) for i in range(20)}
    assert len(draws) > 3


def test_top_k_restricts_support_and_temperature_follows_softmax() -> None:
    logits = jnp.asarray(np.array([[3.0, 2.0, 1.0, 0.0, -1.0]] * 8, dtype=np.float32))
    counts = np.zeros(5)
    for i in range(250):
        for t in np.asarray(sample(logits, [SamplingParams(temperature=1.0)] * 8, list(range(8)), [i] * 8)):
            counts[int(t)] += 1
    expected = np.exp([3.0, 2.0, 1.0, 0.0, -1.0]) / np.sum(np.exp([3.0, 2.0, 1.0, 0.0, -1.0]))
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.03)
    k2 = {
        int(t)
        for i in range(60)
        for t in np.asarray(sample(logits, [SamplingParams(1, 1.0, top_k=2)] * 8, list(range(8)), [i] * 8))
    }
    assert k2 == {0, 1}
    # top_p 0.8: the two most likely tokens hold 0.665 + 0.245 > 0.8, so the third never shows up
    p8 = {
        int(t)
        for i in range(60)
        for t in np.asarray(sample(logits, [SamplingParams(1, 1.0, top_p=0.8)] * 8, list(range(8)), [i] * 8))
    }
    assert p8 == {0, 1}


def _nucleus(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The reference: the kept tokens' probabilities by sorting, as vLLM and transformers cut (top-k, then top-p
    of what is left, the token at which the mass reaches top_p included), renormalised; 0 for cut tokens."""
    scaled = logits / temperature
    order = np.argsort(-scaled, kind="stable")
    kept = order[:top_k] if top_k else order
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept, probs = kept[before < top_p], probs[before < top_p]
    out = np.zeros_like(scaled, dtype=np.float64)
    out[kept] = probs / probs.sum()
    return out


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 12, 1.0), (1.3, 0, 0.6), (0.9, 20, 0.8)]
)
def test_cuts_and_draws_match_a_sorting_reference_on_a_wide_vocabulary(
    temperature: float, top_k: int, top_p: float
) -> None:
    """The sampler cuts without sorting (thresholds found by bisection): over 2,000 seeds, the drawn tokens lie
    in the reference's kept set and their frequencies follow its probabilities."""
    row = np.random.default_rng(1).normal(scale=2.0, size=3000).astype(np.float32)
    expected = _nucleus(row, temperature, top_k, top_p)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * 250
    counts = np.zeros(row.shape[0])
    for i in range(8):
        tokens = np.asarray(sample(jnp.tile(jnp.asarray(row), (250, 1)), params, list(range(250)), [i] * 250))
        np.add.at(counts, tokens, 1)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(expected))
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.02)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=101), "max_tokens"),
        (SamplingParams(temperature=math.inf), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(seed=-1), "seed"),
        (SamplingParams(stop_token_ids=(5, 1000)), "stop_token_ids"),
    ],
)
def test_sampling_params_validation(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        params.check_ranges(max_tokens_limit=100, vocab_size=1000)
    assert info.value.field == field and field in str(info.value)


def test_valid_params_pass_and_timings_derive_latencies() -> None:
    SamplingParams(max_tokens=100, temperature=0.7, top_p=0.9, top_k=50, seed=2**63 - 1).check_ranges(
        max_tokens_limit=100
    )
    assert default_seed("abc") == default_seed("abc") != default_seed("abd")
    t = RequestTimings(arrival_at=10.0, first_token_at=10.5, token_times=[10.5, 10.7, 10.9], finished_at=11.0)
    assert t.ttft_s == pytest.approx(0.5) and t.tpot_s == pytest.approx(0.2) and t.e2e_s == pytest.approx(1.0)
    assert RequestTimings(arrival_at=0.0, token_times=[1.0]).tpot_s is None


EOS = 2


@pytest.mark.parametrize(
    ("sampling", "token", "num_output_tokens", "expected"),
    [
        (SamplingParams(max_tokens=4), 7, 1, None),
        (SamplingParams(max_tokens=4), 7, 4, "length"),
        (SamplingParams(max_tokens=4), EOS, 1, "stop"),
        (SamplingParams(max_tokens=4), EOS, 4, "stop"),  # a stop token on the last allowed token is a stop
        (SamplingParams(max_tokens=4, ignore_eos=True), EOS, 1, None),
        (SamplingParams(max_tokens=4, ignore_eos=True), EOS, 4, "length"),
        (SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(EOS,)), EOS, 1, "stop"),  # listed: still stops
        (SamplingParams(max_tokens=4, stop_token_ids=(9, 11)), 11, 2, "stop"),
        (SamplingParams(max_tokens=1), 5, 1, "length"),
    ],
)
def test_the_stop_rule(sampling: SamplingParams, token: int, num_output_tokens: int, expected: str | None) -> None:
    assert finish_reason(sampling, token, num_output_tokens, (EOS,)) == expected


def test_stop_token_ids_are_the_stop_list_and_eos_unless_ignored() -> None:
    assert stop_token_ids(SamplingParams(stop_token_ids=(9, 11)), (EOS,)) == (9, 11, EOS)
    assert stop_token_ids(SamplingParams(stop_token_ids=(9,), ignore_eos=True), (EOS,)) == (9,)


def test_sampling_on_padded_rows_draws_the_same_tokens() -> None:
    """An engine whose random sampler for this row count still compiles samples on logits padded up to a compiled
    one (`pad_rows`): each real row's token depends only on its seed and index, so padding changes none."""
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=7), SamplingParams(), SamplingParams(temperature=1.5)]
    logits = LOGITS[:3]
    for index in range(5):
        alone = np.asarray(sample(logits, params, [7, 1, 99], [index, 2, index + 3]))
        padded = np.asarray(sample(pad_rows(logits, 8), params, [7, 1, 99], [index, 2, index + 3]))
        assert padded.shape == (8,) and padded[:3].tolist() == alone.tolist()
        assert padded[3:].tolist() == [0] * 5  # zero logits, sampled greedily
