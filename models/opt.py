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

Attention attends to the positions the cache held before the call and to the new tokens in one
float32 softmax. Each layer writes its new K/V into the (donated) cache before reading that layer
back, so reads and in-place writes alternate and XLA copies no cache. Layers given as one dict per
layer (`unstack_layers`, the serving layout of `models.sharding.ShardedOPT`) run as an unrolled
loop that reads every weight in place; stacked leaves run as a `lax.scan` (slices of stacked
weights are copies on XLA:CPU, so that form is for tests and tools). Decode attention over pages
can run through `models.paged_attention` (XLA or a Pallas kernel).

Stage pieces for pipeline parallelism: `embed`, `run_layers_prefill`, `run_layers_decode`,
`run_layers_paged`, `final_hidden`, `lm_head`, `stage_params`; `insert_into_pages` writes a
contiguous prefill KV into the block pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.config import OPT_POSITION_OFFSET, OPTConfig
from models.paged_attention import BlockLayout, Impl, paged_decode_attention

Params = dict[str, Any]

# Masked attention scores; finite so an all-masked (padding) row gives a uniform softmax, not NaN.
_MASK_VALUE = -1e30


@flax.struct.dataclass
class KVCache:
    """Contiguous per-sequence cache (prefill output; simple decode)."""

    k: jax.Array  # [L, B, T, H, D]
    v: jax.Array  # [L, B, T, H, D]


@flax.struct.dataclass
class DecodeCache:
    """Contiguous decode cache, one head-major buffer per layer: `k[i]`, `v[i]` [B * H, T, D] (row b, head h at b * H + h).

    What `decode` reads and updates in place. Head-major so the attention products read each
    head's positions as one contiguous [T, D] matrix; one buffer per layer so no layer is sliced
    out of a stacked array (on XLA:CPU that slice, and the transpose a [B, T, H, D] layout needs,
    are element-wise copies that cost more than the attention itself). Batch and heads share one
    axis because with a [B, H, T, D] buffer at batch 1 XLA drops the unit axis and copies the
    whole buffer around the in-place write. `from_kv` builds it from a prefill's `KVCache`.
    """

    k: tuple[jax.Array, ...]  # L x [B * H, T, D]
    v: tuple[jax.Array, ...]

    @staticmethod
    def from_kv(kv: KVCache, max_len: int | None = None) -> DecodeCache:
        """`kv` [L, B, T, H, D] -> per-layer [B * H, max_len, D] (positions past T zero)."""
        n, b, t, h, d = kv.k.shape
        pad = ((0, 0), (0, 0), (0, 0), (0, (max_len or t) - t), (0, 0))

        def split(x: jax.Array) -> tuple[jax.Array, ...]:
            x = jnp.pad(jnp.swapaxes(x, 2, 3), pad).reshape(n, b * h, -1, d)  # [L, B*H, T', D]
            return tuple(x[i] for i in range(n))

        return DecodeCache(k=split(kv.k), v=split(kv.v))


@flax.struct.dataclass
class PagedKVCache:
    """Decode-side block pool: position p of a sequence lives in block `table[p // bs]`, slot `p % bs`."""

    k: jax.Array  # [L, num_blocks, block_size, H, D]; block_layout "heads": [L, num_blocks, H, block_size, D]
    v: jax.Array
    # How a block holds its positions (static: part of the tree structure, so a jitted step
    # compiles per layout). "heads" stores each block head-major, which the CPU's chunked decode
    # attention reads without a transpose (models.paged_attention).
    block_layout: BlockLayout = flax.struct.field(pytree_node=False, default="tokens")

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[3 if self.block_layout == "heads" else 2])


# The two contiguous cache layouts `decode` takes (it returns the layout it was given).
KVCacheT = TypeVar("KVCacheT", KVCache, DecodeCache)


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
    cfg: OPTConfig,
    num_blocks: int,
    block_size: int,
    dtype: Any = jnp.float32,
    num_layers: int | None = None,
    block_layout: BlockLayout = "tokens",
) -> PagedKVCache:
    """Zeroed block pool `[L, num_blocks, block_size, H, D]` (`block_layout="heads"`: `[L, num_blocks, H, block_size, D]`)."""
    shape = paged_cache_shape(cfg, num_blocks, block_size, block_layout, num_layers)
    return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), block_layout=block_layout)


def paged_cache_shape(
    cfg: OPTConfig,
    num_blocks: int,
    block_size: int,
    block_layout: BlockLayout = "tokens",
    num_layers: int | None = None,
) -> tuple[int, int, int, int, int]:
    """Shape of one of a block pool's K / V arrays in `block_layout`."""
    n = cfg.num_layers if num_layers is None else num_layers
    if block_layout == "heads":
        return (n, num_blocks, cfg.num_heads, block_size, cfg.head_dim)
    if block_layout == "tokens":
        return (n, num_blocks, block_size, cfg.num_heads, cfg.head_dim)
    raise ValueError(f"unknown block layout {block_layout!r}")


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
    # [V, E] @ [E, N], not x @ E.T: written the other way round XLA:CPU materialised E.T (a copy of
    # the whole 154 MB table of opt-125m every step) before the matmul.
    flat = x.reshape(-1, x.shape[-1])  # [N, E]
    logits = jnp.dot(params["embed_tokens"], flat.T, preferred_element_type=jnp.float32).T  # [N, V]
    return logits.reshape(*x.shape[:-1], logits.shape[-1])


def select_last(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """Hidden state at position `lengths - 1` of each row: [B, T, ...] -> [B, ...] (0 for empty rows)."""
    idx = jnp.maximum(lengths - 1, 0)
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


# Attention for one layer: (layer index, q [B,T,H,D], new k, new v, cache) -> (out [B,T,H,D], cache).
# It writes the layer's new K/V into the cache first, then reads that layer back: each read comes
# after its layer's write and before the next layer's, so XLA updates the donated cache in place.
_Attend = Callable[[Any, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
# Stacked layer leaves [L, ...] (checkpoints, scan) or one dict per layer (`unstack_layers`, serving).
Layers = Mapping[str, Any] | Sequence[Mapping[str, Any]]


def _scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """q [B,T,H,D], k [B,S,H,D] -> float32 scores [B,H,T,S]."""
    return jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale


def _weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """p [B,H,T,S] float32, v [B,S,H,D] -> [B,T,H,D] float32."""
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _decode_attention(q: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]], scale: float) -> jax.Array:
    """`_attention` for one query per row (a decode step): q [B,1,H,D] -> [B,1,H,D].

    Each part's K/V is put head-major ([B,H,S,D]) first and attended by `_head_major_attention`.
    """
    heads = [(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), m[:, :1]) for k, v, m in parts]  # [B,H,S,D], [B,1,S]
    return _head_major_attention(q[:, 0], heads, scale)[:, None].astype(q.dtype)


def _head_major_attention(
    q1: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]], scale: float
) -> jax.Array:
    """One query per (row, head) over head-major parts: q [..., D] -> float32 [..., D].

    Each part is (k [..., S, D], v [..., S, D], mask broadcastable to [..., S]); the leading dims
    are (batch, head), or one flattened batch * head dim (`DecodeCache`).

    Both products are batched matrix-vector products whose contraction runs along contiguous
    memory. Written as `bthd,bshd` einsums over [B,S,H,D], XLA:CPU lowered them to per-element
    loops ~5x slower; and the transpose that puts a [B,S,H,D] cache head-major is itself an
    element-wise loop that costs more than both products (docs/performance.md).
    """
    scores = [
        jnp.where(m, jnp.einsum("...d,...sd->...s", q1, k, preferred_element_type=jnp.float32) * scale, _MASK_VALUE)
        for k, _, m in parts
    ]  # [B, H, S_i]
    p = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1)
    out = jnp.zeros(q1.shape, jnp.float32)
    offset = 0
    for (_, v, _), si in zip(parts, scores, strict=True):
        width = si.shape[-1]
        pi = p[..., offset : offset + width].astype(v.dtype)
        out = out + jnp.einsum("...s,...sd->...d", pi, v, preferred_element_type=jnp.float32)
        offset += width
    return out


def _attention(q: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]], scale: float) -> jax.Array:
    """Softmax attention (float32) of q [B,T,H,D] over key/value parts, each (k [B,S,H,D], v, mask [B,T,S]).

    The parts share one softmax, so the cached context and the new tokens are attended together
    without first writing the new K/V into the cache.
    """
    if q.shape[1] == 1:
        return _decode_attention(q, parts, scale)
    scores = [jnp.where(m[:, None], _scores(q, k, scale), _MASK_VALUE) for k, _, m in parts]  # [B,H,T,S_i]
    p = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1)
    out = jnp.zeros(q.shape, jnp.float32)
    offset = 0
    for (_, v, _), si in zip(parts, scores, strict=True):
        width = si.shape[-1]
        out = out + _weighted_values(p[..., offset : offset + width], v)
        offset += width
    return out.astype(q.dtype)


def num_layers_of(layers: Layers) -> int:
    """Layer count of a stacked layer dict or a per-layer list."""
    if isinstance(layers, Sequence):
        return len(layers)
    return int(jax.tree.leaves(dict(layers))[0].shape[0])


def unstack_layers(layers: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Stacked layer leaves [L, ...] -> one dict of [...] leaves per layer (the serving layout).

    Why two layouts: stacked leaves are what checkpoints hold and what a `lax.scan` walks, but
    every per-layer slice of a stacked weight that feeds a dot is a copy on XLA:CPU (a scan
    over the 12 MLP weights of opt-125m at batch 1: 13.4 ms; the same over separate arrays: 8.6 ms).
    """
    n = num_layers_of(layers)
    return [jax.tree.map(lambda x, i=i: x[i], dict(layers)) for i in range(n)]


def stack_layers(layers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The inverse of `unstack_layers`: per-layer dicts -> stacked leaves [L, ...]."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *[dict(lp) for lp in layers])


def _run_layers(
    layers: Layers, cfg: OPTConfig, x: jax.Array, attend: _Attend, cache: Any = None
) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """Run the decoder layers over x [B,T,h]. Returns (x, new k [L,B,T,H,D], new v, cache).

    Per-layer dicts (`unstack_layers`, what `ShardedOPT` serves from) run as an unrolled Python
    loop and `attend` gets the layer index as a Python int; stacked leaves run as a `lax.scan`
    (compact programs for tests and tools) with the cache in the carry and a traced index.
    """
    b, t, _ = x.shape
    nh, hd, eps = cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps
    pre_ln = cfg.do_layer_norm_before

    def body(
        carry: tuple[jax.Array, Any], xs: tuple[Any, Any]
    ) -> tuple[tuple[jax.Array, Any], tuple[jax.Array, jax.Array]]:
        h, c = carry
        i, lp = xs
        residual = h
        y = _layer_norm(h, lp["self_attn_layer_norm"], eps) if pre_ln else h
        q = _linear(y, lp["q_proj"]).reshape(b, t, nh, hd)
        k = _linear(y, lp["k_proj"]).reshape(b, t, nh, hd)
        v = _linear(y, lp["v_proj"]).reshape(b, t, nh, hd)
        o, c = attend(i, q, k, v, c)
        h = residual + _linear(o.reshape(b, t, nh * hd), lp["out_proj"])
        if not pre_ln:
            h = _layer_norm(h, lp["self_attn_layer_norm"], eps)
        residual = h
        y = _layer_norm(h, lp["final_layer_norm"], eps) if pre_ln else h
        y = jax.nn.relu(_linear(y, lp["fc1"]))
        h = residual + _linear(y, lp["fc2"])
        if not pre_ln:
            h = _layer_norm(h, lp["final_layer_norm"], eps)
        return (h, c), (k, v)

    if isinstance(layers, Sequence):
        ks, vs = [], []
        carry = (x, cache)
        for i, lp in enumerate(layers):
            carry, (k, v) = body(carry, (i, lp))
            ks.append(k)
            vs.append(v)
        return carry[0], jnp.stack(ks), jnp.stack(vs), carry[1]
    (x, cache), (kst, vst) = jax.lax.scan(body, (x, cache), (jnp.arange(num_layers_of(layers)), dict(layers)))
    return x, kst, vst, cache


# --------------------------------------------------------------------------------------------
# Stage-level forward passes (a pipeline stage runs these on its layer slice)
# --------------------------------------------------------------------------------------------


def run_layers_prefill(layers: Layers, cfg: OPTConfig, x: jax.Array, lengths: jax.Array) -> tuple[jax.Array, KVCache]:
    """Causal + padding-masked layers over right-padded prompts. x [B,T,h] -> (x, KVCache [L,B,T,H,D])."""
    t = x.shape[1]
    pos = jnp.arange(t)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])  # [B,T,S]
    scale = cfg.head_dim**-0.5

    def attend(i: Any, q: jax.Array, k: jax.Array, v: jax.Array, c: None) -> tuple[jax.Array, None]:
        return _attention(q, [(k, v, mask)], scale), c

    x, ks, vs, _ = _run_layers(layers, cfg, x, attend)
    return x, KVCache(k=ks, v=vs)


def run_layers_decode(
    layers: Layers, cfg: OPTConfig, x: jax.Array, positions: jax.Array, cache: KVCacheT
) -> tuple[jax.Array, KVCacheT]:
    """One token per row at `positions[b]` over a contiguous cache (`KVCache` or `DecodeCache`). x [B,1,h]."""
    if isinstance(cache, DecodeCache):
        return _run_layers_decode_head_major(layers, cfg, x, positions, cache)
    b = x.shape[0]
    s = cache.k.shape[2]
    old = (jnp.arange(s)[None, :] < positions[:, None])[:, None, :]  # [B, 1, S]: what the cache already holds
    self_mask = jnp.ones((b, 1, 1), bool)
    scale = cfg.head_dim**-0.5

    rows = jnp.arange(b)

    def attend(i: Any, q: jax.Array, k: jax.Array, v: jax.Array, c: KVCache) -> tuple[jax.Array, KVCache]:
        # write this layer's new K/V (a position past the cache writes nothing), then read the layer
        c = KVCache(
            k=c.k.at[i, rows, positions].set(k[:, 0], mode="drop"),
            v=c.v.at[i, rows, positions].set(v[:, 0], mode="drop"),
        )
        return _attention(q, [(c.k[i], c.v[i], old), (k, v, self_mask)], scale), c

    x, _, _, cache = _run_layers(layers, cfg, x, attend, cache)
    return x, cache


def _run_layers_decode_head_major(
    layers: Layers, cfg: OPTConfig, x: jax.Array, positions: jax.Array, cache: DecodeCache
) -> tuple[jax.Array, DecodeCache]:
    """`run_layers_decode` over a `DecodeCache`: unrolled over layers (stacked leaves are sliced per layer)."""
    b, nh, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    n, s = b * nh, cache.k[0].shape[1]
    pos = jnp.repeat(positions, nh)  # [B*H]: each (row, head) line's write position
    old = jnp.arange(s)[None, :] < pos[:, None]  # [B*H, S]
    scale = cfg.head_dim**-0.5
    lines = jnp.arange(n)
    per_layer = layers if isinstance(layers, Sequence) else unstack_layers(layers)

    def attend(i: Any, q: jax.Array, k: jax.Array, v: jax.Array, c: DecodeCache) -> tuple[jax.Array, DecodeCache]:
        k1, v1 = k.reshape(n, hd), v.reshape(n, hd)
        # write this layer's new K/V in place (a position past the cache writes nothing), then read the layer
        ki = c.k[i].at[lines, pos].set(k1, mode="drop")
        vi = c.v[i].at[lines, pos].set(v1, mode="drop")
        c = DecodeCache(k=(*c.k[:i], ki, *c.k[i + 1 :]), v=(*c.v[:i], vi, *c.v[i + 1 :]))
        new = (k1[:, None], v1[:, None], jnp.ones((n, 1), bool))  # the step's own token, [B*H, 1, D]
        o = _head_major_attention(q.reshape(n, hd), [(ki, vi, old), new], scale)
        return o.reshape(q.shape).astype(q.dtype), c

    x, _, _, cache = _run_layers(per_layer, cfg, x, attend, cache)
    return x, cache


def run_layers_paged(
    layers: Layers,
    cfg: OPTConfig,
    x: jax.Array,
    start_positions: jax.Array,
    lengths: jax.Array,
    cache: PagedKVCache,
    block_tables: jax.Array,
    attention: Impl = "xla",
    block_layout: BlockLayout | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """Append `lengths[b]` tokens per row into the pages `block_tables[b]` names, attend over the pages. x [B,T,h].

    The pool's blocks are read and written in `cache.block_layout` (`block_layout`, when given, must
    name the same layout).

    `attention` picks the decode (T == 1) attention of `models.paged_attention`; the XLA forms attend
    to the pages before `start_positions` and the new token as two parts of one softmax, a kernel
    reads the new token back from the pages it was just written to (so its position must lie inside
    the row's table). A chunked prefill (T > 1) always gathers the table's pages once per layer.
    """
    b, t, _ = x.shape
    layout = _pool_layout(cache, block_layout)
    heads = layout == "heads"  # pool blocks [H, bs, D] instead of [bs, H, D]
    num_blocks, bs = cache.num_blocks, cache.block_size
    m = block_tables.shape[1]
    nh, hd = cfg.num_heads, cfg.head_dim
    # what the pages already hold: positions before start (later slots may be stale)
    old = jnp.broadcast_to((jnp.arange(m * bs)[None, :] < start_positions[:, None])[:, None, :], (b, t, m * bs))
    new = jnp.broadcast_to(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], (b, t, t))  # causal among new tokens
    scale = cfg.head_dim**-0.5

    # Rows/columns that must not write point past the pool; mode="drop" discards them.
    qpos = start_positions[:, None] + jnp.arange(t)[None, :]  # [B, T]
    in_table = (jnp.arange(t)[None, :] < lengths[:, None]) & (qpos // bs < m)
    table_idx = jnp.clip(qpos // bs, 0, m - 1)
    write_block = jnp.where(in_table, jnp.take_along_axis(block_tables, table_idx, axis=1), num_blocks)
    write_slot = qpos % bs

    def attend(i: Any, q: jax.Array, k: jax.Array, v: jax.Array, c: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        if heads:  # index dims (block, slot) around a slice: the update is [B, T, H, D] as k is
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
        if t == 1 and attention == "pallas_gpu":  # the kernel reads the new token back from the pages
            o = paged_decode_attention(
                q[:, 0], c.k, c.v, block_tables, start_positions + lengths, scale=scale, impl=attention, layer=i,
                block_layout=layout,
            )  # fmt: skip
            return o[:, None].astype(q.dtype), c
        if t == 1:  # the pages before start and the new token in one softmax, the pool read in place
            o = paged_decode_attention(
                q[:, 0], c.k, c.v, block_tables, start_positions, scale=scale, impl=attention, layer=i,
                new_kv=(k[:, 0], v[:, 0]), block_layout=layout,
            )  # fmt: skip
            return o[:, None].astype(q.dtype), c
        # chunked prefill: one gather straight from the pool (no slice of layer i first: that would be a copy)
        keys, vals = c.k[i, block_tables], c.v[i, block_tables]  # [B, M, bs, H, D] (heads: [B, M, H, bs, D])
        if heads:
            keys, vals = jnp.swapaxes(keys, 2, 3), jnp.swapaxes(vals, 2, 3)
        keys = keys.reshape(b, m * bs, nh, hd)  # [B, S, H, D]
        vals = vals.reshape(b, m * bs, nh, hd)
        return _attention(q, [(keys, vals, old), (k, v, new)], scale), c

    x, _, _, cache = _run_layers(layers, cfg, x, attend, cache)
    return x, cache


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
    params: Params, cfg: OPTConfig, tokens: jax.Array, positions: jax.Array, cache: KVCacheT
) -> tuple[jax.Array, KVCacheT]:
    """One token per row: tokens/positions [B]; writes K/V at `positions[b]`, attends to 0..positions[b].

    `cache` is donated (updated in place). A position past the cache's length writes nothing.
    A `DecodeCache` (`DecodeCache.from_kv(prefill_kv, max_len)`) is the fast layout; a stacked
    `KVCache` [L,B,T,H,D] also works but slices and transposes each layer every step.
    """
    x = embed(params, cfg, tokens[:, None], positions[:, None])
    x, cache = run_layers_decode(params["layers"], cfg, x, positions, cache)
    return lm_head(params, cfg, x[:, 0]), cache


@partial(jax.jit, static_argnames=("cfg", "all_logits", "attention", "block_layout"), donate_argnames=("cache",))
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
    attention: Impl = "xla",
    block_layout: BlockLayout | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """Append tokens [B,T] (first `lengths[b]` valid) at `start_positions[b]..` into paged KV.

    Each new token attends to positions `< start_positions[b]` of its sequence's pages (slots past
    that are ignored, so a reused block needs no clearing) and causally to the new tokens. Logits
    at the last new token [B,V] (or all [B,T,V]). Rows with `lengths[b] == 0` write nothing.
    `cache` is donated (updated in place).
    """
    t = tokens.shape[1]
    positions = start_positions[:, None] + jnp.arange(t, dtype=start_positions.dtype)[None, :]
    x = embed(params, cfg, tokens, positions)
    x, cache = run_layers_paged(
        params["layers"], cfg, x, start_positions, lengths, cache, block_tables, attention, block_layout
    )
    if not all_logits:
        x = select_last(x, lengths)
    return lm_head(params, cfg, x), cache


@partial(jax.jit, static_argnames=("block_layout",), donate_argnames=("cache",))
def insert_into_pages(
    cache: PagedKVCache,
    kv: KVCache,
    block_tables: jax.Array,
    lengths: jax.Array,
    start_positions: jax.Array | None = None,
    block_layout: BlockLayout | None = None,
) -> PagedKVCache:
    """Copy positions `0..lengths[b]-1` of a contiguous `kv` [L,B,T,H,D] into the pages of `block_tables` [B,M].

    The decode side's "insert" of a pulled prefill KV. Positions beyond `lengths[b]` are not written.
    `start_positions` (default 0) offsets where row b's positions land in its pages. `cache` is donated.
    """
    _, b, t, _, _ = kv.k.shape
    heads = _pool_layout(cache, block_layout) == "heads"
    num_blocks, bs = cache.num_blocks, cache.block_size
    m = block_tables.shape[1]
    start = jnp.zeros((b,), jnp.int32) if start_positions is None else start_positions
    pos = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    valid = (jnp.arange(t)[None, :] < lengths[:, None]) & (pos // bs < m)
    blk = jnp.where(valid, jnp.take_along_axis(block_tables, jnp.clip(pos // bs, 0, m - 1), axis=1), num_blocks)
    slot = pos % bs
    if heads:  # index dims (block, slot) around slices go first: the update is [B, T, L, H, D]
        k = cache.k.at[:, blk, :, slot].set(jnp.moveaxis(kv.k, 0, 2).astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, blk, :, slot].set(jnp.moveaxis(kv.v, 0, 2).astype(cache.v.dtype), mode="drop")
    else:
        k = cache.k.at[:, blk, slot].set(kv.k.astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, blk, slot].set(kv.v.astype(cache.v.dtype), mode="drop")
    return PagedKVCache(k=k, v=v, block_layout=cache.block_layout)


def _pool_layout(cache: PagedKVCache, block_layout: BlockLayout | None) -> BlockLayout:
    """The pool's own layout; a caller that names one must name the same (a mismatch would misread every block)."""
    if block_layout is not None and block_layout != cache.block_layout:
        raise ValueError(f"block_layout={block_layout!r} but the pool's blocks are {cache.block_layout!r}")
    return cache.block_layout


def num_params(params: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
