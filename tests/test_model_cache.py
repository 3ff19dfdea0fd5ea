"""Cached decoding equals one full forward pass (contiguous, paged with a shuffled block table, chunked)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import opt, steps
from models.attention import DecodeCache, KVCache, PagedKVCache, init_paged_cache, insert_into_pages
from models.config import OPTConfig, get_config
from models.paged_attention import BlockLayout
from models.params import init_params

N, M = 9, 7  # prompt tokens, then decoded one by one
B = 3
BLOCK = 4


@pytest.fixture(scope="module", params=["opt-tiny", "opt-tiny-postln"])
def setup(request: pytest.FixtureRequest) -> tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray]:
    cfg = get_config(request.param)
    params = init_params(cfg, jax.random.key(1))
    tokens = np.random.default_rng(2).integers(3, cfg.vocab_size, (B, N + M)).astype(np.int32)
    full, _ = steps.prefill(params, cfg, tokens, np.full(B, N + M, np.int32), all_logits=True)
    return cfg, params, tokens, np.asarray(full)


def _shuffled_tables(num_blocks: int, per_seq: int, seed: int = 0) -> np.ndarray:
    perm = np.random.default_rng(seed).permutation(num_blocks)
    return perm[: B * per_seq].reshape(B, per_seq).astype(np.int32)


def _decode_cache(kv: KVCache, extra: int, layout: str) -> KVCache | DecodeCache:
    """The prefill's cache grown by `extra` positions, stacked (`KVCache`) or per-layer head-major (`DecodeCache`)."""
    if layout == "head_major":
        return DecodeCache.from_kv(kv, kv.k.shape[2] + extra)
    pad = ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0))
    return KVCache(k=jnp.pad(kv.k, pad), v=jnp.pad(kv.v, pad))


@pytest.mark.parametrize("layout", ["stacked", "head_major"])
def test_prefill_then_decode_equals_full_forward(
    setup: tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray], layout: str
) -> None:
    cfg, params, tokens, full = setup
    logits, kv = steps.prefill(params, cfg, tokens[:, :N], np.full(B, N, np.int32))
    np.testing.assert_allclose(np.asarray(logits), full[:, N - 1], atol=1e-5)
    cache = _decode_cache(kv, M, layout)
    for j in range(M):
        pos = np.full(B, N + j, np.int32)
        logits, cache = steps.decode(params, cfg, tokens[:, N + j], pos, cache)
        np.testing.assert_allclose(np.asarray(logits), full[:, N + j], atol=1e-5)


@pytest.mark.parametrize("layout", ["stacked", "head_major"])
def test_decode_rows_at_different_positions(
    setup: tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray], layout: str
) -> None:
    """Right-padded prompts of different lengths, then each row decodes at its own position."""
    cfg, params, tokens, full = setup
    lengths = np.array([4, 9, 6], np.int32)
    _, kv = steps.prefill(params, cfg, tokens[:, :N], lengths)
    cache = _decode_cache(kv, M, layout)
    pos = lengths.copy()
    for _ in range(3):
        logits, cache = steps.decode(params, cfg, tokens[np.arange(B), pos], pos, cache)
        # row b continues its own sequence: the uncached forward of tokens[b, :pos+1] is the reference
        np.testing.assert_allclose(np.asarray(logits), full[np.arange(B), pos], atol=1e-5)
        pos = pos + 1


def _decode_rest_and_check(
    params: opt.Params,
    cfg: OPTConfig,
    tokens: np.ndarray,
    full: np.ndarray,
    cache: PagedKVCache,
    tables: np.ndarray,
    block_layout: BlockLayout,
) -> None:
    """Paged decode of tokens N..N+M-1, one at a time; each step's logits equal the full forward's."""
    for j in range(M):
        start = np.full(B, N + j, np.int32)
        logits, cache = steps.extend_paged(
            params,
            cfg,
            tokens[:, N + j : N + j + 1],
            start,
            np.ones(B, np.int32),
            cache,
            tables,
            block_layout=block_layout,
        )
        np.testing.assert_allclose(np.asarray(logits), full[:, N + j], atol=1e-5)


@pytest.mark.parametrize("block_layout", ["tokens", "heads"])  # heads: pool blocks [H, bs, D] (issue 13 experiment)
def test_paged_decode_with_shuffled_blocks(
    setup: tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray], block_layout: BlockLayout
) -> None:
    cfg, params, tokens, full = setup
    per_seq = (N + M + BLOCK - 1) // BLOCK
    tables = _shuffled_tables(4 * per_seq, per_seq)
    cache = init_paged_cache(cfg, 4 * per_seq, BLOCK, block_layout=block_layout)
    # prefill into pages with the paged path, then decode token by token
    logits, cache = steps.extend_paged(
        params,
        cfg,
        tokens[:, :N],
        np.zeros(B, np.int32),
        np.full(B, N, np.int32),
        cache,
        tables,
        block_layout=block_layout,
    )
    np.testing.assert_allclose(np.asarray(logits), full[:, N - 1], atol=1e-5)
    _decode_rest_and_check(params, cfg, tokens, full, cache, tables, block_layout)


@pytest.mark.parametrize("block_layout", ["tokens", "heads"])  # heads: pool blocks [H, bs, D] (issue 13 experiment)
def test_insert_contiguous_kv_into_pages(
    setup: tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray], block_layout: BlockLayout
) -> None:
    """The decode side's insert: a prefill KVCache copied into pages, then paged decode continues it."""
    cfg, params, tokens, full = setup
    per_seq = (N + M + BLOCK - 1) // BLOCK
    tables = _shuffled_tables(3 * per_seq, per_seq, seed=5)
    _, kv = steps.prefill(params, cfg, tokens[:, :N], np.full(B, N, np.int32))
    cache = insert_into_pages(
        init_paged_cache(cfg, 3 * per_seq, BLOCK, block_layout=block_layout),
        kv,
        tables,
        np.full(B, N, np.int32),
        block_layout=block_layout,
    )
    _decode_rest_and_check(params, cfg, tokens, full, cache, tables, block_layout)


@pytest.mark.parametrize("block_layout", ["tokens", "heads"])  # heads: pool blocks [H, bs, D] (issue 13 experiment)
def test_chunked_prefill_into_pages(
    setup: tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray], block_layout: BlockLayout
) -> None:
    """Chunks of different sizes per row (and an idle row) reproduce the full forward's logits."""
    cfg, params, tokens, full = setup
    per_seq = (N + M + BLOCK - 1) // BLOCK
    tables = _shuffled_tables(3 * per_seq, per_seq, seed=9)
    cache = init_paged_cache(cfg, 3 * per_seq, BLOCK, block_layout=block_layout)
    width = 6
    chunk_plan = [[6, 2, 5], [5, 0, 6], [5, 6, 5], [0, 6, 0], [0, 2, 0]]  # per step, tokens per row
    done = np.zeros(B, np.int32)
    for lens in chunk_plan:
        lens_a = np.array(lens, np.int32)
        chunk = np.zeros((B, width), np.int32)
        for b in range(B):
            chunk[b, : lens[b]] = tokens[b, done[b] : done[b] + lens[b]]
        logits, cache = steps.extend_paged(
            params, cfg, chunk, done, lens_a, cache, tables, all_logits=True, block_layout=block_layout
        )
        logits = np.asarray(logits)
        for b in range(B):
            if lens[b]:
                np.testing.assert_allclose(logits[b, : lens[b]], full[b, done[b] : done[b] + lens[b]], atol=1e-5)
        done = done + lens_a
    assert done.tolist() == [N + M] * B


def test_padding_rows_write_nothing(setup: tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray]) -> None:
    cfg, params, tokens, _ = setup
    tables = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    cache = init_paged_cache(cfg, 6, BLOCK)
    lengths = np.array([3, 0, 2], np.int32)
    _, cache = steps.extend_paged(params, cfg, tokens[:, :4], np.zeros(B, np.int32), lengths, cache, tables)
    k = np.asarray(cache.k)
    written = np.abs(k).sum(axis=(0, 3, 4)) > 0  # [num_blocks, block_size]
    expected = np.zeros_like(written)
    expected[0, :3] = True  # row 0: 3 tokens in block 0
    expected[4, :2] = True  # row 2: 2 tokens in block 4; row 1 (length 0) nothing
    np.testing.assert_array_equal(written, expected)


def test_bfloat16_close_to_float32(setup: tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray]) -> None:
    cfg, params, tokens, full = setup
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    logits, kv = steps.prefill(p16, cfg, tokens, np.full(B, N + M, np.int32), all_logits=True)
    assert kv.k.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    err = np.abs(np.asarray(logits) - full).max()
    assert err < 0.05 * np.abs(full).max(), err
    # bf16 paged decode runs too and agrees with f32 on the argmax of most rows
    cache = init_paged_cache(cfg, 8, BLOCK, jnp.bfloat16)
    tables = np.arange(6, dtype=np.int32).reshape(3, 2)
    lg, cache = steps.extend_paged(
        p16, cfg, tokens[:, :5], np.zeros(B, np.int32), np.full(B, 5, np.int32), cache, tables
    )
    assert cache.k.dtype == jnp.bfloat16
    assert np.abs(np.asarray(lg) - full[:, 4]).max() < 0.05 * np.abs(full).max()
