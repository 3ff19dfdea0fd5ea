"""Llama-style decoders (Llama, Qwen2, Mistral) as pure JAX functions, equal to Hugging Face's `*ForCausalLM`.

The family's layers only: RMSNorm, RoPE, the SwiGLU MLP and a layer body that projects q/k/v and
hands them to the shared KV layer (`models.attention`), which owns the caches, how a step writes
and reads K/V, and grouped-query attention. The config mapping is `models.config.LlamaConfig`.
The functions have `models.opt`'s signatures, so whatever drives OPT (a pipeline stage, an engine)
drives these the same way.

Param tree (`h` hidden, `f` intermediate, `q = num_heads * head_dim`, `k = kv_heads * head_dim`)::

    embed_tokens      [V, h]
    lm_head           [V, h]          only when the head is untied (else embed_tokens is the head)
    norm              {scale [h]}     final RMSNorm
    layers:
      input_layernorm          {scale [L, h]}
      q_proj {kernel [L, h, q], bias [L, q]}    biases only with cfg.qkv_bias (Qwen2)
      k_proj {kernel [L, h, k], bias [L, k]}
      v_proj {kernel [L, h, k], bias [L, k]}
      o_proj {kernel [L, q, h], bias [L, h]}    bias only with cfg.o_bias
      post_attention_layernorm {scale [L, h]}
      gate_proj / up_proj {kernel [L, h, f]}
      down_proj           {kernel [L, f, h]}

Kernels are `[in, out]` (Hugging Face Linear weights transposed); the LM head stays `[V, h]` as
the embedding is, so both heads are read by the same product.

The forward passes are the shared skeleton's (`models.decoder`) bound to this file's `embed`,
`layer` and `lm_head`, as in `models.opt`: `prefill`, `decode` (contiguous `KVCache` or
`DecodeCache`), `extend_paged` (a `PagedKVCache` block pool; T == 1 decode, T > 1 chunked prefill); stage
pieces `embed`, `run_layers_prefill`, `run_layers_decode`,
`run_layers_paged`, `lm_head`, `stage_params`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models import attention as kv
from models import decoder
from models.config import LlamaConfig
from models.decoder import COLUMN_BIAS, COLUMN_KERNEL, ROW_KERNEL, Params

# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def param_shapes(cfg: LlamaConfig, num_layers: int | None = None) -> dict[str, Any]:
    """The param tree with a shape tuple at every leaf (the layout `init_params` and loaders produce)."""
    h, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers if num_layers is None else num_layers

    def linear(i: int, o: int, bias: bool) -> dict[str, tuple[int, ...]]:
        return {"kernel": (n, i, o), "bias": (n, o)} if bias else {"kernel": (n, i, o)}

    shapes: dict[str, Any] = {
        "embed_tokens": (cfg.vocab_size, h),
        "norm": {"scale": (h,)},
        "layers": {
            "input_layernorm": {"scale": (n, h)},
            "q_proj": linear(h, cfg.q_dim, cfg.qkv_bias),
            "k_proj": linear(h, cfg.kv_dim, cfg.qkv_bias),
            "v_proj": linear(h, cfg.kv_dim, cfg.qkv_bias),
            "o_proj": linear(cfg.q_dim, h, cfg.o_bias),
            "post_attention_layernorm": {"scale": (n, h)},
            "gate_proj": linear(h, f, False),
            "up_proj": linear(h, f, False),
            "down_proj": linear(f, h, False),
        },
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    return shapes


def init_params(cfg: LlamaConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random weights (normal(0, 0.02) matrices, small random biases, unit RMSNorm scales)."""
    dtype = jnp.dtype(dtype)
    leaves, treedef = jax.tree.flatten_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(leaves, keys, strict=True):
        if "scale" in jax.tree_util.keystr(path):
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def param_specs(cfg: LlamaConfig, first: bool, last: bool, kv_split: bool) -> dict[str, Any]:
    """PartitionSpecs of a stage's param tree (the structure of `stage_params`; `models.sharding` places by it).

    q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel, RMSNorm scales and the head
    replicated; k/v replicated too when `kv_split` is false (tp a multiple of the K/V heads).
    """
    col, row = {"kernel": COLUMN_KERNEL, "bias": COLUMN_BIAS}, {"kernel": ROW_KERNEL}
    kv_spec = col if kv_split else {"kernel": P(), "bias": P()}

    def keep(spec: dict[str, P], bias: bool) -> dict[str, P]:
        return spec if bias else {"kernel": spec["kernel"]}

    specs: dict[str, Any] = {
        "layers": {
            "input_layernorm": {"scale": P()},
            "q_proj": keep(col, cfg.qkv_bias),
            "k_proj": keep(kv_spec, cfg.qkv_bias),
            "v_proj": keep(kv_spec, cfg.qkv_bias),
            "o_proj": {**row, "bias": P()} if cfg.o_bias else row,
            "post_attention_layernorm": {"scale": P()},
            "gate_proj": keep(col, False),
            "up_proj": keep(col, False),
            "down_proj": row,
        }
    }
    if first or (last and cfg.tie_word_embeddings):
        specs["embed_tokens"] = P()
    if last:
        specs["norm"] = {"scale": P()}
        if not cfg.tie_word_embeddings:
            specs["lm_head"] = P()
    return specs


def stage_params(params: Params, cfg: LlamaConfig, start: int, end: int) -> Params:
    """The part of `params` a pipeline stage holding layers `[start, end)` needs.

    The first stage keeps `embed_tokens`; the last the final norm and the LM head (`embed_tokens`
    itself when the head is tied).
    """
    first, last = start == 0, end == cfg.num_layers
    out: Params = {"layers": jax.tree.map(lambda x: x[start:end], params["layers"])}
    if first or (last and cfg.tie_word_embeddings):
        out["embed_tokens"] = params["embed_tokens"]
    if last:
        out["norm"] = params["norm"]
        if not cfg.tie_word_embeddings:
            out["lm_head"] = params["lm_head"]
    return out


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, p: Mapping[str, Any], eps: float) -> jax.Array:
    """Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale (in that order)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return p["scale"] * y.astype(x.dtype)


def _linear(x: jax.Array, p: Mapping[str, Any]) -> jax.Array:
    y = jnp.dot(x, p["kernel"])
    return y + p["bias"] if "bias" in p else y


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] of RoPE with `cfg.rope_theta` and `cfg.rope_scaling` (float32).

    "linear" divides every frequency by `factor` (positions / factor); "llama3" divides the low
    frequencies (wavelength above original_max / low_freq_factor) by `factor`, keeps the high ones
    (wavelength below original_max / high_freq_factor) and interpolates between them, as
    transformers' `_compute_llama3_parameters` does.
    """
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    if rs.rope_type == "linear":
        return (inv_freq / rs.factor).astype(np.float32)
    old_len = rs.original_max_position_embeddings
    low_freq_wavelen = old_len / rs.low_freq_factor
    high_freq_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: LlamaConfig, positions: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim] for integer positions [B, T] (angles in float32, then cast to `dtype`)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, D]: the halves layout of rotate_half
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, D] by position: x * cos + rotate_half(x) * sin (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def embed(params: Params, cfg: LlamaConfig, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """Token embeddings (first pipeline stage; RoPE acts inside attention). tokens [B, T] -> [B, T, h].

    `positions` is unused: taken so a stage calls `embed` of either family the same way.
    """
    del positions
    return jnp.take(params["embed_tokens"], tokens, axis=0)


def lm_head(params: Params, cfg: LlamaConfig, x: jax.Array) -> jax.Array:
    """Final RMSNorm and the LM head (last pipeline stage): [..., h] -> float32 logits [..., V]."""
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    head = params["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]  # [V, h]
    flat = x.reshape(-1, x.shape[-1])  # [N, h]; [V, h] @ [h, N] so XLA:CPU does not materialise head.T
    logits = jnp.dot(head, flat.T, preferred_element_type=jnp.float32).T  # [N, V]
    return logits.reshape(*x.shape[:-1], logits.shape[-1])


# --------------------------------------------------------------------------------------------
# The decoder layer (attention and the KV cache are `models.attention`'s)
# --------------------------------------------------------------------------------------------


def _layer(
    lp: Mapping[str, Any],
    h: jax.Array,
    i: Any,
    attend: kv.Attend,
    c: Any,
    *,
    cfg: LlamaConfig,
    rope: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, Any, tuple[jax.Array, jax.Array]]:
    """One pre-norm decoder layer over h [B,T,h]; K is cached after RoPE (as Hugging Face caches it)."""
    b, t, _ = h.shape
    nh, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = rope
    y = rms_norm(h, lp["input_layernorm"], eps)
    q, k, v = kv.projections(y, lp, "qkv_proj", _qkv_parts(cfg))  # one matmul where fused (`fuse_layer`)
    q = apply_rope(q.reshape(b, t, nh, hd), cos, sin)  # [B, T, H, D]
    k = apply_rope(k.reshape(b, t, kvh, hd), cos, sin)  # [B, T, KVH, D]
    v = v.reshape(b, t, kvh, hd)
    o, c = attend(i, q, k, v, c)
    h = h + _linear(o.reshape(b, t, nh * hd), lp["o_proj"])
    y = rms_norm(h, lp["post_attention_layernorm"], eps)
    gate, up = kv.projections(y, lp, "gate_up_proj", _gate_up_parts(cfg))
    y = jax.nn.silu(gate) * up  # SwiGLU
    return h + _linear(y, lp["down_proj"]), c, (k, v)


def layer(cfg: LlamaConfig, positions: jax.Array, dtype: Any) -> kv.LayerFn:
    """The layer body of a step whose new tokens sit at `positions` [B, T]: RoPE tables built once for all layers."""
    return partial(_layer, cfg=cfg, rope=rope_tables(cfg, positions, dtype))


# Projections of one input, fused into one matmul in the serving layout of a one-device stage (`fuse_layer`).
FUSIONS: kv.Fusions = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _qkv_parts(cfg: LlamaConfig) -> tuple[tuple[str, int], ...]:
    return (("q_proj", cfg.q_dim), ("k_proj", cfg.kv_dim), ("v_proj", cfg.kv_dim))


def _gate_up_parts(cfg: LlamaConfig) -> tuple[tuple[str, int], ...]:
    return (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))


def fuse_layer(lp: Mapping[str, Any], cfg: LlamaConfig) -> dict[str, Any]:
    """One layer's params with q/k/v and gate/up each as one matmul (`attention.fuse_projections`)."""
    del cfg
    return kv.fuse_projections(lp, FUSIONS)


def unfuse_layer(lp: Mapping[str, Any], cfg: LlamaConfig) -> dict[str, Any]:
    """The inverse of `fuse_layer` (the layout checkpoints hold)."""
    return kv.unfuse_projections(lp, FUSIONS, dict(_qkv_parts(cfg) + _gate_up_parts(cfg)))


# --------------------------------------------------------------------------------------------
# Forward passes: the shared skeleton (`models.decoder`) over this file's embed, layer and head
# --------------------------------------------------------------------------------------------

DECODER = decoder.Decoder(embed=embed, layer=layer, lm_head=lm_head)
run_layers_prefill = DECODER.run_layers_prefill
run_layers_decode = DECODER.run_layers_decode
run_layers_paged = DECODER.run_layers_paged
prefill, decode, extend_paged = decoder.jit_entry_points(DECODER)


# --------------------------------------------------------------------------------------------
# Hugging Face tensor names (`models.checkpoint` reads a checkpoint through them)
# --------------------------------------------------------------------------------------------
_HF_LAYER: dict[tuple[str, str], tuple[str, bool]] = {
    ("input_layernorm", "scale"): ("input_layernorm.weight", False),
    ("post_attention_layernorm", "scale"): ("post_attention_layernorm.weight", False),
    **{(m, "kernel"): (f"self_attn.{m}.weight", True) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{(m, "bias"): (f"self_attn.{m}.bias", False) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{(m, "kernel"): (f"mlp.{m}.weight", True) for m in ("gate_proj", "up_proj", "down_proj")},
}
_HF_TOP: dict[tuple[str, ...], tuple[str, bool]] = {
    ("embed_tokens",): ("embed_tokens.weight", False),
    ("norm", "scale"): ("norm.weight", False),
    ("lm_head",): ("lm_head.weight", False),  # [V, h] as our head is: no transpose
}
HF_NAMING = decoder.HFNaming(("model.", ""), _HF_LAYER, _HF_TOP, frozenset({("lm_head",)}))
