"""The attention and KV layer every decoder family shares: caches, attention math, the layer loop.

A family's decoder layer (`models.opt.OPTLayer`, `models.llama.LlamaLayer`: `flax.nnx` modules) projects
q/k/v, calls `attend(i, q, k, v, cache)` and finishes the layer. This module owns everything about
K/V: the cache pytrees, how a step writes its new K/V and reads the cache back, and the softmax
over the parts (the paged decode step calls `models.paged_attention`'s XLA, Pallas and C++ forms). So a
third family is one file with one model class plus a config mapping.

KV shapes are `[kv_heads, head_dim]` per position. Query heads come in groups of
`G = num_heads // kv_heads` that share one K/V head (GQA; G = 1 is MHA, kv_heads = 1 is MQA);
query head h reads K/V head `h // G` (Hugging Face's `repeat_kv` order). Attention reshapes q
to `[..., kv_heads, G, D]` (a prompt's queries `[B, kv_heads, G*T, D]`) and contracts against each K/V head
once: K/V is never repeated.

Caches (pytrees, passed in and returned):

* `KVCache`      — contiguous `[L, B, T, kv_heads, D]` (prefill output; simple decode);
* `DecodeCache`  — per-layer head-major `[B * kv_heads, T, D]` (the fast contiguous decode);
* `PagedKVCache` — a block pool `[L, num_blocks, block_size, kv_heads, D]` (or head-major blocks).

Step kinds, each a driver here over the family's layer body: `layers_prefill` (right-padded
prompts), `layers_decode` (one token per row over a contiguous cache), `layers_paged` (T >= 1 new
tokens per row into a block pool: a paged decode step or a chunked prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp

from models.paged_attention import BlockLayout, Impl, paged_decode_attention
from models.pytree import pytree_dataclass, static_field

# Masked attention scores; finite so an all-masked (padding) row gives a uniform softmax, not NaN.
MASK_VALUE = -1e30


class KVShape(Protocol):
    """What the KV layer needs of a model config (`OPTConfig` and `LlamaConfig` both are one)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


@pytree_dataclass
class KVCache:
    """Contiguous per-sequence cache (prefill output; simple decode)."""

    k: jax.Array  # [L, B, T, KVH, D]
    v: jax.Array  # [L, B, T, KVH, D]


@pytree_dataclass
class DecodeCache:
    """Contiguous decode cache, one head-major buffer per layer: `k[i]`, `v[i]` [B * KVH, T, D] (row b, head h at b * KVH + h).

    What `decode` reads and updates in place. Head-major so the attention products read each
    head's positions as one contiguous [T, D] matrix; one buffer per layer so no layer is sliced
    out of a stacked array (on XLA:CPU that slice, and the transpose a [B, T, H, D] layout needs,
    are element-wise copies that cost more than the attention itself). Batch and heads share one
    axis because with a [B, H, T, D] buffer at batch 1 XLA drops the unit axis and copies the
    whole buffer around the in-place write. `from_kv` builds it from a prefill's `KVCache`.
    """

    k: tuple[jax.Array, ...]  # L x [B * KVH, T, D]
    v: tuple[jax.Array, ...]

    @staticmethod
    def from_kv(kv: KVCache, max_len: int | None = None) -> DecodeCache:
        """`kv` [L, B, T, KVH, D] -> per-layer [B * KVH, max_len, D] (positions past T zero)."""
        n, b, t, h, d = kv.k.shape
        pad = ((0, 0), (0, 0), (0, 0), (0, (max_len or t) - t), (0, 0))

        def split(x: jax.Array) -> tuple[jax.Array, ...]:
            x = jnp.pad(jnp.swapaxes(x, 2, 3), pad).reshape(n, b * h, -1, d)  # [L, B*KVH, T', D]
            return tuple(x[i] for i in range(n))

        return DecodeCache(k=split(kv.k), v=split(kv.v))


@pytree_dataclass
class PagedKVCache:
    """Decode-side block pool: position p of a sequence lives in block `table[p // bs]`, slot `p % bs`."""

    k: jax.Array  # [L, num_blocks, block_size, KVH, D]; block_layout "heads": [L, num_blocks, KVH, block_size, D]
    v: jax.Array
    # How a block holds its positions (static: part of the tree structure, so a jitted step
    # compiles per layout). "heads" stores each block head-major, which the CPU's chunked decode
    # attention reads without a transpose (models.paged_attention).
    block_layout: BlockLayout = static_field(default="tokens")

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[3 if self.block_layout == "heads" else 2])


# The two contiguous cache layouts `decode` takes (it returns the layout it was given).
KVCacheT = TypeVar("KVCacheT", KVCache, DecodeCache)


def init_cache(
    cfg: KVShape, batch_size: int, max_len: int, dtype: Any = jnp.float32, num_layers: int | None = None
) -> KVCache:
    """Zeroed contiguous cache `[L, B, max_len, KVH, D]`."""
    n = cfg.num_layers if num_layers is None else num_layers
    shape = (n, batch_size, max_len, cfg.kv_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def init_paged_cache(
    cfg: KVShape,
    num_blocks: int,
    block_size: int,
    dtype: Any = jnp.float32,
    num_layers: int | None = None,
    block_layout: BlockLayout = "tokens",
) -> PagedKVCache:
    """Zeroed block pool `[L, num_blocks, block_size, KVH, D]` (`block_layout="heads"`: `[L, num_blocks, KVH, block_size, D]`)."""
    shape = paged_cache_shape(cfg, num_blocks, block_size, block_layout, num_layers)
    return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), block_layout=block_layout)


def paged_cache_shape(
    cfg: KVShape,
    num_blocks: int,
    block_size: int,
    block_layout: BlockLayout = "tokens",
    num_layers: int | None = None,
) -> tuple[int, int, int, int, int]:
    """Shape of one of a block pool's K / V arrays in `block_layout`."""
    n = cfg.num_layers if num_layers is None else num_layers
    if block_layout == "heads":
        return (n, num_blocks, cfg.kv_heads, block_size, cfg.head_dim)
    if block_layout == "tokens":
        return (n, num_blocks, block_size, cfg.kv_heads, cfg.head_dim)
    raise ValueError(f"unknown block layout {block_layout!r}")


# --------------------------------------------------------------------------------------------
# Attention math
# --------------------------------------------------------------------------------------------


# Attention for one layer: (layer index, q [B,T,H,D], new k [B,T,KVH,D], new v, cache) -> (out [B,T,H,D], cache).
# It writes the layer's new K/V into the cache first, then reads that layer back: each read comes
# after its layer's write and before the next layer's, so XLA updates the donated cache in place.
Attend = Callable[[Any, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
# The decoder layers of a step: a family's layer modules, run in order (`run_layers`).
Layers = Sequence[Any]
# A family's decoder layer: (layer, x [B,T,h], layer index, attend, cache) -> (x, cache, (k, v)).
LayerFn = Callable[[Any, jax.Array, Any, Attend, Any], tuple[jax.Array, Any, tuple[jax.Array, jax.Array]]]
# One attention part: (k [B,S,KVH,D], v [B,S,KVH,D], mask [B,T,S]).
Part = tuple[jax.Array, jax.Array, jax.Array]


def attention(q: jax.Array, parts: Sequence[Part], scale: float) -> jax.Array:
    """Softmax attention (float32) of q [B,T,H,D] over key/value parts, each (k [B,S,KVH,D], v, mask [B,T,S]).

    The parts share one softmax, so the cached context and the new tokens are attended together
    without first writing the new K/V into the cache. H must be a multiple of KVH (GQA groups).
    """
    if q.shape[1] == 1:
        return decode_attention(q, parts, scale)
    return _head_major_prompt_attention(q, parts, scale)


def _head_major_prompt_attention(q: jax.Array, parts: Sequence[Part], scale: float) -> jax.Array:
    """`attention` for T > 1 queries as plain batched matmuls over (row, K/V head): q [B,T,H,D] -> [B,T,H,D].

    q is put [B, KVH, G*T, D] (the group's G query heads stacked over the T positions) and each part's K/V
    [B, KVH, S, D] (copies of q- and K/V-sized arrays), so the scores come out [B, KVH, G*T, S] with the
    softmax axis contiguous and the weighted values [B, KVH, G*T, D]. Written as `btkgd,bskd` einsums over
    the stored layouts, XLA:CPU computed the transposed scores [KVH, S, G*T] and copied score-sized arrays
    between layouts twice per layer, which at 2,048 tokens cost more than the products.
    """
    b, t, nh, d = q.shape
    kvh = parts[0][0].shape[2]
    g = nh // kvh
    qh = jnp.transpose(q.reshape(b, t, kvh, g, d), (0, 2, 3, 1, 4)).reshape(b, kvh, g * t, d)  # [B,KVH,G*T,D]
    scores = []
    for k, _, m in parts:
        kh = jnp.swapaxes(k, 1, 2)  # [B, KVH, S, D]
        si = jnp.einsum("bkqd,bksd->bkqs", qh, kh, preferred_element_type=jnp.float32) * scale
        si = jnp.where(m[:, None, None], si.reshape(b, kvh, g, t, -1), MASK_VALUE)  # mask [B,T,S] over (KVH, G)
        scores.append(si.reshape(b, kvh, g * t, -1))  # [B, KVH, G*T, S_i]
    p = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1)
    out = jnp.zeros((b, kvh, g * t, d), jnp.float32)
    offset = 0
    for (_, v, _), si in zip(parts, scores, strict=True):
        width = si.shape[-1]
        pi = p[..., offset : offset + width].astype(v.dtype)
        out = out + jnp.einsum("bkqs,bksd->bkqd", pi, jnp.swapaxes(v, 1, 2), preferred_element_type=jnp.float32)
        offset += width
    out = jnp.transpose(out.reshape(b, kvh, g, t, d), (0, 3, 1, 2, 4))  # [B, T, KVH, G, D]
    return out.reshape(q.shape).astype(q.dtype)


# Queries per block of `causal_attention`: a prompt longer than this attends block by block, each block of queries
# to the keys up to its own end only (the causal triangle's upper blocks, all masked, are never computed).
PREFILL_QUERY_CHUNK = 512


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """`attention(q, [(k, v, mask)])` of a causal prompt q [B,T,H,D], k/v [B,T,KVH,D], mask [B,T,T], by query blocks.

    Block j (queries `[j*C, (j+1)*C)`, C = `PREFILL_QUERY_CHUNK`) attends to keys `[0, (j+1)*C)`: every key it
    leaves out is masked for all of its queries, so the result is the same softmax over the same keys, while
    the scores of a T-token prompt take ~(T/C + 1) / (2 T/C) of the square (0.56 at 4,096 tokens) and no
    [B, H, T, T] score array is ever whole in memory. Blocks of 128, 256 and 512 queries ran a 2,048-token
    prefill within 5 % of each other (smollm2-135m shape, one thread, CPU time); 512 leaves a 512-token prompt whole.
    """
    t = q.shape[1]
    outs = []
    for start in range(0, t, PREFILL_QUERY_CHUNK):
        end = min(start + PREFILL_QUERY_CHUNK, t)
        part = (k[:, :end], v[:, :end], mask[:, start:end, :end])
        outs.append(attention(q[:, start:end], [part], scale))
    return jnp.concatenate(outs, axis=1)


def decode_attention(q: jax.Array, parts: Sequence[Part], scale: float) -> jax.Array:
    """`attention` for one query per row (a decode step): q [B,1,H,D] -> [B,1,H,D].

    Each part's K/V is put head-major ([B,KVH,S,D]) first and attended by `head_major_attention`.
    """
    b, _, nh, d = q.shape
    kvh = parts[0][0].shape[2]
    heads = [(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), m[:, :1]) for k, v, m in parts]  # [B,KVH,S,D], [B,1,S]
    q1 = q[:, 0] if kvh == nh else q[:, 0].reshape(b, kvh, nh // kvh, d)
    return head_major_attention(q1, heads, scale, grouped=kvh != nh).reshape(q.shape).astype(q.dtype)


def head_major_attention(q1: jax.Array, parts: Sequence[Part], scale: float, grouped: bool = False) -> jax.Array:
    """One query per (row, head) over head-major parts: q [..., D] -> float32 [..., D].

    Each part is (k [..., S, D], v [..., S, D], mask broadcastable to [..., S]); the leading dims
    are (batch, KV head), or one flattened batch * KV head dim (`DecodeCache`). `grouped`: q is
    [..., G, D], the G query heads that share each K/V head, attended against it in one product.

    Both products are batched matrix-vector products whose contraction runs along contiguous
    memory. Written as `bthd,bshd` einsums over [B,S,H,D], XLA:CPU lowered them to per-element
    loops ~5x slower; and the transpose that puts a [B,S,H,D] cache head-major is itself an
    element-wise loop that costs more than both products (docs/performance.md).
    """
    if grouped:
        score_eq, value_eq = "...gd,...sd->...gs", "...gs,...sd->...gd"
        masks = [m[..., None, :] for _, _, m in parts]  # broadcast over the group
    else:
        score_eq, value_eq = "...d,...sd->...s", "...s,...sd->...d"
        masks = [m for _, _, m in parts]
    scores = [
        jnp.where(m, jnp.einsum(score_eq, q1, k, preferred_element_type=jnp.float32) * scale, MASK_VALUE)
        for (k, _, _), m in zip(parts, masks, strict=True)
    ]  # [B, H, S_i] (grouped: [B, KVH, G, S_i])
    p = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1)
    out = jnp.zeros(q1.shape, jnp.float32)
    offset = 0
    for (_, v, _), si in zip(parts, scores, strict=True):
        width = si.shape[-1]
        pi = p[..., offset : offset + width].astype(v.dtype)
        out = out + jnp.einsum(value_eq, pi, v, preferred_element_type=jnp.float32)
        offset += width
    return out


# --------------------------------------------------------------------------------------------
# Layer loop
# --------------------------------------------------------------------------------------------


def select_last(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """Hidden state at position `lengths - 1` of each row: [B, T, ...] -> [B, ...] (0 for empty rows)."""
    idx = jnp.maximum(lengths - 1, 0)
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


def run_layers(
    layers: Layers, layer: LayerFn, x: jax.Array, attend: Attend, cache: Any = None
) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """Run the decoder layers over x [B,T,h]. Returns (x, new k [L,B,T,KVH,D], new v, cache).

    An unrolled Python loop (`attend` gets the layer index as a Python int): each layer's weights are its own
    arrays, read in place. (A `lax.scan` over stacked weights would slice them per layer, and every such slice
    that feeds a dot is a copy on XLA:CPU: a scan over the 12 MLP weights of opt-125m at batch 1 took 13.4 ms,
    the same over separate arrays 8.6 ms.)
    """
    ks, vs = [], []
    for i, lp in enumerate(layers):
        x, cache, (k, v) = layer(lp, x, i, attend, cache)
        ks.append(k)
        vs.append(v)
    return x, jnp.stack(ks), jnp.stack(vs), cache


# --------------------------------------------------------------------------------------------
# Step kinds: how a step writes and reads K/V (a family passes its layer body)
# --------------------------------------------------------------------------------------------


def layers_prefill(
    layers: Layers, layer: LayerFn, x: jax.Array, lengths: jax.Array, scale: float
) -> tuple[jax.Array, KVCache]:
    """Causal + padding-masked layers over right-padded prompts. x [B,T,h] -> (x, KVCache [L,B,T,KVH,D])."""
    t = x.shape[1]
    pos = jnp.arange(t)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])  # [B,T,S]

    def attend(i: Any, q: jax.Array, k: jax.Array, v: jax.Array, c: None) -> tuple[jax.Array, None]:
        if t > PREFILL_QUERY_CHUNK:
            return causal_attention(q, k, v, mask, scale), c
        return attention(q, [(k, v, mask)], scale), c

    x, ks, vs, _ = run_layers(layers, layer, x, attend)
    return x, KVCache(k=ks, v=vs)


def layers_decode(
    layers: Layers, layer: LayerFn, x: jax.Array, positions: jax.Array, cache: KVCacheT, scale: float
) -> tuple[jax.Array, KVCacheT]:
    """One token per row at `positions[b]` over a contiguous cache (`KVCache` or `DecodeCache`). x [B,1,h]."""
    if isinstance(cache, DecodeCache):
        return _layers_decode_head_major(layers, layer, x, positions, cache, scale)
    b = x.shape[0]
    s = cache.k.shape[2]
    old = (jnp.arange(s)[None, :] < positions[:, None])[:, None, :]  # [B, 1, S]: what the cache already holds
    self_mask = jnp.ones((b, 1, 1), bool)
    rows = jnp.arange(b)

    def attend(i: Any, q: jax.Array, k: jax.Array, v: jax.Array, c: KVCache) -> tuple[jax.Array, KVCache]:
        # write this layer's new K/V (a position past the cache writes nothing), then read the layer
        c = KVCache(
            k=c.k.at[i, rows, positions].set(k[:, 0], mode="drop"),
            v=c.v.at[i, rows, positions].set(v[:, 0], mode="drop"),
        )
        return attention(q, [(c.k[i], c.v[i], old), (k, v, self_mask)], scale), c

    x, _, _, cache = run_layers(layers, layer, x, attend, cache)
    return x, cache


def _layers_decode_head_major(
    layers: Layers, layer: LayerFn, x: jax.Array, positions: jax.Array, cache: DecodeCache, scale: float
) -> tuple[jax.Array, DecodeCache]:
    """`layers_decode` over a `DecodeCache` (one head-major buffer per layer)."""
    b = x.shape[0]
    n, s = cache.k[0].shape[0], cache.k[0].shape[1]  # n = B * KVH lines
    kvh = n // b
    pos = jnp.repeat(positions, kvh)  # [B*KVH]: each (row, KV head) line's write position
    old = jnp.arange(s)[None, :] < pos[:, None]  # [B*KVH, S]
    lines = jnp.arange(n)

    def attend(i: Any, q: jax.Array, k: jax.Array, v: jax.Array, c: DecodeCache) -> tuple[jax.Array, DecodeCache]:
        hd = q.shape[-1]
        group = q.shape[2] // kvh
        k1, v1 = k.reshape(n, hd), v.reshape(n, hd)
        # write this layer's new K/V in place (a position past the cache writes nothing), then read the layer
        ki = c.k[i].at[lines, pos].set(k1, mode="drop")
        vi = c.v[i].at[lines, pos].set(v1, mode="drop")
        c = DecodeCache(k=(*c.k[:i], ki, *c.k[i + 1 :]), v=(*c.v[:i], vi, *c.v[i + 1 :]))
        new = (k1[:, None], v1[:, None], jnp.ones((n, 1), bool))  # the step's own token, [B*KVH, 1, D]
        q1 = q.reshape(n, hd) if group == 1 else q.reshape(n, group, hd)
        o = head_major_attention(q1, [(ki, vi, old), new], scale, grouped=group > 1)
        return o.reshape(q.shape).astype(q.dtype), c

    x, _, _, cache = run_layers(layers, layer, x, attend, cache)
    return x, cache


def layers_paged(
    layers: Layers,
    layer: LayerFn,
    x: jax.Array,
    start_positions: jax.Array,
    lengths: jax.Array,
    cache: PagedKVCache,
    block_tables: jax.Array,
    scale: float,
    attention_impl: Impl = "xla",
    block_layout: BlockLayout | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """Append `lengths[b]` tokens per row into the pages `block_tables[b]` names, attend over the pages. x [B,T,h].

    The pool's blocks are read and written in `cache.block_layout` (`block_layout`, when given, must
    name the same layout).

    `attention_impl` picks the decode (T == 1) attention of `models.paged_attention`; the XLA forms
    attend to the pages before `start_positions` and the new token as two parts of one softmax, a
    kernel reads the new token back from the pages it was just written to (so its position must lie
    inside the row's table). A chunked prefill (T > 1) always gathers the table's pages once per layer.
    A decode row that appends nothing (`lengths[b] == 0`: a padding row, or a row stopped inside a
    multi-step loop while its position runs on past its table) reads no pages: its output is unused,
    and a kernel's checked build refuses a length past the table.
    """
    b, t, _ = x.shape
    layout = pool_layout(cache, block_layout)
    heads = layout == "heads"  # pool blocks [KVH, bs, D] instead of [bs, KVH, D]
    num_blocks, bs = cache.num_blocks, cache.block_size
    m = block_tables.shape[1]
    kvh, hd = (cache.k.shape[2], cache.k.shape[4]) if heads else (cache.k.shape[3], cache.k.shape[4])
    # what the pages already hold: positions before start (later slots may be stale)
    old = jnp.broadcast_to((jnp.arange(m * bs)[None, :] < start_positions[:, None])[:, None, :], (b, t, m * bs))
    new = jnp.broadcast_to(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], (b, t, t))  # causal among new tokens
    appends = lengths > 0  # decode: rows appending nothing read nothing (see the docstring)

    # Rows/columns that must not write point past the pool; mode="drop" discards them.
    qpos = start_positions[:, None] + jnp.arange(t)[None, :]  # [B, T]
    in_table = (jnp.arange(t)[None, :] < lengths[:, None]) & (qpos // bs < m)
    table_idx = jnp.clip(qpos // bs, 0, m - 1)
    write_block = jnp.where(in_table, jnp.take_along_axis(block_tables, table_idx, axis=1), num_blocks)
    write_slot = qpos % bs

    def attend(i: Any, q: jax.Array, k: jax.Array, v: jax.Array, c: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        if heads:  # index dims (block, slot) around a slice: the update is [B, T, KVH, D] as k is
            c = PagedKVCache(
                block_layout=c.block_layout,
                k=c.k.at[i, write_block, :, write_slot].set(k, mode="drop"),
                v=c.v.at[i, write_block, :, write_slot].set(v, mode="drop"),
            )
        else:
            c = PagedKVCache(
                block_layout=c.block_layout,
                k=c.k.at[i, write_block, write_slot].set(k, mode="drop"),
                v=c.v.at[i, write_block, write_slot].set(v, mode="drop"),
            )
        if t == 1 and attention_impl == "pallas_gpu":  # reads the new token from the pages (any group)
            o = paged_decode_attention(
                q[:, 0], c.k, c.v, block_tables, jnp.where(appends, start_positions + lengths, 0), scale=scale,
                impl=attention_impl, layer=i, block_layout=layout,
            )  # fmt: skip
            return o[:, None].astype(q.dtype), c
        if t == 1:  # the pages before start and the new token in one softmax, the pool read in place
            o = paged_decode_attention(
                q[:, 0], c.k, c.v, block_tables, jnp.where(appends, start_positions, 0), scale=scale,
                impl=attention_impl, layer=i, new_kv=(k[:, 0], v[:, 0]), block_layout=layout,
            )  # fmt: skip
            return o[:, None].astype(q.dtype), c
        # chunked prefill: one gather straight from the pool (no slice of layer i first: that would be a copy)
        keys, vals = c.k[i, block_tables], c.v[i, block_tables]  # [B, M, bs, KVH, D] (heads: [B, M, KVH, bs, D])
        if heads:
            keys, vals = jnp.swapaxes(keys, 2, 3), jnp.swapaxes(vals, 2, 3)
        keys = keys.reshape(b, m * bs, kvh, hd)  # [B, S, KVH, D]
        vals = vals.reshape(b, m * bs, kvh, hd)
        return attention(q, [(keys, vals, old), (k, v, new)], scale), c

    x, _, _, cache = run_layers(layers, layer, x, attend, cache)
    return x, cache


@partial(jax.jit, static_argnames=("block_layout",), donate_argnames=("cache",))
def insert_into_pages(
    cache: PagedKVCache,
    kv: KVCache,
    block_tables: jax.Array,
    lengths: jax.Array,
    start_positions: jax.Array | None = None,
    block_layout: BlockLayout | None = None,
) -> PagedKVCache:
    """Copy positions `0..lengths[b]-1` of a contiguous `kv` [L,B,T,KVH,D] into the pages of `block_tables` [B,M].

    The decode side's "insert" of a pulled prefill KV. Positions beyond `lengths[b]` are not written.
    `start_positions` (default 0) offsets where row b's positions land in its pages. `cache` is donated.
    """
    _, b, t, _, _ = kv.k.shape
    heads = pool_layout(cache, block_layout) == "heads"
    num_blocks, bs = cache.num_blocks, cache.block_size
    m = block_tables.shape[1]
    start = jnp.zeros((b,), jnp.int32) if start_positions is None else start_positions
    pos = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    valid = (jnp.arange(t)[None, :] < lengths[:, None]) & (pos // bs < m)
    blk = jnp.where(valid, jnp.take_along_axis(block_tables, jnp.clip(pos // bs, 0, m - 1), axis=1), num_blocks)
    slot = pos % bs
    if heads:  # index dims (block, slot) around slices go first: the update is [B, T, L, KVH, D]
        k = cache.k.at[:, blk, :, slot].set(jnp.moveaxis(kv.k, 0, 2).astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, blk, :, slot].set(jnp.moveaxis(kv.v, 0, 2).astype(cache.v.dtype), mode="drop")
    else:
        k = cache.k.at[:, blk, slot].set(kv.k.astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, blk, slot].set(kv.v.astype(cache.v.dtype), mode="drop")
    return PagedKVCache(k=k, v=v, block_layout=cache.block_layout)


def pool_layout(cache: PagedKVCache, block_layout: BlockLayout | None) -> BlockLayout:
    """The pool's own layout; a caller that names one must name the same (a mismatch would misread every block)."""
    if block_layout is not None and block_layout != cache.block_layout:
        raise ValueError(f"block_layout={block_layout!r} but the pool's blocks are {cache.block_layout!r}")
    return cache.block_layout
