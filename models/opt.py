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

Kernels are `[in, out]` (Hugging Face Linear weights transposed). This file holds OPT's layers only:
its embedding (tokens + learned positions), its decoder layer body and its tied LM head. The caches,
attention and the step kinds are the shared KV layer's (`models.attention`: `KVCache`, `DecodeCache`,
`PagedKVCache`, `insert_into_pages`, ... are imported from there); the forward passes are the shared
skeleton's (`models.decoder`), bound here to OPT's pieces:

* `prefill`  — right-padded prompts `[B, T]`, returns a contiguous `KVCache` `[L, B, T, H, D]`;
* `decode`   — one token per sequence at its own position, over a contiguous `KVCache`;
* `extend_paged` — `T >= 1` new tokens per sequence appended into a block pool (`PagedKVCache`)
  addressed by block tables; `T == 1` is a paged decode step, `T > 1` a chunked prefill.

Layers given as one dict per layer (`unstack_layers`, the serving layout of
`models.sharding.ShardedOPT`) run as an unrolled loop that reads every weight in place; stacked
leaves run as a `lax.scan` (slices of stacked weights are copies on XLA:CPU, so that form is for
tests and tools).

Stage pieces for pipeline parallelism: `embed`, `run_layers_prefill`, `run_layers_decode`,
`run_layers_paged`, `final_hidden`, `lm_head`, `stage_params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models import attention as kv
from models import decoder
from models.config import OPT_POSITION_OFFSET, OPTConfig
from models.decoder import COLUMN_BIAS, COLUMN_KERNEL, ROW_KERNEL, Params


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


def param_specs(cfg: OPTConfig, first: bool, last: bool, kv_split: bool) -> dict[str, Any]:
    """PartitionSpecs of a stage's param tree (the structure of `stage_params`; `models.sharding` places by it).

    q/k/v and fc1 column-parallel, out_proj and fc2 row-parallel (their biases replicated, added after the
    all-reduce); LayerNorms, embeddings and the tied head replicated. OPT has as many K/V heads as query
    heads, so `kv_split` is always true.
    """
    del kv_split
    col, row, ln = (
        {"kernel": COLUMN_KERNEL, "bias": COLUMN_BIAS},
        {"kernel": ROW_KERNEL, "bias": P()},
        {"scale": P(), "bias": P()},
    )
    layers = {"q_proj": col, "k_proj": col, "v_proj": col, "out_proj": row, "fc1": col, "fc2": row}
    specs: dict[str, Any] = {"layers": {**layers, "self_attn_layer_norm": ln, "final_layer_norm": ln}}
    if first or last:
        specs["embed_tokens"] = P()
    if first:
        specs["embed_positions"] = P()
        if cfg.has_projections:
            specs["project_in"] = P()
    if last:
        if cfg.has_projections:
            specs["project_out"] = P()
        if cfg.has_final_layer_norm:
            specs["final_layer_norm"] = ln
    return specs


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


# --------------------------------------------------------------------------------------------
# The decoder layer (attention and the KV cache are `models.attention`'s)
# --------------------------------------------------------------------------------------------


def _layer(
    lp: Mapping[str, Any], h: jax.Array, i: Any, attend: kv.Attend, c: Any, *, cfg: OPTConfig
) -> tuple[jax.Array, Any, tuple[jax.Array, jax.Array]]:
    """One OPT decoder layer over h [B,T,h] (pre-LN or post-LN); `attend` reads and writes the cache."""
    b, t, _ = h.shape
    nh, hd, eps = cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps
    pre_ln = cfg.do_layer_norm_before
    residual = h
    y = _layer_norm(h, lp["self_attn_layer_norm"], eps) if pre_ln else h
    q, k, v = kv.projections(y, lp, "qkv_proj", _qkv_parts(cfg))  # one matmul where fused (`fuse_layer`)
    q, k, v = (x.reshape(b, t, nh, hd) for x in (q, k, v))
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
    return h, c, (k, v)


def layer(cfg: OPTConfig, positions: jax.Array, dtype: Any) -> kv.LayerFn:
    """The layer body of a step (`decoder.Decoder.layer`); OPT's positions enter at `embed`, not here."""
    del positions, dtype
    return partial(_layer, cfg=cfg)


# q/k/v fused into one matmul in the serving layout of a one-device stage (`fuse_layer`).
FUSIONS: kv.Fusions = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}


def _qkv_parts(cfg: OPTConfig) -> tuple[tuple[str, int], ...]:
    return tuple((name, cfg.num_heads * cfg.head_dim) for name in ("q_proj", "k_proj", "v_proj"))


def fuse_layer(lp: Mapping[str, Any], cfg: OPTConfig) -> dict[str, Any]:
    """One layer's params with q/k/v as one matmul (`attention.fuse_projections`)."""
    del cfg
    return kv.fuse_projections(lp, FUSIONS)


def unfuse_layer(lp: Mapping[str, Any], cfg: OPTConfig) -> dict[str, Any]:
    """The inverse of `fuse_layer` (the layout checkpoints hold)."""
    return kv.unfuse_projections(lp, FUSIONS, dict(_qkv_parts(cfg)))


# --------------------------------------------------------------------------------------------
# Forward passes: the shared skeleton (`models.decoder`) over this file's embed, layer and head
# --------------------------------------------------------------------------------------------

DECODER = decoder.Decoder(embed=embed, layer=layer, lm_head=lm_head)
run_layers_prefill = DECODER.run_layers_prefill
run_layers_decode = DECODER.run_layers_decode
run_layers_paged = DECODER.run_layers_paged
prefill, decode, extend_paged = decoder.jit_entry_points(DECODER)


def num_params(params: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


# --------------------------------------------------------------------------------------------
# Hugging Face tensor names (`models.checkpoint` reads a checkpoint through them)
# --------------------------------------------------------------------------------------------
_HF_LAYER: dict[tuple[str, str], tuple[str, bool]] = {
    # (our module, our leaf) -> (HF suffix after "layers.N.", transpose)
    ("q_proj", "kernel"): ("self_attn.q_proj.weight", True),
    ("q_proj", "bias"): ("self_attn.q_proj.bias", False),
    ("k_proj", "kernel"): ("self_attn.k_proj.weight", True),
    ("k_proj", "bias"): ("self_attn.k_proj.bias", False),
    ("v_proj", "kernel"): ("self_attn.v_proj.weight", True),
    ("v_proj", "bias"): ("self_attn.v_proj.bias", False),
    ("out_proj", "kernel"): ("self_attn.out_proj.weight", True),
    ("out_proj", "bias"): ("self_attn.out_proj.bias", False),
    ("fc1", "kernel"): ("fc1.weight", True),
    ("fc1", "bias"): ("fc1.bias", False),
    ("fc2", "kernel"): ("fc2.weight", True),
    ("fc2", "bias"): ("fc2.bias", False),
    ("self_attn_layer_norm", "scale"): ("self_attn_layer_norm.weight", False),
    ("self_attn_layer_norm", "bias"): ("self_attn_layer_norm.bias", False),
    ("final_layer_norm", "scale"): ("final_layer_norm.weight", False),
    ("final_layer_norm", "bias"): ("final_layer_norm.bias", False),
}
_HF_TOP: dict[tuple[str, ...], tuple[str, bool]] = {
    ("embed_tokens",): ("embed_tokens.weight", False),
    ("embed_positions",): ("embed_positions.weight", False),
    ("project_in",): ("project_in.weight", True),
    ("project_out",): ("project_out.weight", True),
    ("final_layer_norm", "scale"): ("final_layer_norm.weight", False),
    ("final_layer_norm", "bias"): ("final_layer_norm.bias", False),
}
HF_NAMING = decoder.HFNaming(("model.decoder.", "decoder."), _HF_LAYER, _HF_TOP)
