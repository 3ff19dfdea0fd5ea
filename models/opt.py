"""OPT decoder as pure JAX functions, numerically equal to Hugging Face's `OPTForCausalLM`.

Parameters are a plain nested dict (no Flax module state); the KV cache is an explicit pytree
passed in and returned. Decoder layers are stacked along a leading layer axis, so a pipeline
stage is the slice `[start:end]` of every leaf under `"layers"` and the forward pass scans over it.

Param tree (shapes for `cfg`; `E = cfg.embed_dim`, `h = cfg.hidden_size`, `f = cfg.ffn_dim`)::

    embed_tokens      [V, E]          tied LM head
    embed_positions   [P + 2, h]      position p reads row p + 2
    project_in        [E, h]          only when E != h (opt-350m)
    project_out       [h, E]          only when E != h
    final_layer_norm  {scale, bias}   [h]; only for pre-LN models
    layers:
      self_attn_layer_norm {scale, bias}  [L, h]
      q_proj / k_proj / v_proj {kernel [L, h, h], bias [L, h]}
      out_proj            {kernel [L, h, h], bias [L, h]}
      final_layer_norm    {scale, bias}   [L, h]
      fc1                 {kernel [L, h, f], bias [L, f]}
      fc2                 {kernel [L, f, h], bias [L, h]}

Kernels are `[in, out]` (Hugging Face Linear weights transposed). Three entry points share one
layer body and differ only in how attention reads and writes K/V:

* `prefill`  — right-padded prompts `[B, T]`, returns a contiguous `KVCache` `[L, B, T, H, D]`;
* `decode`   — one token per sequence at its own position, over a contiguous `KVCache`;
* `extend_paged` — `T >= 1` new tokens per sequence appended into a block pool (`PagedKVCache`)
  addressed by block tables; `T == 1` is a paged decode step, `T > 1` a chunked prefill.

Stage pieces for pipeline parallelism: `embed`, `run_layers_prefill`, `run_layers_decode`,
`run_layers_paged`, `final_hidden`, `lm_head`, `stage_params`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.config import OPT_POSITION_OFFSET, OPTConfig

Params = dict[str, Any]

# Masked attention scores; finite so an all-masked (padding) row gives a uniform softmax, not NaN.
_MASK_VALUE = -1e30


@flax.struct.dataclass
class KVCache:
    """Contiguous per-sequence cache (prefill output; simple decode)."""

    k: jax.Array  # [L, B, T, H, D]
    v: jax.Array  # [L, B, T, H, D]


@flax.struct.dataclass
class PagedKVCache:
    """Decode-side block pool: position p of a sequence lives in block `table[p // bs]`, slot `p % bs`."""

    k: jax.Array  # [L, num_blocks, block_size, H, D]
    v: jax.Array  # [L, num_blocks, block_size, H, D]

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[2])


def _as_dtype(dtype: Any) -> jnp.dtype:
    return jnp.dtype(dtype)


# --------------------------------------------------------------------------------------------
# Parameters and caches
# --------------------------------------------------------------------------------------------


def init_params(cfg: OPTConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random OPT weights (normal(0, 0.02) matrices, zero biases, unit LayerNorm scales)."""
    dtype = _as_dtype(dtype)
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(leaves, keys, strict=True):
        name = jax.tree_util.keystr(path)
        if "bias" in name:
            out.append(jnp.zeros(shape, dtype))
        elif "scale" in name:
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def param_shapes(cfg: OPTConfig, num_layers: int | None = None) -> dict[str, Any]:
    """The param tree with a shape tuple at every leaf (the layout `init_params` and loaders produce)."""
    h, f, e, n = cfg.hidden_size, cfg.ffn_dim, cfg.embed_dim, cfg.num_layers if num_layers is None else num_layers

    def ln(*lead: int) -> dict[str, tuple[int, ...]]:
        return {"scale": (*lead, h), "bias": (*lead, h)}

    def linear(i: int, o: int) -> dict[str, tuple[int, ...]]:
        return {"kernel": (n, i, o), "bias": (n, o)}

    shapes: dict[str, Any] = {
        "embed_tokens": (cfg.vocab_size, e),
        "embed_positions": (cfg.max_position_embeddings + OPT_POSITION_OFFSET, h),
        "layers": {
            "self_attn_layer_norm": ln(n),
            "q_proj": linear(h, h),
            "k_proj": linear(h, h),
            "v_proj": linear(h, h),
            "out_proj": linear(h, h),
            "final_layer_norm": ln(n),
            "fc1": linear(h, f),
            "fc2": linear(f, h),
        },
    }
    if cfg.has_projections:
        shapes["project_in"] = (e, h)
        shapes["project_out"] = (h, e)
    if cfg.has_final_layer_norm:
        shapes["final_layer_norm"] = ln()
    return shapes


def stage_params(params: Params, cfg: OPTConfig, start: int, end: int) -> Params:
    """The part of `params` a pipeline stage holding layers `[start, end)` needs.

    The first stage keeps the embeddings (and `project_in`); the last keeps `embed_tokens` for the
    tied LM head, the final LayerNorm and `project_out`.
    """
    first, last = start == 0, end == cfg.num_layers
    out: Params = {"layers": jax.tree.map(lambda x: x[start:end], params["layers"])}
    if first or last:
        out["embed_tokens"] = params["embed_tokens"]
    if first:
        out["embed_positions"] = params["embed_positions"]
        if "project_in" in params:
            out["project_in"] = params["project_in"]
    if last:
        for name in ("project_out", "final_layer_norm"):
            if name in params:
                out[name] = params[name]
    return out


def init_cache(
    cfg: OPTConfig, batch_size: int, max_len: int, dtype: Any = jnp.float32, num_layers: int | None = None
) -> KVCache:
    """Zeroed contiguous cache `[L, B, max_len, H, D]`."""
    n = cfg.num_layers if num_layers is None else num_layers
    shape = (n, batch_size, max_len, cfg.num_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def init_paged_cache(
    cfg: OPTConfig, num_blocks: int, block_size: int, dtype: Any = jnp.float32, num_layers: int | None = None
) -> PagedKVCache:
    """Zeroed block pool `[L, num_blocks, block_size, H, D]`."""
    n = cfg.num_layers if num_layers is None else num_layers
    shape = (n, num_blocks, block_size, cfg.num_heads, cfg.head_dim)
    return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def _layer_norm(x: jax.Array, p: Params, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _linear(x: jax.Array, p: Params) -> jax.Array:
    return jnp.dot(x, p["kernel"]) + p["bias"]


def embed(params: Params, cfg: OPTConfig, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """Token + learned position embeddings (first pipeline stage). tokens/positions [B, T] -> [B, T, h]."""
    x = jnp.take(params["embed_tokens"], tokens, axis=0)  # [B, T, E]
    if "project_in" in params:
        x = jnp.dot(x, params["project_in"])  # [B, T, h]
    pos = jnp.take(params["embed_positions"], positions + OPT_POSITION_OFFSET, axis=0, mode="clip")
    return x + pos.astype(x.dtype)


def final_hidden(params: Params, cfg: OPTConfig, x: jax.Array) -> jax.Array:
    """Final LayerNorm (pre-LN models) and `project_out` (opt-350m): [..., h] -> [..., E]."""
    if "final_layer_norm" in params:
        x = _layer_norm(x, params["final_layer_norm"], cfg.layer_norm_eps)
    if "project_out" in params:
        x = jnp.dot(x, params["project_out"])
    return x


def lm_head(params: Params, cfg: OPTConfig, x: jax.Array) -> jax.Array:
    """Final norm/projection and the tied LM head (last pipeline stage): [..., h] -> float32 logits [..., V]."""
    x = final_hidden(params, cfg, x)
    return jnp.dot(x, params["embed_tokens"].T, preferred_element_type=jnp.float32)


def select_last(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """Hidden state at position `lengths - 1` of each row: [B, T, ...] -> [B, ...] (0 for empty rows)."""
    idx = jnp.maximum(lengths - 1, 0)
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


# An attention backend: (layer index, q [B,T,H,D], k_new, v_new, state) -> (out [B,T,H,D], state).
_Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def _softmax_attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,H,D], mask [B,T,S] -> [B,T,H,D]; softmax in float32."""
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None], s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v)


def _decode_attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Single-query attention as multiply-reduce so XLA fuses the cache read (no copy of K/V).

    q [B,H,D], k/v [B,S,H,D], mask [B,S] -> [B,H,D].
    """
    s = jnp.sum(q[:, None].astype(jnp.float32) * k.astype(jnp.float32), axis=-1) * scale  # [B, S, H]
    s = jnp.where(mask[:, :, None], s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=1)  # [B, S, H]
    return jnp.sum(p[..., None] * v.astype(jnp.float32), axis=1).astype(q.dtype)


def _run_layers(
    layer_params: Params, cfg: OPTConfig, x: jax.Array, attend: _Attend, state: Any
) -> tuple[jax.Array, Any]:
    """Scan the decoder layers over `x` [B, T, h]; `attend` owns every K/V read and write."""
    b, t, _ = x.shape
    nh, hd, eps = cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps
    pre_ln = cfg.do_layer_norm_before

    def body(carry: tuple[jax.Array, Any], xs: tuple[jax.Array, Params]) -> tuple[tuple[jax.Array, Any], Any]:
        h, st = carry
        i, lp = xs
        residual = h
        y = _layer_norm(h, lp["self_attn_layer_norm"], eps) if pre_ln else h
        q = _linear(y, lp["q_proj"]).reshape(b, t, nh, hd)
        k = _linear(y, lp["k_proj"]).reshape(b, t, nh, hd)
        v = _linear(y, lp["v_proj"]).reshape(b, t, nh, hd)
        o, st = attend(i, q, k, v, st)
        h = residual + _linear(o.reshape(b, t, nh * hd), lp["out_proj"])
        if not pre_ln:
            h = _layer_norm(h, lp["self_attn_layer_norm"], eps)
        residual = h
        y = _layer_norm(h, lp["final_layer_norm"], eps) if pre_ln else h
        y = jax.nn.relu(_linear(y, lp["fc1"]))
        h = residual + _linear(y, lp["fc2"])
        if not pre_ln:
            h = _layer_norm(h, lp["final_layer_norm"], eps)
        return (h, st), None

    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    (x, state), _ = jax.lax.scan(body, (x, state), (jnp.arange(num_layers), layer_params))
    return x, state


# --------------------------------------------------------------------------------------------
# Stage-level forward passes (a pipeline stage runs these on its layer slice)
# --------------------------------------------------------------------------------------------


def run_layers_prefill(
    layer_params: Params, cfg: OPTConfig, x: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, KVCache]:
    """Causal + padding-masked layers over right-padded prompts. x [B,T,h] -> (x, KVCache [L,B,T,H,D])."""
    b, t, _ = x.shape
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    pos = jnp.arange(t)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])  # [B,T,S]
    scale = cfg.head_dim**-0.5
    kv_shape = (num_layers, b, t, cfg.num_heads, cfg.head_dim)
    cache0 = KVCache(k=jnp.zeros(kv_shape, x.dtype), v=jnp.zeros(kv_shape, x.dtype))

    def attend(i: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        cache = KVCache(k=cache.k.at[i].set(k), v=cache.v.at[i].set(v))
        return _softmax_attend(q, k, v, mask, scale), cache

    return _run_layers(layer_params, cfg, x, attend, cache0)


def run_layers_decode(
    layer_params: Params, cfg: OPTConfig, x: jax.Array, positions: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """One token per row at `positions[b]` over a contiguous cache. x [B,1,h]."""
    b = x.shape[0]
    s = cache.k.shape[2]
    mask = jnp.arange(s)[None, :] <= positions[:, None]  # [B, S]
    rows = jnp.arange(b)
    scale = cfg.head_dim**-0.5

    def attend(i: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, c: KVCache) -> tuple[jax.Array, KVCache]:
        ck = c.k.at[i, rows, positions].set(k[:, 0], mode="drop")
        cv = c.v.at[i, rows, positions].set(v[:, 0], mode="drop")
        o = _decode_attend(q[:, 0], ck[i], cv[i], mask, scale)
        return o[:, None], KVCache(k=ck, v=cv)

    return _run_layers(layer_params, cfg, x, attend, cache)


def run_layers_paged(
    layer_params: Params,
    cfg: OPTConfig,
    x: jax.Array,
    start_positions: jax.Array,
    lengths: jax.Array,
    cache: PagedKVCache,
    block_tables: jax.Array,
) -> tuple[jax.Array, PagedKVCache]:
    """Append `lengths[b]` tokens per row into the pages `block_tables[b]` names, attend over the pages. x [B,T,h]."""
    b, t, _ = x.shape
    num_blocks, bs = cache.k.shape[1], cache.k.shape[2]
    m = block_tables.shape[1]
    qpos = start_positions[:, None] + jnp.arange(t)[None, :]  # [B, T]
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    table_idx = jnp.clip(qpos // bs, 0, m - 1)
    # Rows/columns that must not write point past the pool; mode="drop" discards them.
    write_block = jnp.where(valid & (qpos // bs < m), jnp.take_along_axis(block_tables, table_idx, axis=1), num_blocks)
    write_slot = qpos % bs
    kpos = jnp.arange(m * bs)  # key position j lives in table entry j // bs
    mask = kpos[None, None, :] <= qpos[:, :, None]  # [B, T, S] causal over everything up to the query
    scale = cfg.head_dim**-0.5
    nh, hd = cfg.num_heads, cfg.head_dim

    def attend(
        i: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, c: PagedKVCache
    ) -> tuple[jax.Array, PagedKVCache]:
        ck = c.k.at[i, write_block, write_slot].set(k, mode="drop")
        cv = c.v.at[i, write_block, write_slot].set(v, mode="drop")
        keys = ck[i][block_tables].reshape(b, m * bs, nh, hd)  # [B, S, H, D]
        vals = cv[i][block_tables].reshape(b, m * bs, nh, hd)
        if t == 1:
            o = _decode_attend(q[:, 0], keys, vals, mask[:, 0], scale)[:, None]
        else:
            o = _softmax_attend(q, keys, vals, mask, scale)
        return o, PagedKVCache(k=ck, v=cv)

    return _run_layers(layer_params, cfg, x, attend, cache)


# --------------------------------------------------------------------------------------------
# Whole-model entry points
# --------------------------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("cfg", "all_logits"))
def prefill(
    params: Params, cfg: OPTConfig, tokens: jax.Array, lengths: jax.Array, *, all_logits: bool = False
) -> tuple[jax.Array, KVCache]:
    """Right-padded prompts tokens [B,T] with true `lengths` [B].

    Returns float32 logits [B,T,V] (all_logits) or at position `lengths - 1` [B,V], and K/V for all
    T positions (padding positions hold values the caller ignores).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed(params, cfg, tokens, positions)
    x, cache = run_layers_prefill(params["layers"], cfg, x, lengths)
    if not all_logits:
        x = select_last(x, lengths)
    return lm_head(params, cfg, x), cache


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode(
    params: Params, cfg: OPTConfig, tokens: jax.Array, positions: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """One token per row: tokens/positions [B]; writes K/V at `positions[b]`, attends to 0..positions[b]."""
    x = embed(params, cfg, tokens[:, None], positions[:, None])
    x, cache = run_layers_decode(params["layers"], cfg, x, positions, cache)
    return lm_head(params, cfg, x[:, 0]), cache


@partial(jax.jit, static_argnames=("cfg", "all_logits"), donate_argnames=("cache",))
def extend_paged(
    params: Params,
    cfg: OPTConfig,
    tokens: jax.Array,
    start_positions: jax.Array,
    lengths: jax.Array,
    cache: PagedKVCache,
    block_tables: jax.Array,
    *,
    all_logits: bool = False,
) -> tuple[jax.Array, PagedKVCache]:
    """Append tokens [B,T] (first `lengths[b]` valid) at `start_positions[b]..` into paged KV.

    Logits at the last new token [B,V] (or all [B,T,V]). Rows with `lengths[b] == 0` write nothing.
    """
    t = tokens.shape[1]
    positions = start_positions[:, None] + jnp.arange(t, dtype=start_positions.dtype)[None, :]
    x = embed(params, cfg, tokens, positions)
    x, cache = run_layers_paged(params["layers"], cfg, x, start_positions, lengths, cache, block_tables)
    if not all_logits:
        x = select_last(x, lengths)
    return lm_head(params, cfg, x), cache


@jax.jit
def insert_into_pages(
    cache: PagedKVCache,
    kv: KVCache,
    block_tables: jax.Array,
    lengths: jax.Array,
    start_positions: jax.Array | None = None,
) -> PagedKVCache:
    """Copy positions `0..lengths[b]-1` of a contiguous `kv` [L,B,T,H,D] into the pages of `block_tables` [B,M].

    The decode side's "insert" of a pulled prefill KV. Positions beyond `lengths[b]` are not written.
    `start_positions` (default 0) offsets where row b's positions land in its pages.
    """
    _, b, t, _, _ = kv.k.shape
    num_blocks, bs = cache.k.shape[1], cache.k.shape[2]
    m = block_tables.shape[1]
    start = jnp.zeros((b,), jnp.int32) if start_positions is None else start_positions
    pos = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    valid = (jnp.arange(t)[None, :] < lengths[:, None]) & (pos // bs < m)
    blk = jnp.where(valid, jnp.take_along_axis(block_tables, jnp.clip(pos // bs, 0, m - 1), axis=1), num_blocks)
    slot = pos % bs
    k = cache.k.at[:, blk, slot].set(kv.k.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, blk, slot].set(kv.v.astype(cache.v.dtype), mode="drop")
    return PagedKVCache(k=k, v=v)


def num_params(params: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
