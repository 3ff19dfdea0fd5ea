"""OPT as `flax.nnx` modules, numerically equal to Hugging Face's `OPTForCausalLM` (pre- and post-LayerNorm).

`OPT` is the model, or a pipeline stage of it (`num_layers` decoder layers; embeddings on the first stage, the
final LayerNorm / `project_out` and the tied head on the last); `OPTLayer` one decoder layer. Every
parameter carries its logical axes (`models.layers`); `models.sharding` maps them onto a phase's mesh. The
KV cache is the shared KV layer's (`models.attention`), passed in and returned, never module state; the
step kinds (prefill, decode, paged) are the shared skeleton's (`models.decoder`), run over the split module
state by `models.sharding.ShardedModel` and, over a checkpoint-layout tree, by `models.steps`.

Module state / checkpoint layout (`models.params`; `E = cfg.embed_dim`, `h = cfg.hidden_size`,
`f = cfg.ffn_dim`; the checkpoint layout stacks each layer leaf `[L, ...]` and stores the one-weight
modules bare)::

    embed_tokens      {embedding [V, E]}  tied LM head
    embed_positions   {embedding [P + 2, h]}  position p reads row p + 2
    project_in        {kernel [E, h]}     only when E != h (opt-350m)
    project_out       {kernel [h, E]}     only when E != h
    final_layer_norm  {scale, bias}   [h]; only for pre-LN models
    layers/N:
      self_attn_layer_norm {scale, bias}  [h]
      q_proj / k_proj / v_proj {kernel [h, h], bias [h]}   (one `qkv_proj` on a one-device stage)
      out_proj            {kernel [h, h], bias [h]}
      final_layer_norm    {scale, bias}   [h]
      fc1                 {kernel [h, f], bias [f]}
      fc2                 {kernel [f, h], bias [h]}

Kernels are `[in, out]` (Hugging Face Linear weights transposed).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import attention as kv
from models import decoder, layers
from models.config import OPT_POSITION_OFFSET, OPTConfig
from models.decoder import Params

# --------------------------------------------------------------------------------------------
# The model: OPT's layers as `flax.nnx` modules (attention and the KV cache are `models.attention`'s)
# --------------------------------------------------------------------------------------------


class OPTLayer(nnx.Module):
    """One OPT decoder layer (pre- or post-LayerNorm); the shared KV layer's `attend` reads and writes the cache."""

    def __init__(self, cfg: OPTConfig, *, fused: bool, dtype: Any, rngs: nnx.Rngs) -> None:
        h, f, eps = cfg.hidden_size, cfg.ffn_dim, cfg.layer_norm_eps
        self.cfg = cfg
        self.self_attn_layer_norm = layers.LayerNorm(h, eps, dtype=dtype, rngs=rngs)
        layers.add_projections(self, h, _qkv_parts(cfg), "qkv_proj", bias=True, fused=fused, dtype=dtype, rngs=rngs)
        self.out_proj = layers.linear(h, h, ("heads", "embed"), bias=True, dtype=dtype, rngs=rngs)
        self.final_layer_norm = layers.LayerNorm(h, eps, dtype=dtype, rngs=rngs)
        self.fc1 = layers.linear(h, f, ("embed", "mlp"), bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = layers.linear(f, h, ("mlp", "embed"), bias=True, dtype=dtype, rngs=rngs)

    def __call__(
        self, h: jax.Array, i: Any, attend: kv.Attend, c: Any, context: None
    ) -> tuple[jax.Array, Any, tuple[jax.Array, jax.Array]]:
        """h [B,T,h] -> (h, cache, (k, v) [B,T,H,D]); `context` is unused (OPT's positions enter at `embed`)."""
        del context
        b, t, _ = h.shape
        nh, hd, pre_ln = self.cfg.num_heads, self.cfg.head_dim, self.cfg.do_layer_norm_before
        residual = h
        y = self.self_attn_layer_norm(h) if pre_ln else h
        q, k, v = layers.project(self, y, _qkv_parts(self.cfg), "qkv_proj")  # one matmul where fused
        q, k, v = (x.reshape(b, t, nh, hd) for x in (q, k, v))
        o, c = attend(i, q, k, v, c)
        h = residual + self.out_proj(o.reshape(b, t, nh * hd))
        if not pre_ln:
            h = self.self_attn_layer_norm(h)
        residual = h
        y = self.final_layer_norm(h) if pre_ln else h
        h = residual + self.fc2(jax.nn.relu(self.fc1(y)))
        if not pre_ln:
            h = self.final_layer_norm(h)
        return h, c, (k, v)


class OPT(nnx.Module):
    """OPT (`OPTForCausalLM`), or a pipeline stage of it: `num_layers` decoder layers, the embeddings on the first
    stage, the final LayerNorm / `project_out` and the tied head (a copy of `embed_tokens`) on the last.

    The shared skeleton (`models.decoder`) runs it: `embed`, the `layers`, `lm_head`.
    """

    HF_NAMING: ClassVar[decoder.HFNaming]
    ZERO_BIASES: ClassVar[bool] = True  # random init (`models.params.init_params`) as Hugging Face's: zero biases

    def __init__(
        self,
        cfg: OPTConfig,
        stage: layers.Stage = layers.WHOLE,
        *,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        h, e = cfg.hidden_size, cfg.embed_dim
        first, last, fused = stage.first, stage.last, stage.fused
        self.cfg, self.first, self.last = cfg, first, last
        if first or last:
            self.embed_tokens = layers.embed(cfg.vocab_size, e, ("vocab", "embed"), dtype=dtype, rngs=rngs)
        if first:
            positions = cfg.max_position_embeddings + OPT_POSITION_OFFSET
            self.embed_positions = layers.embed(positions, h, ("positions", "embed"), dtype=dtype, rngs=rngs)
            if cfg.has_projections:
                self.project_in = layers.linear(e, h, ("embed", "embed"), bias=False, dtype=dtype, rngs=rngs)
        n = cfg.num_layers if stage.num_layers is None else stage.num_layers
        self.layers = nnx.List([OPTLayer(cfg, fused=fused, dtype=dtype, rngs=rngs) for _ in range(n)])
        if last:
            if cfg.has_final_layer_norm:
                self.final_layer_norm = layers.LayerNorm(h, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)
            if cfg.has_projections:
                self.project_out = layers.linear(h, e, ("embed", "embed"), bias=False, dtype=dtype, rngs=rngs)

    def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Token + learned position embeddings (first stage). tokens/positions [B, T] -> [B, T, h]."""
        x = self.embed_tokens(tokens)  # [B, T, E]
        if hasattr(self, "project_in"):
            x = self.project_in(x)  # [B, T, h]
        table = self.embed_positions.embedding[...]
        pos = jnp.take(table, positions + OPT_POSITION_OFFSET, axis=0, mode="clip")
        return x + pos.astype(x.dtype)

    def layer_context(self, positions: jax.Array, dtype: Any) -> None:
        """What every layer of a step shares: nothing (OPT's positions enter at `embed`)."""
        del positions, dtype

    def logits(self, x: jax.Array) -> jax.Array:
        """Final LayerNorm (pre-LN), `project_out` (opt-350m) and the tied head: [..., h] -> float32 logits [..., V]."""
        if hasattr(self, "final_layer_norm"):
            x = self.final_layer_norm(x)
        if hasattr(self, "project_out"):
            x = self.project_out(x)
        return layers.tied_logits(self.embed_tokens.embedding.get_value(), x)


def _qkv_parts(cfg: OPTConfig) -> tuple[tuple[str, int, str], ...]:
    # OPT has as many K/V heads as query heads; k/v are still named `kv_heads` (split the same way as q).
    width = cfg.num_heads * cfg.head_dim
    return (("q_proj", width, "heads"), ("k_proj", width, "kv_heads"), ("v_proj", width, "kv_heads"))


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
OPT.HF_NAMING = HF_NAMING = decoder.HFNaming(("model.decoder.", "decoder."), _HF_LAYER, _HF_TOP)
