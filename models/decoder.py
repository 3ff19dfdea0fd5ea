"""The decoder skeleton every family shares: embed -> layers -> last position -> LM head, once.

A family (`models.opt`, `models.llama`) differs from another only in its embedding, its decoder
layer body and its LM head; it hands those three to a `Decoder`, and this module runs them the
same way for every family, in the three step kinds of the shared KV layer (`models.attention`):

* prefill — right-padded prompts `[B, T]` -> a contiguous `KVCache`;
* decode — one token per row at its own position over a contiguous cache;
* paged — `T >= 1` new tokens per row appended into a block pool (a paged decode step, `T == 1`,
  or a chunked prefill, `T > 1`).

Each kind comes at three sizes: `run_layers_*` (a layer slice: what a pipeline stage between the
first and the last runs), `stage_*` (a pipeline stage: embed on the first, LM head on the last;
`models.sharding` jits one per stage) and the whole model (`prefill`, `decode`, `extend_paged`:
a stage that is both first and last). `jit_entry_points` jits the whole-model functions of one
family once, so each family keeps its own compile cache keyed on the config as before.

What a family supplies:

* `embed(params, cfg, tokens [B, T], positions [B, T]) -> x [B, T, h]` (the first stage's part;
  a family without learned positions ignores `positions`);
* `layer(cfg, positions [B, T], dtype) -> attention.LayerFn`: its layer body for a step whose new
  tokens sit at `positions` (rotary tables are built here, once per step, not once per layer);
* `lm_head(params, cfg, x [..., h]) -> float32 logits [..., V]` (final norm included).

The rest of a family file (param shapes, stage slices, partition specs, fused projections) is
listed in docs/models.md; `TP_AXIS` and the column / row split specs here are what its
`param_specs` are written in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models import attention as kv
from models.attention import KVCache, KVCacheT, KVShape, Layers, PagedKVCache, select_last
from models.paged_attention import BlockLayout, Impl

Params = dict[str, Any]

# The mesh axis tensor parallelism splits over (`models.sharding`'s meshes; a family's `param_specs` name it).
TP_AXIS = "tp"
# A column-parallel kernel [L, in, out] split on `out` (its bias [L, out] too), a row-parallel one split on `in`.
COLUMN_KERNEL, COLUMN_BIAS, ROW_KERNEL = P(None, None, TP_AXIS), P(None, TP_AXIS), P(None, TP_AXIS, None)

CfgT = TypeVar("CfgT", bound=KVShape)


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


@dataclasses.dataclass(frozen=True)
class Decoder(Generic[CfgT]):
    """One family's decoder: its embedding, layer body factory and LM head, run by the shared skeleton.

    Frozen and hashable, so its bound methods can be jitted (`jit_entry_points`) and partially
    applied per pipeline stage (`models.sharding`).
    """

    embed: Callable[[Params, CfgT, jax.Array, jax.Array], jax.Array]
    layer: Callable[[CfgT, jax.Array, Any], kv.LayerFn]
    lm_head: Callable[[Params, CfgT, jax.Array], jax.Array]

    # ---- a layer slice ---------------------------------------------------------------------

    def run_layers_prefill(
        self, layers: Layers, cfg: CfgT, x: jax.Array, lengths: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Causal + padding-masked layers over right-padded prompts. x [B,T,h] -> (x, KVCache [L,B,T,KVH,D])."""
        b, t, _ = x.shape
        layer = self.layer(cfg, prompt_positions(b, t), x.dtype)
        return kv.layers_prefill(layers, layer, x, lengths, cfg.head_dim**-0.5)

    def run_layers_decode(
        self, layers: Layers, cfg: CfgT, x: jax.Array, positions: jax.Array, cache: KVCacheT
    ) -> tuple[jax.Array, KVCacheT]:
        """One token per row at `positions[b]` over a contiguous cache (`KVCache` or `DecodeCache`). x [B,1,h]."""
        layer = self.layer(cfg, positions[:, None], x.dtype)
        return kv.layers_decode(layers, layer, x, positions, cache, cfg.head_dim**-0.5)

    def run_layers_paged(
        self,
        layers: Layers,
        cfg: CfgT,
        x: jax.Array,
        start_positions: jax.Array,
        lengths: jax.Array,
        cache: PagedKVCache,
        block_tables: jax.Array,
        attention: Impl = "xla",
        block_layout: BlockLayout | None = None,
    ) -> tuple[jax.Array, PagedKVCache]:
        """Append `lengths[b]` tokens per row into the pages `block_tables[b]` names (`attention.layers_paged`). x [B,T,h]."""
        layer = self.layer(cfg, new_token_positions(start_positions, x.shape[1]), x.dtype)
        return kv.layers_paged(
            layers, layer, x, start_positions, lengths, cache, block_tables, cfg.head_dim**-0.5, attention, block_layout
        )

    # ---- a pipeline stage (the first embeds tokens, the last returns logits) ------------------

    def stage_prefill(
        self, sp: Params, x: jax.Array, lengths: jax.Array, *, cfg: CfgT, first: bool, last: bool, all_logits: bool
    ) -> tuple[jax.Array, KVCache]:
        """x: tokens [B,T] on the first stage, else hidden [B,T,h]; returns logits on the last, else hidden."""
        if first:
            b, t = x.shape
            x = self.embed(sp, cfg, x, prompt_positions(b, t))
        x, cache = self.run_layers_prefill(sp["layers"], cfg, x, lengths)
        return (self._logits(sp, cfg, x, lengths, all_logits) if last else x), cache

    def stage_decode(
        self, sp: Params, x: jax.Array, positions: jax.Array, cache: KVCacheT, *, cfg: CfgT, first: bool, last: bool
    ) -> tuple[jax.Array, KVCacheT]:
        """x: tokens [B] on the first stage, else hidden [B,1,h]; returns logits [B,V] on the last."""
        if first:
            x = self.embed(sp, cfg, x[:, None], positions[:, None])
        x, cache = self.run_layers_decode(sp["layers"], cfg, x, positions, cache)
        return (self.lm_head(sp, cfg, x[:, 0]) if last else x), cache

    def stage_paged(
        self,
        sp: Params,
        x: jax.Array,
        start_positions: jax.Array,
        lengths: jax.Array,
        cache: PagedKVCache,
        block_tables: jax.Array,
        *,
        cfg: CfgT,
        first: bool,
        last: bool,
        all_logits: bool,
        attention: Impl = "xla",
        block_layout: BlockLayout | None = None,
    ) -> tuple[jax.Array, PagedKVCache]:
        """x: tokens [B,T] on the first stage, else hidden [B,T,h]; returns logits on the last, else hidden."""
        if first:
            x = self.embed(sp, cfg, x, new_token_positions(start_positions, x.shape[1]))
        x, cache = self.run_layers_paged(
            sp["layers"], cfg, x, start_positions, lengths, cache, block_tables, attention, block_layout
        )
        return (self._logits(sp, cfg, x, lengths, all_logits) if last else x), cache

    def _logits(self, sp: Params, cfg: CfgT, x: jax.Array, lengths: jax.Array, all_logits: bool) -> jax.Array:
        """The last stage's end: logits at each row's last new token [B,V], or at every position [B,T,V]."""
        return self.lm_head(sp, cfg, x if all_logits else select_last(x, lengths))

    # ---- the whole model (jitted per family by `jit_entry_points`) ------------------------------

    def prefill(
        self, params: Params, cfg: CfgT, tokens: jax.Array, lengths: jax.Array, *, all_logits: bool = False
    ) -> tuple[jax.Array, KVCache]:
        """Right-padded prompts tokens [B,T] with true `lengths` [B].

        Returns float32 logits [B,T,V] (all_logits) or at position `lengths - 1` [B,V], and K/V for all
        T positions (padding positions hold values the caller ignores).
        """
        return self.stage_prefill(params, tokens, lengths, cfg=cfg, first=True, last=True, all_logits=all_logits)

    def decode(
        self, params: Params, cfg: CfgT, tokens: jax.Array, positions: jax.Array, cache: KVCacheT
    ) -> tuple[jax.Array, KVCacheT]:
        """One token per row: tokens/positions [B]; writes K/V at `positions[b]`, attends to 0..positions[b].

        `cache` is donated (updated in place). A position past the cache's length writes nothing.
        A `DecodeCache` (`DecodeCache.from_kv(prefill_kv, max_len)`) is the fast layout; a stacked
        `KVCache` [L,B,T,KVH,D] also works but slices and transposes each layer every step.
        """
        return self.stage_decode(params, tokens, positions, cache, cfg=cfg, first=True, last=True)

    def extend_paged(
        self,
        params: Params,
        cfg: CfgT,
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
        return self.stage_paged(
            params, tokens, start_positions, lengths, cache, block_tables, cfg=cfg, first=True, last=True,
            all_logits=all_logits, attention=attention, block_layout=block_layout,
        )  # fmt: skip


class EntryPoints(NamedTuple):
    """A family's jitted whole-model functions (`Decoder.prefill`, `.decode`, `.extend_paged`)."""

    prefill: jax.stages.Wrapped  # static cfg, all_logits
    decode: jax.stages.Wrapped  # static cfg; donates the cache
    extend_paged: jax.stages.Wrapped  # static cfg, all_logits, attention, block_layout; donates the cache


def jit_entry_points(decoder: Decoder[Any]) -> EntryPoints:
    """Jit `decoder`'s whole-model functions; a family calls this once, at import, and binds the results."""
    return EntryPoints(
        prefill=jax.jit(decoder.prefill, static_argnames=("cfg", "all_logits")),
        decode=jax.jit(decoder.decode, static_argnames=("cfg",), donate_argnames=("cache",)),
        extend_paged=jax.jit(
            decoder.extend_paged,
            static_argnames=("cfg", "all_logits", "attention", "block_layout"),
            donate_argnames=("cache",),
        ),
    )
