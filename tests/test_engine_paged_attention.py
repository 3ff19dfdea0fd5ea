"""`models.paged_attention.paged_decode_attention`: the XLA forms and Pallas (interpret mode on CPU) against numpy.

impl="xla_tokens" attends token-major only from `TOKEN_MIN_BATCH` rows on; these cases have 2-3 rows,
so the module lowers the threshold to 1 to check the token-major form itself (and one test checks
the fallback below the threshold).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import paged_attention
from models.attention import init_paged_cache
from models.paged_attention import BlockLayout, Impl, paged_decode_attention


@pytest.fixture(autouse=True)
def _token_major_at_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention, "TOKEN_MIN_BATCH", 1)


def _numpy_reference(
    q: np.ndarray,
    kp: np.ndarray,
    vp: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    scale: float,
    new_kv: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    b, h, d = q.shape
    bs = kp.shape[1]
    out = np.zeros((b, h, d), np.float64)
    for r in range(b):
        pos = np.arange(lengths[r])
        k = kp[tables[r, pos // bs], pos % bs].astype(np.float64)  # [S, H, D]
        v = vp[tables[r, pos // bs], pos % bs].astype(np.float64)
        if new_kv is not None:  # one more position after the pages
            k = np.concatenate([k, new_kv[0][r][None]])
            v = np.concatenate([v, new_kv[1][r][None]])
        s = np.einsum("hd,shd->hs", q[r], k) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[r] = np.einsum("hs,shd->hd", p, v)
    return out


@pytest.fixture(scope="module")
def case() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    num_blocks, bs, h, d, b = 20, 4, 2, 16, 3
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    kp = rng.standard_normal((num_blocks, bs, h, d)).astype(np.float32)
    vp = rng.standard_normal((num_blocks, bs, h, d)).astype(np.float32)
    tables = np.array([[3, 7, 1, 0], [12, 5, 0, 0], [19, 18, 17, 16]], np.int32)  # shuffled, some padding
    lengths = np.array([9, 5, 16], np.int32)  # row 1 stops inside its second block
    return q, kp, vp, tables, lengths


@pytest.mark.parametrize("impl", ["xla", "xla_tokens", "xla_gather", "pallas_gpu"])
def test_paged_decode_attention_matches_numpy(impl: str, case: tuple[np.ndarray, ...]) -> None:
    q, kp, vp, tables, lengths = case
    scale = 16**-0.5
    got = paged_decode_attention(
        jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables), jnp.asarray(lengths),
        scale=scale, impl=impl, interpret=True,  # type: ignore[arg-type]
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), _numpy_reference(q, kp, vp, tables, lengths, scale), atol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "xla_tokens"])
@pytest.mark.parametrize("chunk_blocks", [1, 2, 3, 4])
def test_chunked_xla_over_filled_chunks_only(impl: str, chunk_blocks: int, case: tuple[np.ndarray, ...]) -> None:
    """The loop over chunks of table columns: rows ending in different chunks, a width that is not a
    multiple of the chunk, and table columns past the longest row holding NaN pages that must never be read."""
    q, kp, vp, tables, lengths = case
    poisoned = np.concatenate([kp, np.full((1, *kp.shape[1:]), np.nan, np.float32)])  # block 20: NaN
    # 11 columns (not a multiple of 2, 3, 4): 4 used, 3 padding on block 0, then 4 on the NaN block that
    # no chunk reaching the longest row's last block (16 positions = 4 columns) touches
    tables = np.concatenate([tables, np.zeros((3, 3), np.int32), np.full((3, 4), 20, np.int32)], axis=1)
    scale = 16**-0.5
    got = paged_decode_attention(
        jnp.asarray(q), jnp.asarray(poisoned), jnp.asarray(np.concatenate([vp, poisoned[-1:]])),
        jnp.asarray(tables), jnp.asarray(lengths), scale=scale, impl=impl, chunk_blocks=chunk_blocks,  # type: ignore[arg-type]
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), _numpy_reference(q, kp, vp, tables, lengths, scale), atol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "xla_tokens", "xla_gather"])
def test_new_position_and_layer_axis(impl: Impl, case: tuple[np.ndarray, ...]) -> None:
    """`new_kv` is one more position per row in the same softmax (a row with no cached position attends
    to it alone); `layer` picks a layer of a [L, N, bs, H, D] pool."""
    q, kp, vp, tables, lengths = case
    rng = np.random.default_rng(2)
    k_new, v_new = (rng.standard_normal(q.shape).astype(np.float32) for _ in range(2))
    lengths = np.array([9, 0, 13], np.int32)
    pool_k = np.stack([np.zeros_like(kp), kp])  # layer 1 holds the pages
    pool_v = np.stack([np.zeros_like(vp), vp])
    scale = 16**-0.5
    got = paged_decode_attention(
        jnp.asarray(q), jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(tables), jnp.asarray(lengths),
        scale=scale, impl=impl, layer=1, new_kv=(jnp.asarray(k_new), jnp.asarray(v_new)), chunk_blocks=1,
    )  # fmt: skip
    want = _numpy_reference(q, kp, vp, tables, lengths, scale, (k_new, v_new))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got)[1], v_new[1], atol=1e-6)  # nothing cached: the new value itself


@pytest.mark.parametrize("impl", ["xla", "xla_heads_flat", "cpu_kernel"])
@pytest.mark.parametrize("chunk_blocks", [0, 1, 3])
def test_head_major_blocks(impl: Impl, chunk_blocks: int, case: tuple[np.ndarray, ...]) -> None:
    """block_layout="heads": a [L, N, H, bs, D] pool (each block head-major), with new_kv and a layer axis."""
    q, kp, vp, tables, lengths = case
    rng = np.random.default_rng(3)
    k_new, v_new = (rng.standard_normal(q.shape).astype(np.float32) for _ in range(2))
    short = np.array([9, 0, 13], np.int32)  # row 1 attends to its new position alone
    pool_k = np.stack([np.zeros_like(kp), kp]).transpose(0, 1, 3, 2, 4)  # [2, N, H, bs, D], layer 1 holds the pages
    pool_v = np.stack([np.zeros_like(vp), vp]).transpose(0, 1, 3, 2, 4)
    scale = 16**-0.5
    got = paged_decode_attention(
        jnp.asarray(q), jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(tables), jnp.asarray(short),
        scale=scale, layer=1, new_kv=(jnp.asarray(k_new), jnp.asarray(v_new)), chunk_blocks=chunk_blocks,
        block_layout="heads", impl=impl,
    )  # fmt: skip
    want = _numpy_reference(q, kp, vp, tables, short, scale, (k_new, v_new))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    got = paged_decode_attention(  # no layer axis, no new position
        jnp.asarray(q), jnp.asarray(pool_k[1]), jnp.asarray(pool_v[1]), jnp.asarray(tables), jnp.asarray(lengths),
        scale=scale, chunk_blocks=chunk_blocks, block_layout="heads", impl=impl,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), _numpy_reference(q, kp, vp, tables, lengths, scale), atol=2e-5)
    got = paged_decode_attention(  # the one-gather form reads head-major blocks too
        jnp.asarray(q), jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(tables), jnp.asarray(short),
        scale=scale, layer=1, new_kv=(jnp.asarray(k_new), jnp.asarray(v_new)), impl="xla_gather",
        block_layout="heads",
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    with pytest.raises(ValueError, match="block_layout"):
        paged_decode_attention(jnp.asarray(q), jnp.asarray(pool_k[1]), jnp.asarray(pool_v[1]), jnp.asarray(tables),
                               jnp.asarray(lengths), scale=scale, impl="xla_tokens", block_layout="heads")  # fmt: skip
    # on token-major blocks the flat impl (the CPU default) runs impl="xla"'s form: a "tokens" pool still serves
    got = paged_decode_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables),
                                 jnp.asarray(lengths), scale=scale, impl="xla_heads_flat")  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), _numpy_reference(q, kp, vp, tables, lengths, scale), atol=2e-5)


def test_tokens_below_the_batch_threshold_is_the_head_major_form(
    case: tuple[np.ndarray, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    q, kp, vp, tables, lengths = case
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables), jnp.asarray(lengths))
    token_major = paged_decode_attention(*args, scale=0.25, impl="xla_tokens", chunk_blocks=1)
    monkeypatch.setattr(paged_attention, "TOKEN_MIN_BATCH", q.shape[0] + 1)
    below = paged_decode_attention(*args, scale=0.25, impl="xla_tokens", chunk_blocks=1)
    np.testing.assert_array_equal(
        np.asarray(below), np.asarray(paged_decode_attention(*args, scale=0.25, chunk_blocks=1))
    )
    np.testing.assert_allclose(np.asarray(token_major), np.asarray(below), atol=2e-5)


def test_unknown_impl_is_an_error(case: tuple[np.ndarray, ...]) -> None:
    q, kp, vp, tables, lengths = case
    with pytest.raises(ValueError, match="unknown"):
        paged_decode_attention(q, kp, vp, tables, lengths, scale=1.0, impl="cuda")  # type: ignore[arg-type]


@pytest.mark.slow  # ~20 s: the Pallas kernel in interpret mode; the default run stays well under 15 minutes
def test_extend_paged_decode_with_the_pallas_kernel_equals_xla() -> None:
    """A decode step of opt-tiny through the kernel (interpreted on CPU) gives XLA's logits and pool."""
    import jax

    from models import steps
    from models.config import get_config
    from models.params import init_params

    cfg = get_config("opt-tiny")
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    b, bs, m = 2, 4, 4
    tables = jnp.asarray([[5, 2, 7, 0], [1, 3, 4, 6]], jnp.int32)
    prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, 9)), jnp.int32)
    lengths = jnp.asarray([9, 6], jnp.int32)
    results = {}
    cases: list[tuple[Impl, BlockLayout]] = [
        ("xla", "tokens"), ("xla_tokens", "tokens"), ("xla_gather", "tokens"), ("pallas_gpu", "tokens"),
        ("xla", "heads"), ("xla_gather", "heads"), ("pallas_gpu", "heads"), ("xla_heads_flat", "heads"),
        ("cpu_kernel", "heads"),
    ]  # fmt: skip
    for impl, layout in cases:
        pool = init_paged_cache(cfg, 8, bs, block_layout=layout)
        _, pool = steps.extend_paged(params, cfg, prompt, jnp.zeros(b, jnp.int32), lengths, pool, tables)
        tok = jnp.asarray([[11], [12]], jnp.int32)
        logits, pool = steps.extend_paged(
            params, cfg, tok, lengths, jnp.ones(b, jnp.int32), pool, tables, attention=impl
        )
        k = np.asarray(pool.k)
        results[impl if layout == "tokens" else f"{impl}:heads"] = (
            np.asarray(logits),
            k.swapaxes(2, 3) if layout == "heads" else k,  # compared token-major
        )
    for impl in ("xla", "xla_gather", "pallas_gpu", "xla_heads_flat", "cpu_kernel"):  # head-major: same logits, K
        np.testing.assert_allclose(results[f"{impl}:heads"][0], results["xla"][0], atol=1e-4)
        np.testing.assert_allclose(results[f"{impl}:heads"][1], results["xla"][1], atol=1e-5)
    np.testing.assert_allclose(results["pallas_gpu"][0], results["xla"][0], atol=1e-4)
    np.testing.assert_allclose(results["pallas_gpu"][1], results["xla"][1], atol=1e-5)  # layer 1 sees layer 0 rounding
    np.testing.assert_allclose(results["xla_gather"][0], results["xla"][0], atol=1e-4)
    np.testing.assert_allclose(results["xla_gather"][1], results["xla"][1], atol=1e-5)
    np.testing.assert_allclose(results["xla_tokens"][0], results["xla"][0], atol=1e-4)
    np.testing.assert_allclose(results["xla_tokens"][1], results["xla"][1], atol=1e-5)
    assert m == tables.shape[1]


# (query heads, K/V heads): MHA, GQA 3:1, GQA 4:1, MQA
HEAD_CONFIGS = [(4, 4), (6, 2), (8, 2), (4, 1)]
IMPL_LAYOUTS: list[tuple[Impl, BlockLayout]] = [
    ("xla", "tokens"), ("xla", "heads"), ("xla_tokens", "tokens"), ("xla_gather", "tokens"), ("xla_gather", "heads"),
    ("pallas_gpu", "tokens"), ("pallas_gpu", "heads"), ("xla_heads_flat", "heads"), ("cpu_kernel", "heads"),
]  # fmt: skip


def _qkv_layer(heads: int, kv_heads: int, d: int) -> Any:
    """A decoder layer with no weights: each token's input is its q | k | v; the output replaces q by attention."""

    def layer(lp: object, h: jax.Array, i: object, attend: Any, cache: object) -> tuple[jax.Array, Any, Any]:
        b, t, _ = h.shape
        q = h[..., : heads * d].reshape(b, t, heads, d)
        k = h[..., heads * d : (heads + kv_heads) * d].reshape(b, t, kv_heads, d)
        v = h[..., (heads + kv_heads) * d :].reshape(b, t, kv_heads, d)
        o, cache = attend(i, q, k, v, cache)
        return jnp.concatenate([o.reshape(b, t, heads * d), h[..., heads * d :]], -1), cache, (k, v)

    return layer


@pytest.mark.parametrize(("heads", "kv_heads"), HEAD_CONFIGS)
@pytest.mark.parametrize(("impl", "layout"), IMPL_LAYOUTS)
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_paged_step_over_grouped_heads_matches_numpy(
    impl: Impl, layout: BlockLayout, heads: int, kv_heads: int, num_tokens: int
) -> None:
    """`attention.layers_paged`, the step every family runs: write `lengths[b]` new tokens' K/V into a pool that
    already holds each row's first `start[b]` positions (shuffled tables), attend over pages and new tokens.
    num_tokens=1 is a decode step through `impl`; 3 a multi-token step (a chunked prefill, which gathers the
    table whatever `impl` names). A row appending nothing (length 0) is padding and is not compared."""
    from models import attention

    rng = np.random.default_rng(11)
    b, bs, m, d = 3, 4, 4, 16
    n = b * m + 2
    pool_k = rng.standard_normal((1, n, bs, kv_heads, d)).astype(np.float32)  # [L, N, bs, KVH, D] token-major
    pool_v = rng.standard_normal(pool_k.shape).astype(np.float32)
    tables = rng.permutation(n)[: b * m].reshape(b, m).astype(np.int32)
    start = np.array([9, 0, 5], np.int32)
    lengths = np.array([num_tokens, min(num_tokens, 2), 0], np.int32)
    x = rng.standard_normal((b, num_tokens, (heads + 2 * kv_heads) * d)).astype(np.float32)  # q | k | v per token
    scale = d**-0.5

    layer = _qkv_layer(heads, kv_heads, d)

    def stored(a: np.ndarray) -> jax.Array:
        return jnp.asarray(a if layout == "tokens" else np.swapaxes(a, 2, 3))

    cache = attention.PagedKVCache(k=stored(pool_k), v=stored(pool_v), block_layout=layout)
    out, cache = attention.layers_paged(
        [{}], layer, jnp.asarray(x), jnp.asarray(start), jnp.asarray(lengths), cache, jnp.asarray(tables), scale,
        attention_impl=impl,
    )  # fmt: skip
    got = np.asarray(out)[..., : heads * d].reshape(b, num_tokens, heads, d)
    new_k = x[..., heads * d : (heads + kv_heads) * d].reshape(b, num_tokens, kv_heads, d)
    new_v = x[..., (heads + kv_heads) * d :].reshape(b, num_tokens, kv_heads, d)
    pool_after = np.asarray(cache.k) if layout == "tokens" else np.swapaxes(np.asarray(cache.k), 2, 3)
    g = heads // kv_heads
    for r in range(b):
        pos = np.arange(start[r])
        old_k, old_v = pool_k[0, tables[r, pos // bs], pos % bs], pool_v[0, tables[r, pos // bs], pos % bs]
        for i in range(lengths[r]):
            keys = np.repeat(np.concatenate([old_k, new_k[r, : i + 1]]), g, axis=1).astype(np.float64)  # [S, H, D]
            vals = np.repeat(np.concatenate([old_v, new_v[r, : i + 1]]), g, axis=1).astype(np.float64)
            s = np.einsum("hd,shd->hs", x[r, i, : heads * d].reshape(heads, d), keys) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            want = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), vals)
            np.testing.assert_allclose(got[r, i], want, atol=2e-5, err_msg=f"row {r} token {i}")
            p_i = start[r] + i
            np.testing.assert_array_equal(pool_after[0, tables[r, p_i // bs], p_i % bs], new_k[r, i])  # written


@pytest.mark.parametrize("impl", ["cpu_kernel", "xla_heads_flat", "pallas_gpu"])
def test_a_decode_row_appending_nothing_reads_no_pages(impl: Impl) -> None:
    """A row with length 0 (a padding row, or a row stopped inside the engine's multi-step loop, whose position
    runs on past its table) reads nothing: the kernel's checked build (the suite's) would refuse its position as
    a length past the table. The other rows are unaffected."""
    from models import attention

    rng = np.random.default_rng(12)
    b, bs, m, h, kvh, d = 2, 4, 2, 4, 2, 16
    pool = rng.standard_normal((1, 2 * m + 1, kvh, bs, d)).astype(np.float32)  # head-major blocks
    tables = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    x = jnp.asarray(rng.standard_normal((b, 1, (h + 2 * kvh) * d)).astype(np.float32))
    outs = {}
    for name in (impl, "xla"):
        cache = attention.PagedKVCache(k=jnp.asarray(pool), v=jnp.asarray(-pool), block_layout="heads")
        out, _ = attention.layers_paged(
            [{}], _qkv_layer(h, kvh, d), x, jnp.asarray([5, m * bs + 3]), jnp.asarray([1, 0]), cache, tables, 0.25,
            attention_impl=name,  # type: ignore[arg-type]
        )  # fmt: skip
        outs[name] = np.asarray(out)
    np.testing.assert_allclose(outs[impl][0], outs["xla"][0], atol=2e-5)
