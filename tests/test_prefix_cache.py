"""PrefixCache: content-addressed blocks, hits, pins, LRU eviction and exact release on every path."""

from __future__ import annotations

import pytest

from jaxserve.core.blocks import BlockAllocator, OutOfBlocksError
from jaxserve.core.prefix_cache import PrefixCache, block_hashes, hash_block

BS = 4


def cache(num_blocks: int = 16, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_blocks, BS), enabled=enabled)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_hashes_chain_full_blocks_only() -> None:
    names = block_hashes(toks(0, 10), BS)
    assert len(names) == 2  # 10 tokens: two full blocks, the partial third has no name
    assert names[0] == hash_block(None, toks(0, 4))
    assert names[1] == hash_block(names[0], toks(4, 4))
    # The same block after a different prefix has a different name.
    other = block_hashes([9, 9, 9, 9, *toks(4, 4)], BS)
    assert other[1] != names[1]
    assert block_hashes(toks(0, 3), BS) == ()


def test_second_request_hits_committed_full_blocks() -> None:
    c = cache()
    a = c.acquire("a", toks(0, 10), 12)  # 3 blocks reserved, nothing cached
    assert a.num_cached_tokens == 0 and a.block_table == (0, 1, 2)
    assert c.commit("a", toks(0, 10)) == 2  # the partial third block is never named
    b = c.acquire("b", [*toks(0, 10), 99, 98], 14)  # same 10 tokens then 2 new: 4 blocks
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == (0, 1) and b.block_table[2:] == (3, 4)
    assert [c.ref_count(i) for i in range(5)] == [2, 2, 1, 1, 1]
    assert c.stats.num_query_tokens == 22 and c.stats.num_hit_tokens == 8


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    c = cache()
    c.acquire("a", toks(0, 8), 8)
    c.commit("a", toks(0, 8))
    # A prefill needs the last position's logits: keep one block to compute.
    assert c.num_cached_tokens(toks(0, 8)) == 4
    assert c.acquire("b", toks(0, 8), 9).num_cached_tokens == 4
    # A pull (decode side) needs no logits: the whole prompt counts.
    assert c.acquire("p", toks(0, 8), 9, min_uncached_tokens=0).num_cached_tokens == 8


def test_release_keeps_named_blocks_cached_and_frees_private_ones() -> None:
    c = cache(num_blocks=8)
    c.acquire("a", toks(0, 10), 16)  # 4 blocks: 2 will be named, 2 stay private
    c.commit("a", toks(0, 10))
    assert c.release("a") == 4
    assert (c.allocator.num_free, c.num_evictable, c.num_cached, c.num_available) == (6, 2, 2, 8)
    assert c.release("a") == 0  # idempotent
    assert c.acquire("b", toks(0, 9), 9).num_cached_tokens == 8  # still hits after release


def test_lru_evicts_unreferenced_blocks_only_tail_first() -> None:
    c = cache(num_blocks=6)
    c.acquire("a", toks(0, 8), 8)  # blocks 0, 1
    c.commit("a", toks(0, 8))
    c.acquire("b", toks(100, 8), 8)  # blocks 2, 3
    c.commit("b", toks(100, 8))
    c.release("a")  # a's blocks evictable: 1 (tail) then 0
    c.release("b")  # then 3, 2
    c.acquire("pin", toks(100, 8), 8, min_uncached_tokens=0)  # re-pins b's blocks: they leave the LRU
    assert c.num_evictable == 2
    c.acquire("x", toks(500, 12), 12)  # 3 blocks: 2 free (4, 5) + evict a's tail block 1
    assert c.stats.num_evictions == 1
    assert c.num_cached_tokens(toks(0, 9)) == 4  # a's head block 0 survived
    with pytest.raises(OutOfBlocksError):
        c.acquire("y", toks(900, 8), 8)  # 1 evictable, 0 free; pinned blocks are never evicted
    assert c.holds("y") is False and c.num_evictable == 1  # a failed acquire changes nothing
    c.acquire("z", toks(900, 4), 4)
    assert c.stats.num_evictions == 2 and c.num_cached_tokens(toks(0, 9)) == 0


def test_duplicate_block_stays_private_and_is_freed() -> None:
    c = cache()
    c.acquire("a", toks(0, 8), 8)
    c.acquire("b", toks(0, 8), 8)  # concurrent: neither is committed yet, both compute
    assert c.commit("a", toks(0, 8)) == 2
    assert c.commit("b", toks(0, 8)) == 0  # names taken: b's blocks stay private
    c.release("b")
    assert (c.allocator.num_free, c.num_cached) == (14, 2)


def test_failed_and_cancelled_requests_leak_nothing() -> None:
    c = cache(num_blocks=10)
    c.acquire("a", toks(0, 12), 16)
    c.commit("a", toks(0, 12))
    with pytest.raises(ValueError, match="already"):
        c.acquire("a", toks(0, 4), 4)
    with pytest.raises(OutOfBlocksError):
        c.acquire("big", toks(0, 12), 40)  # 3 hits + 7 fresh > 6 free
    assert [c.ref_count(i) for i in range(4)] == [1, 1, 1, 1]
    c.acquire("b", toks(0, 12), 16)  # hits 2 (keeps the last block to compute), pins them
    c.release("b")  # cancelled before prefill: nothing committed
    c.release("a")
    c.release("never-acquired")
    assert c.num_pinned == 0
    assert c.num_available == 10
    c.clear()
    assert c.allocator.num_free == 10 and c.num_cached == 0 and not c.allocator._tables


def test_decode_side_commits_prompt_and_answer_for_the_next_turn() -> None:
    c = cache()
    prompt, answer = toks(0, 6), toks(50, 5)
    c.acquire("t1", prompt, len(prompt) + len(answer))  # 11 tokens: 3 blocks
    c.commit("t1", prompt)  # after the pull: 1 full block
    assert c.commit("t1", prompt + answer[:-1]) == 1  # at the end: 10 tokens with KV, 2 full blocks
    c.release("t1")
    nxt = prompt + answer + toks(200, 3)
    assert c.missing(block_hashes(nxt, BS)) == (2,)  # a pull moves only the third block and the tail
    assert c.acquire("t2", nxt, 20, min_uncached_tokens=0).num_cached_tokens == 8


def test_disabled_cache_never_hits() -> None:
    c = cache(enabled=False)
    c.acquire("a", toks(0, 8), 8)
    assert c.commit("a", toks(0, 8)) == 0
    c.release("a")
    assert c.acquire("b", toks(0, 8), 8).num_cached_tokens == 0
    assert c.allocator.num_free == 14 and c.num_cached == 0
