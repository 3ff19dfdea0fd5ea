"""The layers every family builds from, as `flax.nnx` modules whose parameters carry logical axis names.

Each parameter is created with a `logical_axes` metadata tuple (one name per dimension); which mesh axis a
name is split over is decided in one place, `models.sharding.LOGICAL_AXIS_RULES`, per phase mesh, never
here. The names:

* `vocab`, `embed`, `positions` — embedding rows, the hidden width, learned positions (replicated);
* `heads` — query-head columns (q, a column-parallel bias; o's rows); `kv_heads` — K/V-head columns
  (split like `heads` where tp divides the K/V heads, replicated where tp is a multiple of them);
* `mlp` — the feed-forward width; `fused` — the columns of projections fused into one matmul (only on
  a one-device stage, so never split).

Linear layers and embeddings are Flax's own (`nnx.Linear`, `nnx.Embed`; kernels `[in, out]`), each with one
addition: its weight may be a `models.quant.QuantizedWeight` (a GGUF served as stored, `--quantization
int8|int4`: `models.quantize`), which the layer multiplies with `quant_matmul` (dequantized in registers by the
CPU kernel) or reads row by row (`embed_rows`), never materialising the float weight. The norms are
ours: Flax's `LayerNorm` / `RMSNorm` apply scale and normalisation in another order (and `RMSNorm` scales
before casting back), which moves logits by an ulp against Hugging Face's and against the shipped model's
recorded outputs. `add_projections` / `project` give a layer several projections of one input, run as one
matmul when the stage holds them fused.

We tag parameters with our own metadata key rather than Flax's `out_sharding`: a Variable created with
`out_sharding` is sharded eagerly, which needs a mesh at construction, while our models are built
abstract (`nnx.eval_shape`) and placed stage by stage from checkpoint tensors (`models.sharding`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.quant import QuantizedWeight, embed_rows, quant_matmul


@dataclasses.dataclass(frozen=True)
class Stage:
    """Which part of a model a model object holds: `num_layers` decoder layers (None: all of the config's), the
    embedding if `first`, the final norm and head if `last` (a whole model is both), and whether each layer's
    projections of one input are fused into one matmul (`add_projections`; a one-device stage)."""

    num_layers: int | None = None
    first: bool = True
    last: bool = True
    fused: bool = False


WHOLE = Stage()

# The metadata key a parameter's logical axis names live under (the `logical_axes=` keyword below; `models.params` reads it).
AXES = "logical_axes"

_normal = nnx.initializers.normal(0.02)
_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


def _tagged(init: Any, *axes: str | None) -> Any:
    """`init` whose Param carries `axes` (one logical name per dimension) as its `logical_axes` metadata."""
    return nnx.with_metadata(init, logical_axes=axes)


class Linear(nnx.Linear):
    """`nnx.Linear` whose kernel may be a `QuantizedWeight` (logical `[in, out]`, stored output-major)."""

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        kernel = self.kernel.get_value()
        if not isinstance(kernel, QuantizedWeight):
            return super().__call__(inputs, out_sharding)
        y = quant_matmul(inputs, kernel).astype(inputs.dtype)  # [..., out]
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class Embed(nnx.Embed):
    """`nnx.Embed` whose table may be a `QuantizedWeight` (logical `[features, num]`: the tied head's form),
    read row by row: only the rows asked for are dequantized."""

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        table = self.embedding.get_value()
        if not isinstance(table, QuantizedWeight):
            return super().__call__(inputs, out_sharding)
        return embed_rows(table, inputs).astype(self.param_dtype)  # [..., features]


def linear(num_in: int, num_out: int, axes: tuple[str, str], *, bias: bool, dtype: Any, rngs: nnx.Rngs) -> Linear:
    """`x @ kernel [in, out] (+ bias [out])` with logical `axes` (in, out); normal(0.02) kernel, zero bias."""
    return Linear(
        num_in, num_out, use_bias=bias, param_dtype=dtype, rngs=rngs,
        kernel_init=_tagged(_normal, *axes), bias_init=_tagged(_zeros, axes[1]),
    )  # fmt: skip


def embed(num: int, features: int, axes: tuple[str, str], *, dtype: Any, rngs: nnx.Rngs) -> Embed:
    """A table [num, features] read by row (`jnp.take`), with logical `axes`."""
    return Embed(num, features, param_dtype=dtype, rngs=rngs, embedding_init=_tagged(_normal, *axes))


def tied_logits(table: jax.Array | QuantizedWeight, x: jax.Array) -> jax.Array:
    """float32 logits [..., V] of x [..., E] against an embedding-shaped head `table` [V, E] (or a quantized one,
    logical `[E, V]`: one `quant_matmul`, the head's bytes read once).

    Written `[V, E] @ [E, N]`, not `x @ table.T`: the other way round XLA:CPU materialised table.T (a copy of
    the whole 154 MB table of opt-125m every step) before the product. (So not `nnx.Embed.attend`.)
    """
    if isinstance(table, QuantizedWeight):
        return quant_matmul(x.astype(jnp.float32), table)  # [..., V]
    flat = x.reshape(-1, x.shape[-1])  # [N, E]
    logits = jnp.dot(table, flat.T, preferred_element_type=jnp.float32).T  # [N, V]
    return logits.reshape(*x.shape[:-1], logits.shape[-1])


class LayerNorm(nnx.Module):
    """LayerNorm in float32 (as Hugging Face's OPT computes it under autocast), cast back to the input's dtype."""

    def __init__(self, features: int, eps: float, *, dtype: Any, rngs: nnx.Rngs) -> None:
        del rngs
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((features,), dtype), logical_axes=("embed",))
        self.bias = nnx.Param(jnp.zeros((features,), dtype), logical_axes=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale (in that order)."""

    def __init__(self, features: int, eps: float, *, dtype: Any, rngs: nnx.Rngs) -> None:
        del rngs
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((features,), dtype), logical_axes=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


def add_projections(
    owner: nnx.Module,
    num_in: int,
    parts: Sequence[tuple[str, int, str]],  # (name, out width, logical out axis)
    fused_name: str,
    *,
    bias: bool,
    fused: bool,
    dtype: Any,
    rngs: nnx.Rngs,
) -> None:
    """Give `owner` the projections of one input (q/k/v, or gate/up): one `nnx.Linear` per part, or one fused.

    Fused (`fused=True`, a one-device stage) the kernel is the parts' kernels side by side `[in, sum(out)]`
    under `fused_name`, and one matmul serves all parts: on CPU each dot is one library call, and three narrow
    ones (k/v are a third of q's width under GQA) run slower than one wide one. Split over tp the parts stay
    apart: a column split of a fused kernel would not give each device its own share of every part. The
    linears sit on `owner` itself (not in a sub-module) so the module's parameter paths are the checkpoint
    layout's (`models.params`).
    """
    if fused:
        width = sum(w for _, w, _ in parts)
        setattr(owner, fused_name, linear(num_in, width, ("embed", "fused"), bias=bias, dtype=dtype, rngs=rngs))
    else:
        for name, width, axis in parts:
            setattr(owner, name, linear(num_in, width, ("embed", axis), bias=bias, dtype=dtype, rngs=rngs))


def project(owner: nnx.Module, x: jax.Array, parts: Sequence[tuple[str, int, str]], fused_name: str) -> list[jax.Array]:
    """Each part's projection of x (`add_projections`): one matmul split by column where fused, else one per part."""
    if hasattr(owner, fused_name):
        offsets = np.cumsum([w for _, w, _ in parts])[:-1].tolist()
        return list(jnp.split(getattr(owner, fused_name)(x), offsets, axis=-1))
    return [getattr(owner, name)(x) for name, _, _ in parts]
