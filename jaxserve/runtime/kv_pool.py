"""Paged KV for decode: the device pool (the block allocator is `jaxserve/core/blocks.py`).

The pool arrays (`KVPages`, one `StagePages` per
pipeline stage, heads sharded over `tp`) are replaced functionally by every
write; `write_sequence` scatters a sequence's dense KV into its blocks
(position p -> block table[p // block_size], slot p % block_size) and
`read_sequence` gathers it back. Both follow the pool's `block_layout`
("tokens": a block is `[block_size, H, D]`; "heads": `[H, block_size, D]`), so
the dense KV they take and give, `[L_s, T, H, D]`, is the same in either layout:
a prefill instance and a decode instance may keep their pools differently.

`precompile_write` / `precompile_read` / `precompile_slice` compile those programs ahead of time from
shapes and shardings alone (`jax.ShapeDtypeStruct`s: nothing is read or written, so a background thread may
compile them while the pool serves); a later call with arrays of those shapes and shardings runs the compiled
program.

`model_caches` / `pool_pages` turn the pool as engines hand it around (`KVPages`, a tuple) into the list the
model's paged steps take and back: `StagePages` is the model's `PagedKVCache`, so nothing is converted.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.runtime.engines.contract import KVPages, SequenceKV, StageKV, StagePages
from models.attention import PagedKVCache


def model_caches(pages: KVPages) -> list[PagedKVCache]:
    """An engine's pool as the model's block pools (same arrays, same block layout)."""
    return list(pages)  # one type (`StagePages` is `PagedKVCache`): nothing to convert


def pool_pages(caches: Sequence[PagedKVCache]) -> KVPages:
    """The model's block pools as an engine's pool (same arrays, same block layout)."""
    return tuple(caches)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_stage(pages: StagePages, kv: StageKV, slot_block: jax.Array, slot_offset: jax.Array) -> StagePages:
    # slot_block/slot_offset: [T]; padded positions point past the pool and are dropped.
    if pages.block_layout == "heads":  # index dims around a slice go first: the update is [T, L_s, H, D]
        k = pages.k.at[:, slot_block, :, slot_offset].set(jnp.swapaxes(kv.k, 0, 1).astype(pages.k.dtype), mode="drop")
        v = pages.v.at[:, slot_block, :, slot_offset].set(jnp.swapaxes(kv.v, 0, 1).astype(pages.v.dtype), mode="drop")
    else:
        k = pages.k.at[:, slot_block, slot_offset].set(kv.k.astype(pages.k.dtype), mode="drop")
        v = pages.v.at[:, slot_block, slot_offset].set(kv.v.astype(pages.v.dtype), mode="drop")
    return StagePages(k=k, v=v, block_layout=pages.block_layout)


def write_sequence(
    pages: KVPages, kv: SequenceKV, num_tokens: int, block_table: Sequence[int], start: int = 0
) -> KVPages:
    """Scatter the first `num_tokens` entries of `kv` into positions start.. of `block_table`'s blocks.

    Stage by stage; entries past `num_tokens` (padding) are dropped.
    """
    if len(pages) != len(kv):
        raise ValueError(f"pool has {len(pages)} stages, KV has {len(kv)}; convert the layout first")
    num_blocks, block_size = pages[0].num_blocks, pages[0].block_size
    padded = kv[0].k.shape[1]
    if start + num_tokens > len(block_table) * block_size:
        raise ValueError(f"{start + num_tokens} positions do not fit in {len(block_table)} blocks of {block_size}")
    pos = start + np.arange(padded)
    table = np.asarray(list(block_table) + [num_blocks] * (padded // block_size + 2), dtype=np.int32)
    valid = np.arange(padded) < num_tokens
    slot_block = np.where(valid, table[pos // block_size], num_blocks).astype(np.int32)
    slot_offset = (pos % block_size).astype(np.int32)
    return tuple(_write_stage(p, s, slot_block, slot_offset) for p, s in zip(pages, kv, strict=True))


def dense_sharding(pages: StagePages) -> NamedSharding:
    """The sharding a dense [L_s, T, H, D] KV needs to be written into `pages` (heads over 'tp')."""
    sharding = pages.k.sharding
    if not isinstance(sharding, NamedSharding):
        raise TypeError("KV pages must carry a NamedSharding")
    return NamedSharding(sharding.mesh, PartitionSpec(None, None, "tp", None))


@functools.partial(jax.jit, static_argnums=(2,))
def _read_stage(pages: StagePages, table: jax.Array, padded: int) -> StageKV:
    # table: [M] block ids covering >= padded positions; gathers [L_s, M, BS, H, D] -> [L_s, padded, H, D].
    k, v = pages.k[:, table], pages.v[:, table]
    if pages.block_layout == "heads":  # [L_s, M, H, BS, D] -> [L_s, M, BS, H, D]
        k, v = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)
    num_layers, m, bs = k.shape[0], k.shape[1], k.shape[2]
    k = k.reshape(num_layers, m * bs, *k.shape[3:])[:, :padded]
    v = v.reshape(num_layers, m * bs, *v.shape[3:])[:, :padded]
    return StageKV(k=k, v=v)


def precompile_write(pages: KVPages, kv: SequenceKV) -> None:
    """Compile `write_sequence` of a dense KV shaped like `kv` (its padded length) into a pool shaped like
    `pages` (both may be `jax.ShapeDtypeStruct`s with shardings), without running it."""
    slots = jax.ShapeDtypeStruct((kv[0].k.shape[1],), jnp.int32)  # slot_block / slot_offset: host arrays
    for p, s in zip(pages, kv, strict=True):
        _write_stage.lower(p, s, slots, slots).compile()


def read_sequence(pages: KVPages, block_table: Sequence[int], num_tokens: int, padded: int) -> SequenceKV:
    """Gather positions 0..`padded` of `block_table`'s blocks into a dense `SequenceKV` (the inverse of
    `write_sequence`); entries from `num_tokens` on are padding (whatever the blocks hold).

    A prefix-caching prefill instance computes a prompt into its paged pool and hands the decode
    side this dense copy, so the pull path is the same as without caching.
    """
    block_size = pages[0].block_size
    if num_tokens > len(block_table) * block_size:
        raise ValueError(f"{num_tokens} positions do not fit in {len(block_table)} blocks of {block_size}")
    m = -(-padded // block_size)
    table = np.zeros(m, dtype=np.int32)
    table[: min(m, len(block_table))] = list(block_table)[:m]
    return tuple(_read_stage(p, table, padded) for p in pages)


def precompile_read(pages: KVPages, padded: int) -> None:
    """Compile `read_sequence(pages, table, n, padded)` for a pool shaped like `pages`, without running it."""
    table = jax.ShapeDtypeStruct((-(-padded // pages[0].block_size),), jnp.int32)
    for p in pages:
        _read_stage.lower(p, table, padded).compile()


@functools.partial(jax.jit, static_argnums=(2,))
def _slice_stage(kv: StageKV, start: jax.Array, length: int) -> StageKV:
    idx = jnp.clip(start + jnp.arange(length), 0, kv.k.shape[1] - 1)
    return StageKV(k=jnp.take(kv.k, idx, axis=1), v=jnp.take(kv.v, idx, axis=1))


def slice_sequence(kv: SequenceKV, start: int, padded: int) -> SequenceKV:
    """Positions `start`.. of a dense KV as a new dense KV of `padded` entries (past the end: padding).

    What a pull moves when the decode instance already holds the first `start` positions.
    """
    return tuple(_slice_stage(s, np.int32(start), padded) for s in kv)


def precompile_slice(kv: SequenceKV, padded: int) -> None:
    """Compile `slice_sequence(kv, start, padded)` for a dense KV shaped like `kv`, without running it."""
    start = jax.ShapeDtypeStruct((), jnp.int32)
    for s in kv:
        _slice_stage.lower(s, start, padded).compile()
