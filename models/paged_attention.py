"""Decode attention over a paged KV pool: one function, an XLA implementation and a Pallas one.

`paged_decode_attention(q, k_pages, v_pages, block_tables, lengths)` attends one query per row
to the first `lengths[b]` positions of row b's pages (position p in block `block_tables[b, p //
block_size]`, slot `p % block_size`). The pool is one layer of the engine's pool, `[num_blocks,
block_size, H, D]` (the layout `models.opt.PagedKVCache` and the KV transfer use).

* `impl="xla"` (default, every backend): gather the row's blocks, put them head-major and run two
  batched matrix-vector products (see `models.opt._decode_attention` for why head-major);
* `impl="pallas_gpu"`: `jax.experimental.pallas.ops.gpu.paged_attention` (Triton), which reads
  the pages in place and wants them head-major `[H, num_blocks, block_size, D]`; the transpose
  here is a copy of the layer's pool, so this pays only where the gather would cost more.
  `interpret=True` runs the same kernel on CPU (slowly), which is how the tests check it.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Impl = Literal["xla", "pallas_gpu"]
_MASK_VALUE = -1e30


def paged_decode_attention(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [num_blocks, block_size, H, D]
    v_pages: jax.Array,  # [num_blocks, block_size, H, D]
    block_tables: jax.Array,  # [B, M] int32
    lengths: jax.Array,  # [B] int32: positions 0..lengths[b]-1 are attended
    *,
    scale: float,
    impl: Impl = "xla",
    interpret: bool = False,
) -> jax.Array:
    """Softmax(q . k * scale) . v over each row's first `lengths[b]` paged positions -> [B, H, D] float32."""
    if impl == "xla":
        return _xla(q, k_pages, v_pages, block_tables, lengths, scale)
    if impl == "pallas_gpu":
        return _pallas_gpu(q, k_pages, v_pages, block_tables, lengths, scale, interpret)
    raise ValueError(f"unknown paged attention implementation {impl!r}")


def default_impl() -> Impl:
    """The implementation to use on the default backend (XLA everywhere until a kernel is measured faster)."""
    return "xla"


def _xla(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array, lengths: jax.Array, scale: float
) -> jax.Array:
    b, m = block_tables.shape
    _, bs, h, d = k_pages.shape
    keys = jnp.swapaxes(k_pages[block_tables].reshape(b, m * bs, h, d), 1, 2)  # [B, H, S, D]
    vals = jnp.swapaxes(v_pages[block_tables].reshape(b, m * bs, h, d), 1, 2)
    s = jnp.einsum("bhd,bhsd->bhs", q, keys, preferred_element_type=jnp.float32) * scale  # [B, H, S]
    valid = jnp.arange(m * bs)[None, None, :] < lengths[:, None, None]
    p = jax.nn.softmax(jnp.where(valid, s, _MASK_VALUE), axis=-1)
    return jnp.einsum("bhs,bhsd->bhd", p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)


def _pallas_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    scale: float,
    interpret: bool,
) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import paged_attention as kernel

    interpret = interpret or jax.default_backend() == "cpu"  # the Triton kernel runs on CPU only interpreted
    m = block_tables.shape[1]
    k_splits = min(16, m)
    if m % k_splits:
        raise ValueError(f"table width {m} must be a multiple of {k_splits} for the Pallas kernel")
    kh = jnp.transpose(k_pages, (2, 0, 1, 3))  # [H, N, bs, D]
    vh = jnp.transpose(v_pages, (2, 0, 1, 3))
    out = kernel.paged_attention(
        (q * scale).astype(k_pages.dtype),  # the kernel does not scale q . k
        kh,
        vh,
        block_tables,
        lengths,
        k_splits=k_splits,
        pages_per_compute_block=max(1, min(8, m // k_splits)),
        interpret=interpret,
    )
    return out.astype(jnp.float32)
