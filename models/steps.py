"""The whole model's jitted steps over a checkpoint-layout param tree, for every family: `prefill`, `decode`,
`extend_paged` (tests, tools and benchmarks call these; serving runs `models.sharding.ShardedModel`'s
per-stage steps over the split module state).

Each is the shared skeleton (`models.decoder`) over the family's model class built around `params` inside the
trace (`models.params.model_from_params`: trace-time work, the same arrays), jitted once for all families with
the config static: a family adds no entry points of its own.
"""

from __future__ import annotations

from functools import partial

import jax

from models import decoder
from models.attention import KVCache, KVCacheT, PagedKVCache
from models.config import ModelConfig
from models.decoder import Params
from models.paged_attention import BlockLayout, Impl
from models.params import model_from_params


@partial(jax.jit, static_argnames=("cfg", "all_logits"))
def prefill(
    params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, *, all_logits: bool = False
) -> tuple[jax.Array, KVCache]:
    """Right-padded prompts tokens [B,T] with true `lengths` [B] (`decoder.stage_prefill` of the whole model)."""
    return decoder.stage_prefill(model_from_params(cfg, params), tokens, lengths, all_logits=all_logits)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode(
    params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: KVCacheT
) -> tuple[jax.Array, KVCacheT]:
    """One token per row: tokens/positions [B] (`decoder.stage_decode`); `cache` is donated (updated in place)."""
    return decoder.stage_decode(model_from_params(cfg, params), tokens, positions, cache)


@partial(jax.jit, static_argnames=("cfg", "all_logits", "attention", "block_layout"), donate_argnames=("cache",))
def extend_paged(
    params: Params,
    cfg: ModelConfig,
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
    """Append tokens [B,T] (first `lengths[b]` valid) at `start_positions[b]..` into paged KV
    (`decoder.stage_paged`); `cache` is donated (updated in place)."""
    model = model_from_params(cfg, params)
    return decoder.stage_paged(
        model, tokens, start_positions, lengths, cache, block_tables,
        all_logits=all_logits, attention=attention, block_layout=block_layout,
    )  # fmt: skip
