"""Llama-style decoders (Llama 3 with RoPE scaling, Qwen2's biases, Mistral; GQA / MQA / MHA; tied or untied
head) as `flax.nnx` modules, equal to Hugging Face's `*ForCausalLM`.

`Llama` is the model, or a pipeline stage of it; `LlamaLayer` one pre-norm decoder layer: RMSNorm, q/k/v
projections, RoPE, the shared KV layer's attention (`models.attention`: caches, grouped-query attention), o,
and the SwiGLU MLP. The config mapping is `models.config.LlamaConfig`; everything else (the step kinds, the
sharding, the loaders) is shared with `models.opt`.

Module state (`h` hidden, `f` intermediate, `q = num_heads * head_dim`, `k = kv_heads * head_dim`; the
checkpoint layout of `models.params` stacks the layer leaves `[L, ...]` and stores the one-weight modules bare)::

    embed_tokens      {embedding [V, h]}
    lm_head           {embedding [V, h]}  only when the head is untied (else embed_tokens is the head)
    norm              {scale [h]}     final RMSNorm
    layers/N:
      input_layernorm          {scale [h]}
      q_proj {kernel [h, q], bias [q]}    biases only with cfg.qkv_bias (Qwen2)
      k_proj {kernel [h, k], bias [k]}    (q/k/v one `qkv_proj` on a one-device stage)
      v_proj {kernel [h, k], bias [k]}
      o_proj {kernel [q, h], bias [h]}    bias only with cfg.o_bias
      post_attention_layernorm {scale [h]}
      gate_proj / up_proj {kernel [h, f]}  (one `gate_up_proj` on a one-device stage)
      down_proj           {kernel [f, h]}

Kernels are `[in, out]` (Hugging Face Linear weights transposed); the LM head stays `[V, h]` as the embedding
is, so both heads are read by the same product.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import attention as kv
from models import decoder, layers
from models.config import LlamaConfig

# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The model: Llama-style layers as `flax.nnx` modules (attention and the KV cache are `models.attention`'s)
# --------------------------------------------------------------------------------------------


class LlamaLayer(nnx.Module):
    """One pre-norm decoder layer: RMSNorm, q/k/v (GQA), RoPE, the shared KV layer's `attend`, o, SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig, *, fused: bool, dtype: Any, rngs: nnx.Rngs) -> None:
        h, f, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.input_layernorm = layers.RMSNorm(h, eps, dtype=dtype, rngs=rngs)
        layers.add_projections(
            self, h, _qkv_parts(cfg), "qkv_proj", bias=cfg.qkv_bias, fused=fused, dtype=dtype, rngs=rngs
        )
        self.o_proj = layers.linear(cfg.q_dim, h, ("heads", "embed"), bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = layers.RMSNorm(h, eps, dtype=dtype, rngs=rngs)
        layers.add_projections(
            self, h, _gate_up_parts(cfg), "gate_up_proj", bias=False, fused=fused, dtype=dtype, rngs=rngs
        )
        self.down_proj = layers.linear(f, h, ("mlp", "embed"), bias=False, dtype=dtype, rngs=rngs)

    def __call__(
        self, h: jax.Array, i: Any, attend: kv.Attend, c: Any, rope: tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, Any, tuple[jax.Array, jax.Array]]:
        """h [B,T,h] -> (h, cache, (k, v) [B,T,KVH,D]); K is cached after RoPE (as Hugging Face caches it)."""
        b, t, _ = h.shape
        nh, kvh, hd = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        cos, sin = rope
        y = self.input_layernorm(h)
        q, k, v = layers.project(self, y, _qkv_parts(self.cfg), "qkv_proj")  # one matmul where fused
        q = apply_rope(q.reshape(b, t, nh, hd), cos, sin)  # [B, T, H, D]
        k = apply_rope(k.reshape(b, t, kvh, hd), cos, sin)  # [B, T, KVH, D]
        v = v.reshape(b, t, kvh, hd)
        o, c = attend(i, q, k, v, c)
        h = h + self.o_proj(o.reshape(b, t, nh * hd))
        y = self.post_attention_layernorm(h)
        gate, up = layers.project(self, y, _gate_up_parts(self.cfg), "gate_up_proj")
        return h + self.down_proj(jax.nn.silu(gate) * up), c, (k, v)  # SwiGLU


class Llama(nnx.Module):
    """A Llama-style model (Llama, Qwen2, Mistral), or a pipeline stage of it: `num_layers` decoder layers,
    `embed_tokens` on the first stage, the final RMSNorm and the head on the last (`embed_tokens` itself when
    the head is tied, `lm_head` [V, h] when not). The shared skeleton (`models.decoder`) runs it.
    """

    HF_NAMING: ClassVar[decoder.HFNaming]

    def __init__(
        self,
        cfg: LlamaConfig,
        stage: layers.Stage = layers.WHOLE,
        *,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        h = cfg.hidden_size
        first, last, fused = stage.first, stage.last, stage.fused
        self.cfg, self.first, self.last = cfg, first, last
        if first or (last and cfg.tie_word_embeddings):
            self.embed_tokens = layers.embed(cfg.vocab_size, h, ("vocab", "embed"), dtype=dtype, rngs=rngs)
        n = cfg.num_layers if stage.num_layers is None else stage.num_layers
        self.layers = nnx.List([LlamaLayer(cfg, fused=fused, dtype=dtype, rngs=rngs) for _ in range(n)])
        if last:
            self.norm = layers.RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
            if not cfg.tie_word_embeddings:  # [V, h] as the embedding is, so both heads are read by one product
                self.lm_head = layers.embed(cfg.vocab_size, h, ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Token embeddings (first stage; RoPE acts inside attention). tokens [B, T] -> [B, T, h]."""
        del positions
        return self.embed_tokens(tokens)

    def layer_context(self, positions: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
        """The RoPE tables of a step whose new tokens sit at `positions` [B, T]: built once, read by every layer."""
        return rope_tables(self.cfg, positions, dtype)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final RMSNorm and the LM head (last stage): [..., h] -> float32 logits [..., V]."""
        head = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
        return layers.tied_logits(head.embedding.get_value(), self.norm(x))


def _qkv_parts(cfg: LlamaConfig) -> tuple[tuple[str, int, str], ...]:
    return (("q_proj", cfg.q_dim, "heads"), ("k_proj", cfg.kv_dim, "kv_heads"), ("v_proj", cfg.kv_dim, "kv_heads"))


def _gate_up_parts(cfg: LlamaConfig) -> tuple[tuple[str, int, str], ...]:
    return (("gate_proj", cfg.intermediate_size, "mlp"), ("up_proj", cfg.intermediate_size, "mlp"))


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
Llama.HF_NAMING = HF_NAMING = decoder.HFNaming(("model.", ""), _HF_LAYER, _HF_TOP, frozenset({("lm_head",)}))
