"""The decoder skeleton every family shares: embed -> layers -> last position -> LM head, once.

A family's model class (`models.opt.OPT`, `models.llama.Llama`: `flax.nnx` modules) differs from another only
in its embedding, its decoder layers and its head; this module runs any of them the same way (`DecoderModel`),
in the three step kinds of the shared KV layer (`models.attention`):

* prefill — right-padded prompts `[B, T]` -> a contiguous `KVCache`;
* decode — one token per row at its own position over a contiguous cache;
* paged — `T >= 1` new tokens per row appended into a block pool (a paged decode step, `T == 1`,
  or a chunked prefill, `T > 1`).

Each kind comes at two sizes: `run_layers_*` (the model's layers only: what a pipeline stage between the first
and the last runs) and `stage_*` (a pipeline stage: embed on the first, LM head on the last; a whole model is
a stage that is both). They are plain functions of the model: `models.sharding` jits one per stage over the
split module state (`nnx.merge` inside the jitted function, trace-time only), `models.steps` one per step
kind for the whole model over a checkpoint-layout tree.

What a model supplies: `cfg`, `first`, `last`, its `layers` (each `(h, i, attend, cache, context) -> (h,
cache, (k, v))`: project q/k/v to `[B, T, heads, D]`, call the shared `attend(i, q, k, v, cache)`, finish
the layer), `embed(tokens, positions)`, `layer_context(positions, dtype)` (what every layer of a step shares,
built once per step: the RoPE tables) and `logits(x)` (final norm and head, float32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from models import attention as kv
from models.attention import KVCache, KVCacheT, PagedKVCache, select_last
from models.paged_attention import BlockLayout, Impl

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class HFNaming:
    """How a family's Hugging Face tensor names map onto its param tree (`models.checkpoint` reads them)."""

    prefixes: tuple[str, ...]  # tried in order; the first holding embed_tokens.weight wins
    layer_names: Mapping[tuple[str, str], tuple[str, bool]]  # (module, leaf) -> (suffix after "layers.N.", transpose)
    top_names: Mapping[tuple[str, ...], tuple[str, bool]]
    unprefixed: frozenset[tuple[str, ...]] = frozenset()  # top-level leaves named without the prefix


def prompt_positions(b: int, t: int) -> jax.Array:
    """Positions [B, T] of right-padded prompts: 0..T-1 on every row."""
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def new_token_positions(start_positions: jax.Array, t: int) -> jax.Array:
    """Positions [B, T] of `t` tokens appended at `start_positions` [B]."""
    return start_positions[:, None] + jnp.arange(t, dtype=start_positions.dtype)[None, :]


class DecoderModel(Protocol):
    """What the skeleton runs: a family's model class (`models.opt.OPT`, `models.llama.Llama`), or a stage of it."""

    @property
    def cfg(self) -> Any: ...  # the family's config (head_dim is read here)

    @property
    def first(self) -> bool: ...  # holds the embedding (the first pipeline stage)

    @property
    def last(self) -> bool: ...  # holds the final norm and the head (the last stage)

    @property
    def layers(self) -> Sequence[Any]: ...  # each layer: (h, i, attend, cache, context) -> (h, cache, (k, v))

    def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array: ...  # [B, T] -> [B, T, h]

    def layer_context(self, positions: jax.Array, dtype: Any) -> Any: ...  # shared by a step's layers (RoPE)

    def logits(self, x: jax.Array) -> jax.Array: ...  # [..., h] -> float32 [..., V]


def _layer_fn(model: DecoderModel, positions: jax.Array, dtype: Any) -> kv.LayerFn:
    """The shared layer loop's `LayerFn` over the model's layer modules, for new tokens at `positions` [B, T]."""
    context = model.layer_context(positions, dtype)  # built once per step, not once per layer

    def layer(lp: Any, h: jax.Array, i: Any, attend: kv.Attend, c: Any) -> tuple[jax.Array, Any, Any]:
        return lp(h, i, attend, c, context)  # type: ignore[no-any-return]

    return layer


# ---- a layer slice ----------------------------------------------------------------------------


def run_layers_prefill(model: DecoderModel, x: jax.Array, lengths: jax.Array) -> tuple[jax.Array, KVCache]:
    """Causal + padding-masked layers over right-padded prompts. x [B,T,h] -> (x, KVCache [L,B,T,KVH,D])."""
    b, t, _ = x.shape
    layer = _layer_fn(model, prompt_positions(b, t), x.dtype)
    return kv.layers_prefill(list(model.layers), layer, x, lengths, model.cfg.head_dim**-0.5)


def run_layers_decode(
    model: DecoderModel, x: jax.Array, positions: jax.Array, cache: KVCacheT
) -> tuple[jax.Array, KVCacheT]:
    """One token per row at `positions[b]` over a contiguous cache (`KVCache` or `DecodeCache`). x [B,1,h]."""
    layer = _layer_fn(model, positions[:, None], x.dtype)
    return kv.layers_decode(list(model.layers), layer, x, positions, cache, model.cfg.head_dim**-0.5)


def run_layers_paged(
    model: DecoderModel,
    x: jax.Array,
    start_positions: jax.Array,
    lengths: jax.Array,
    cache: PagedKVCache,
    block_tables: jax.Array,
    attention: Impl = "xla",
    block_layout: BlockLayout | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """Append `lengths[b]` tokens per row into the pages `block_tables[b]` names (`attention.layers_paged`). x [B,T,h]."""
    layer = _layer_fn(model, new_token_positions(start_positions, x.shape[1]), x.dtype)
    return kv.layers_paged(
        list(model.layers), layer, x, start_positions, lengths, cache, block_tables, model.cfg.head_dim**-0.5,
        attention, block_layout,
    )  # fmt: skip


# ---- a pipeline stage (the first embeds tokens, the last returns logits) ------------------------


def stage_prefill(
    model: DecoderModel, x: jax.Array, lengths: jax.Array, *, all_logits: bool
) -> tuple[jax.Array, KVCache]:
    """x: tokens [B,T] on the first stage, else hidden [B,T,h]; returns logits on the last, else hidden.

    Logits at each row's last prompt token [B,V] (or all [B,T,V] with `all_logits`); K/V for all T positions
    (padding positions hold values the caller ignores).
    """
    if model.first:
        b, t = x.shape
        x = model.embed(x, prompt_positions(b, t))
    x, cache = run_layers_prefill(model, x, lengths)
    return (_logits(model, x, lengths, all_logits) if model.last else x), cache


def stage_decode(
    model: DecoderModel, x: jax.Array, positions: jax.Array, cache: KVCacheT
) -> tuple[jax.Array, KVCacheT]:
    """x: tokens [B] on the first stage, else hidden [B,1,h]; returns logits [B,V] on the last.

    Writes K/V at `positions[b]` and attends to 0..positions[b]; a position past the cache writes nothing. A
    `DecodeCache` (`DecodeCache.from_kv(prefill_kv, max_len)`) is the fast layout; a stacked `KVCache`
    [L,B,T,KVH,D] also works but slices and transposes each layer every step.
    """
    if model.first:
        x = model.embed(x[:, None], positions[:, None])
    x, cache = run_layers_decode(model, x, positions, cache)
    return (model.logits(x[:, 0]) if model.last else x), cache


def stage_paged(
    model: DecoderModel,
    x: jax.Array,
    start_positions: jax.Array,
    lengths: jax.Array,
    cache: PagedKVCache,
    block_tables: jax.Array,
    *,
    all_logits: bool,
    attention: Impl = "xla",
    block_layout: BlockLayout | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """Append x (tokens [B,T] on the first stage, else hidden [B,T,h]; first `lengths[b]` valid) at
    `start_positions[b]..` into paged KV; returns logits on the last stage, else hidden.

    Each new token attends to positions `< start_positions[b]` of its sequence's pages (slots past that are
    ignored, so a reused block needs no clearing) and causally to the new tokens. Logits at the last new token
    [B,V] (or all [B,T,V]). Rows with `lengths[b] == 0` write nothing.
    """
    if model.first:
        x = model.embed(x, new_token_positions(start_positions, x.shape[1]))
    x, cache = run_layers_paged(model, x, start_positions, lengths, cache, block_tables, attention, block_layout)
    return (_logits(model, x, lengths, all_logits) if model.last else x), cache


def _logits(model: DecoderModel, x: jax.Array, lengths: jax.Array, all_logits: bool) -> jax.Array:
    """The last stage's end: logits at each row's last new token [B,V], or at every position [B,T,V]."""
    return model.logits(x if all_logits else select_last(x, lengths))
