"""Grouped-query attention of the shared KV layer (`models.attention`, `models.paged_attention`) against numpy.

The reference repeats each K/V head for its group of query heads (Hugging Face's `repeat_kv`), the
thing our code avoids doing; every paged implementation name and both block layouts are covered.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models.attention import init_paged_cache
from models.paged_attention import IMPLS, BlockLayout, Impl, paged_decode_attention

B, H, KVH, D, BS, M = 3, 8, 2, 16, 4, 5


def _softmax_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q [H, D], k/v [S, KVH, D] -> [H, D], with K/V repeated per group (query head h reads K/V head h // G)."""
    g = q.shape[0] // k.shape[1]
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [S, H, D]
    s = np.einsum("hd,shd->hs", q, kr) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hs,shd->hd", p, vr)


# (query heads, K/V heads): MHA, GQA 3:1, GQA 4:1, MQA
HEAD_CONFIGS = [(4, 4), (6, 2), (8, 2), (4, 1)]


# Each impl in the layouts it reads its own way ("xla_heads_flat" and "cpu_kernel" on token-major blocks run
# "xla"'s / "xla_heads_flat"'s form, covered by those).
IMPL_LAYOUTS: list[tuple[Impl, BlockLayout]] = [
    ("xla", "tokens"), ("xla", "heads"), ("xla_tokens", "tokens"), ("xla_gather", "tokens"), ("xla_gather", "heads"),
    ("pallas_gpu", "tokens"), ("pallas_gpu", "heads"), ("xla_heads_flat", "heads"), ("cpu_kernel", "heads"),
]  # fmt: skip
assert {impl for impl, _ in IMPL_LAYOUTS} == set(IMPLS)


@pytest.mark.parametrize(("heads", "kv_heads"), HEAD_CONFIGS)
@pytest.mark.parametrize(("impl", "layout"), IMPL_LAYOUTS)
@pytest.mark.parametrize("with_new", [False, True])
def test_grouped_paged_decode_matches_repeated_reference(
    layout: BlockLayout, impl: Impl, with_new: bool, heads: int, kv_heads: int
) -> None:
    """Shuffled tables, rows ending mid-block; the chunk loops run 2 table columns a chunk (an online softmax
    over 3 chunks for the longest row); every form against the same repeat_kv reference."""
    if impl == "pallas_gpu" and with_new:
        pytest.skip("the Pallas kernel reads every position from the pages (no new_kv)")
    chunk_blocks = 2
    rng = np.random.default_rng(3)
    pages_k = rng.normal(size=(2, B * M + 1, BS, kv_heads, D)).astype(np.float32)  # [L, N, bs, KVH, D]
    pages_v = rng.normal(size=pages_k.shape).astype(np.float32)
    tables = rng.permutation(B * M).reshape(B, M).astype(np.int32)
    lengths = np.array([17, 3, 9], np.int32)
    q = rng.normal(size=(B, heads, D)).astype(np.float32)
    new = (rng.normal(size=(B, kv_heads, D)).astype(np.float32), rng.normal(size=(B, kv_heads, D)).astype(np.float32))
    scale = D**-0.5
    stored_k = pages_k if layout == "tokens" else np.swapaxes(pages_k, 2, 3)
    stored_v = pages_v if layout == "tokens" else np.swapaxes(pages_v, 2, 3)
    got = paged_decode_attention(
        jnp.asarray(q), jnp.asarray(stored_k), jnp.asarray(stored_v), jnp.asarray(tables), jnp.asarray(lengths),
        scale=scale, impl=impl, layer=1, new_kv=(jnp.asarray(new[0]), jnp.asarray(new[1])) if with_new else None,
        block_layout=layout, chunk_blocks=chunk_blocks,
    )  # fmt: skip
    for b in range(B):
        k = pages_k[1, tables[b]].reshape(M * BS, kv_heads, D)[: lengths[b]]
        v = pages_v[1, tables[b]].reshape(M * BS, kv_heads, D)[: lengths[b]]
        if with_new:
            k, v = np.concatenate([k, new[0][b][None]]), np.concatenate([v, new[1][b][None]])
        np.testing.assert_allclose(np.asarray(got[b]), _softmax_attend(q[b], k, v, scale), atol=2e-5, err_msg=str(b))


def test_grouped_attention_over_parts_matches_repeated_reference() -> None:
    """`attention.attention` (prefill, T > 1) and its decode form (T == 1) with a cached part and a new part."""
    rng = np.random.default_rng(5)
    t, s = 4, 6
    q = rng.normal(size=(B, t, H, D)).astype(np.float32)
    k_old, v_old = rng.normal(size=(2, B, s, KVH, D)).astype(np.float32)
    k_new, v_new = rng.normal(size=(2, B, t, KVH, D)).astype(np.float32)
    old_len = np.array([6, 2, 4])
    old = np.broadcast_to(np.arange(s)[None, None, :] < old_len[:, None, None], (B, t, s))
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (B, t, t))
    scale = D**-0.5
    parts = [(jnp.asarray(k_old), jnp.asarray(v_old), jnp.asarray(old)),
             (jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(causal))]  # fmt: skip
    got = np.asarray(attention.attention(jnp.asarray(q), parts, scale))
    one = np.asarray(attention.attention(jnp.asarray(q[:, :1]), [(p[0], p[1], p[2][:, :1]) for p in parts], scale))
    for b in range(B):
        for i in range(t):
            k = np.concatenate([k_old[b, : old_len[b]], k_new[b, : i + 1]])
            v = np.concatenate([v_old[b, : old_len[b]], v_new[b, : i + 1]])
            want = _softmax_attend(q[b, i], k, v, scale)
            np.testing.assert_allclose(got[b, i], want, atol=2e-5)
            if i == 0:
                np.testing.assert_allclose(one[b, 0], want, atol=2e-5)


def test_query_heads_not_a_multiple_of_kv_heads_is_refused() -> None:
    q = jnp.zeros((1, 3, D))
    pages = jnp.zeros((4, BS, 2, D))
    with pytest.raises(ValueError, match="3 query heads are not a multiple of the pool's 2 K/V heads"):
        paged_decode_attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32), scale=1.0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 16), (6, 2, 32), (4, 1, 64)],  # llama-tiny's GQA 2:1 (the kernel's plain loops); 3:1 and MQA (vector)
)
def test_llama_paged_decode_cpu_kernel_equals_xla(heads: int, kv_heads: int, head_dim: int) -> None:
    """A Llama-style GQA model's paged steps: a prompt written in two chunks (T > 1 over pages already
    holding the first), then decode steps through the C++ kernel ("cpu_kernel") and the XLA loop ("xla",
    "xla_heads_flat") over the same head-major pool: the same logits and the same pool every step."""
    import jax

    from models import steps
    from models.config import get_llama_config
    from models.kernels import cpu as cpu_kernel
    from models.params import init_params

    if cpu_kernel.paged_attention_target() is None:
        pytest.skip(f"no CPU kernel here: {cpu_kernel.build_error()}")
    cfg = dataclasses.replace(
        get_llama_config("llama-tiny"), num_heads=heads, num_kv_heads=kv_heads, head_dim_=head_dim
    )
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(7)
    b, bs = 3, 4
    tables = jnp.asarray(rng.permutation(15)[:12].reshape(b, 4), jnp.int32)  # shuffled, 16 positions a row
    prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, 9)), jnp.int32)
    lengths = np.array([9, 4, 7], np.int32)
    pool = init_paged_cache(cfg, 16, bs, block_layout="heads")
    zeros = jnp.zeros(b, jnp.int32)
    first = np.minimum(lengths, 5)  # chunk 1: up to 5 tokens; chunk 2: the rest, attending to chunk 1's pages
    _, pool = steps.extend_paged(params, cfg, prompt[:, :5], zeros, jnp.asarray(first), pool, tables)
    _, pool = steps.extend_paged(params, cfg, prompt[:, 5:], jnp.asarray(first), jnp.asarray(lengths - first), pool,
                                 tables)  # fmt: skip
    pools = {impl: jax.tree.map(jnp.copy, pool) for impl in ("xla", "xla_heads_flat", "cpu_kernel")}  # donated
    positions = lengths.copy()
    for step in range(3):
        tok = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, 1)), jnp.int32)
        logits = {}
        for impl in pools:
            logits[impl], pools[impl] = steps.extend_paged(
                params, cfg, tok, jnp.asarray(positions), jnp.ones(b, jnp.int32), pools[impl], tables, attention=impl
            )
        for impl in ("xla_heads_flat", "cpu_kernel"):
            np.testing.assert_allclose(np.asarray(logits[impl]), np.asarray(logits["xla"]), atol=1e-4, err_msg=impl)
            np.testing.assert_allclose(np.asarray(pools[impl].k), np.asarray(pools["xla"].k), atol=1e-5, err_msg=impl)
        positions += 1
        assert step < 3
