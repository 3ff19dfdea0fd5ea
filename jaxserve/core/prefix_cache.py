"""Automatic prefix caching over paged KV blocks: content-addressed full blocks, pins, LRU eviction.

One `PrefixCache` per instance KV pool (prefill or decode), owned by that instance's worker loop like
the `BlockAllocator` it wraps (plain Python, no device arrays; the simulator uses the same class).

Content addressing: a *full* block of `block_size` tokens is named by a hash of its tokens chained
with the hash of everything before it (`hash_block(parent, tokens)`), so equal hashes mean equal
prefixes, not merely equal blocks. A partial last block is never named and never shared: its KV is
still being appended to. Hashes are blake2b digests of the token ids, stable across processes, so a
prefill instance and a decode instance agree on names without talking (what a pull needs).

A request's life:

1. `acquire(request_id, token_ids, num_tokens_reserved)` — find the longest cached prefix of the
   prompt's full blocks, pin those blocks (ref count + 1), and allocate fresh blocks for the rest of
   the reservation (prompt + max new tokens), evicting least-recently-used *unreferenced* cached
   blocks when the free list is short. Nothing changes when it raises `OutOfBlocksError`. The
   result's block table starts with the cached blocks; the caller computes (or pulls) only
   positions `num_cached_tokens ..` into `block_table[num_cached_tokens // block_size ..]`.
   `min_uncached_tokens=1` (the default) keeps at least one prompt token uncached, because a
   prefill needs the last position's logits: a fully cached prompt gives back its last block.
2. `commit(request_id, token_ids)` — once the KV of `token_ids` exists in the request's blocks
   (after prefill; on the decode side at the end, prompt + generated tokens but the last, whose KV
   is never computed), name the request's full blocks so later requests can hit them. A block
   whose name another block already holds stays private (it is freed, not cached, on release).
3. `release(request_id)` — unpin exactly the blocks `acquire` gave this request: private blocks
   go back to the allocator; named blocks whose count reaches 0 become evictable, last block of
   the sequence first (so a long conversation loses its tail before its shared head). Safe to
   call twice and for unknown ids (cancel and failure paths call it unconditionally).

`observer` (None by default) is told every event as `observer(event, request_id, name, index)`:
`"acquire"` (index: blocks hit; name None), `"commit"` (a block named: its name and position in
the request's table), `"release"`, `"evict"` (request None). A debugging and fidelity aid (the
bench diffs the runtime's and the simulator's event sequences); it must not raise.

With `enabled=False` the cache is a plain allocator front: no hits, nothing named, release frees —
the "without caching" arm of every comparison runs the same code.

The allocator is shared through a narrow use: each block is allocated as its own one-block
"sequence" under a private key, so `BlockAllocator` needs no change. A cache must own its
allocator (nothing else may allocate from it), or `num_available` is wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from jaxserve.core.blocks import BlockAllocator, OutOfBlocksError

BlockHash = bytes
CacheObserver = Callable[[str, str | None, BlockHash | None, int], None]
_ROOT = b"\x00" * 16  # the parent hash of a sequence's first block


def hash_block(parent: BlockHash | None, tokens: Sequence[int] | np.ndarray) -> BlockHash:
    """The name of a full block: blake2b-128 of the parent's name and the tokens (as int64)."""
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def salt_root(salt: str | None) -> BlockHash:
    """The parent name of a sequence's first block under `salt` (vLLM's `cache_salt`): blocks named under one
    salt are never found under another or under none. None or "" is no salt (the plain root)."""
    if not salt:
        return _ROOT
    return hashlib.blake2b(b"jaxserve-cache-salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, salt: str | None = None
) -> tuple[BlockHash, ...]:
    """The chained names of the full blocks of `token_ids` (a partial last block has none); with `salt`, a chain
    of its own (`salt_root`)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    raw = np.asarray(token_ids, dtype=np.int64).tobytes()
    step = 8 * block_size
    out: list[BlockHash] = []
    parent = salt_root(salt)
    for start in range(0, len(raw) - step + 1, step):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(raw[start : start + step])
        parent = h.digest()
        out.append(parent)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class CacheHit:
    """What `acquire` gives a request: its block table and how many prompt tokens already have KV."""

    block_table: tuple[int, ...]
    num_cached_tokens: int

    def num_cached_blocks(self, block_size: int) -> int:
        return self.num_cached_tokens // block_size


@dataclasses.dataclass
class CacheStats:
    """Counters since construction (hit rate = num_hit_tokens / num_query_tokens)."""

    num_queries: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclasses.dataclass
class _Block:
    block_id: int
    key: str  # the allocator "sequence" that holds this one block
    ref_count: int = 0
    name: BlockHash | None = None  # set once committed and unique


class PrefixCache:
    """Content-addressed KV blocks with reference counts and LRU eviction on top of a `BlockAllocator`."""

    def __init__(self, allocator: BlockAllocator, *, enabled: bool = True, key_prefix: str = "prefix-cache/") -> None:
        self.allocator = allocator
        self.enabled = enabled
        self._key_prefix = key_prefix
        self._keys = itertools.count()
        self._blocks: dict[int, _Block] = {}  # every block this cache holds (pinned or evictable)
        self._by_name: dict[BlockHash, _Block] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced named blocks, oldest first
        self._tables: dict[str, list[_Block]] = {}  # request -> the blocks it pinned, in order
        self._num_committed: dict[str, int] = {}  # request -> leading blocks already named or skipped
        self.stats = CacheStats()
        self.observer: CacheObserver | None = None

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_available(self) -> int:
        """Blocks a new reservation can get: free ones plus evictable cached ones."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Named blocks (pinned or evictable)."""
        return len(self._by_name)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_pinned(self) -> int:
        return sum(1 for b in self._blocks.values() if b.ref_count > 0)

    def ref_count(self, block_id: int) -> int:
        block = self._blocks.get(block_id)
        return block.ref_count if block is not None else 0

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def table(self, request_id: str) -> tuple[int, ...]:
        return tuple(b.block_id for b in self._tables[request_id])

    # ---- lookups (no side effects) -----------------------------------------------------------
    def num_cached_prefix_blocks(self, names: Sequence[BlockHash]) -> int:
        """How many leading names of a chain this cache holds."""
        if not self.enabled:
            return 0
        n = 0
        for name in names:
            if name not in self._by_name:
                break
            n += 1
        return n

    def missing(self, names: Sequence[BlockHash]) -> tuple[int, ...]:
        """Indices of `names` this cache lacks: the blocks a pull has to move."""
        if not self.enabled:
            return tuple(range(len(names)))
        return tuple(j for j, name in enumerate(names) if name not in self._by_name)

    def num_cached_tokens(
        self,
        token_ids: Sequence[int] | np.ndarray,
        min_uncached_tokens: int = 1,
        names: Sequence[BlockHash] | None = None,
    ) -> int:
        """Prompt tokens `acquire` would find cached (routing asks this of every instance).

        `names`: `block_hashes(token_ids, block_size)` when the caller already has them.
        """
        names = block_hashes(token_ids, self.block_size) if names is None else names
        return self._usable_blocks(names, len(token_ids), min_uncached_tokens) * self.block_size

    def _usable_blocks(self, names: Sequence[BlockHash], num_tokens: int, min_uncached_tokens: int) -> int:
        n = self.num_cached_prefix_blocks(names)
        # Keep at least `min_uncached_tokens` to compute: give back whole blocks, never part of one.
        while n > 0 and num_tokens - n * self.block_size < min_uncached_tokens:
            n -= 1
        return n

    # ---- a request's life --------------------------------------------------------------------
    def acquire(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray,
        num_tokens_reserved: int,
        *,
        min_uncached_tokens: int = 1,
        names: Sequence[BlockHash] | None = None,
    ) -> CacheHit:
        """Pin the longest cached prefix of `token_ids` and allocate blocks for the rest of the reservation.

        `names`: `block_hashes(token_ids, block_size)` when the caller already has them.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        num_tokens = len(token_ids)
        if num_tokens_reserved < num_tokens:
            raise ValueError(f"reservation of {num_tokens_reserved} tokens is shorter than the {num_tokens} given")
        names = block_hashes(token_ids, self.block_size) if names is None else names
        num_hit = self._usable_blocks(names, num_tokens, min_uncached_tokens)
        hits = [self._by_name[name] for name in names[:num_hit]]
        num_total = -(-num_tokens_reserved // self.block_size)
        num_fresh = num_total - num_hit
        num_hit_evictable = sum(1 for b in hits if b.ref_count == 0)
        if num_fresh > self.num_available - num_hit_evictable:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_fresh} new blocks, "
                f"{self.num_available - num_hit_evictable} free or evictable"
            )
        for b in hits:
            if b.ref_count == 0:
                del self._evictable[b.block_id]
            b.ref_count += 1
        while self.allocator.num_free < num_fresh:
            self._evict_one()
        fresh = []
        for _ in range(num_fresh):
            key = f"{self._key_prefix}{next(self._keys)}"
            (block_id,) = self.allocator.allocate(key, 1)
            block = _Block(block_id, key, ref_count=1)
            self._blocks[block_id] = block
            fresh.append(block)
        self._tables[request_id] = hits + fresh
        self._num_committed[request_id] = num_hit
        self.stats.num_queries += 1
        self.stats.num_query_tokens += num_tokens
        self.stats.num_hit_tokens += num_hit * self.block_size
        if self.observer is not None:
            self.observer("acquire", request_id, None, num_hit)
        return CacheHit(tuple(b.block_id for b in hits + fresh), num_hit * self.block_size)

    def commit(
        self, request_id: str, token_ids: Sequence[int] | np.ndarray, names: Sequence[BlockHash] | None = None
    ) -> int:
        """Name the request's full blocks of `token_ids` (their KV exists now); returns blocks newly named."""
        table = self._tables.get(request_id)
        if table is None or not self.enabled:
            return 0
        names = block_hashes(token_ids, self.block_size) if names is None else names
        if len(names) > len(table):
            raise ValueError(f"{len(token_ids)} tokens do not fit in request {request_id!r}'s {len(table)} blocks")
        start = self._num_committed[request_id]
        named = 0
        for j in range(start, len(names)):
            block = table[j]
            if block.name is None and names[j] not in self._by_name:
                block.name = names[j]
                self._by_name[names[j]] = block
                named += 1
                if self.observer is not None:
                    self.observer("commit", request_id, names[j], j)
        self._num_committed[request_id] = max(start, len(names))
        return named

    def release(self, request_id: str) -> int:
        """Unpin what `acquire` gave the request; returns how many blocks it held (0 if none)."""
        table = self._tables.pop(request_id, None)
        self._num_committed.pop(request_id, None)
        if table is None:
            return 0
        if self.observer is not None:
            self.observer("release", request_id, None, len(table))
        for block in reversed(table):  # the tail becomes evictable first, so it is evicted first
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.name is not None:
                self._evictable[block.block_id] = None
            else:
                self._drop(block)
        return len(table)

    def clear(self) -> int:
        """Evict every unreferenced cached block; returns how many (pinned blocks stay)."""
        n = 0
        while self._evictable:
            self._evict_one()
            n += 1
        return n

    # ---- internals ---------------------------------------------------------------------------
    def _evict_one(self) -> None:
        block_id, _ = self._evictable.popitem(last=False)
        block = self._blocks[block_id]
        assert block.name is not None and block.ref_count == 0
        del self._by_name[block.name]
        self._drop(block)
        self.stats.num_evictions += 1
        if self.observer is not None:
            self.observer("evict", None, block.name, -1)

    def _drop(self, block: _Block) -> None:
        del self._blocks[block.block_id]
        self.allocator.free(block.key)


def cache_stats(cache: PrefixCache) -> dict[str, int]:
    """The prefix-cache fields of an instance's `InstanceStats`."""
    return {
        "num_cached_blocks": cache.num_cached,
        "num_prefix_query_tokens": cache.stats.num_query_tokens,
        "num_prefix_hit_tokens": cache.stats.num_hit_tokens,
        "num_prefix_evictions": cache.stats.num_evictions,
    }
