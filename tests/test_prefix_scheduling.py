"""Cache-aware routing and conditional disaggregation: exact decisions from hand-computed scores."""

from __future__ import annotations

import pytest

from jaxserve.core.scheduling import (
    CachedDecodeLoad,
    CachedPrefillLoad,
    DecodeLoad,
    PrefillLoad,
    PrefixPolicy,
    choose_decode_instance,
    choose_decode_instance_cached,
    choose_prefill_instance,
    choose_prefill_instance_cached,
    prefill_locally,
    prefill_routing_score,
    prefix_prefill_work,
    prompts_to_defer,
)


def test_prefill_score_trades_cached_blocks_against_queue() -> None:
    loads = [CachedPrefillLoad(0, 100, 1), CachedPrefillLoad(10, 250, 3), CachedPrefillLoad(4, 120, 1)]
    # weight 16: scores -100, 160 - 250 = -90, 64 - 120 = -56 -> instance 2
    assert [prefill_routing_score(ld, 16.0) for ld in loads] == [-100.0, -90.0, -56.0]
    assert choose_prefill_instance_cached(loads, 16.0) == 2
    # weight 30: -100, 50, 0 -> the instance holding most of the prompt
    assert choose_prefill_instance_cached(loads, 30.0) == 1
    # weight 0: queue only -> the shortest queue
    assert choose_prefill_instance_cached(loads, 0.0) == 0


def test_prefill_ties_break_on_requests_then_index() -> None:
    loads = [CachedPrefillLoad(1, 16, 2), CachedPrefillLoad(2, 32, 1), CachedPrefillLoad(2, 32, 1)]
    assert choose_prefill_instance_cached(loads, 16.0) == 1  # all score 0; fewer requests; lower index
    with pytest.raises(ValueError):
        choose_prefill_instance_cached([], 16.0)


def test_no_cached_blocks_is_the_cache_blind_prefill_choice() -> None:
    raw = [(300, 2), (120, 4), (120, 3), (500, 1)]
    cached = [CachedPrefillLoad(0, t, r) for t, r in raw]
    blind = [PrefillLoad(t, r) for t, r in raw]
    assert choose_prefill_instance_cached(cached, 16.0) == choose_prefill_instance(blind) == 2


def test_decode_prefers_the_holder_within_the_imbalance() -> None:
    loads = [
        CachedDecodeLoad(0, num_running=4, num_waiting=0, num_free_blocks=100),
        CachedDecodeLoad(12, num_running=10, num_waiting=1, num_free_blocks=50),
        CachedDecodeLoad(3, num_running=5, num_waiting=0, num_free_blocks=80),
    ]
    # loads 4, 11, 5: within 8 of 4 -> all; most cached blocks -> 1
    assert choose_decode_instance_cached(loads, 8) == 1
    # within 6 -> {0, 2}; most cached -> 2
    assert choose_decode_instance_cached(loads, 6) == 2
    # within 0 -> only the least loaded
    assert choose_decode_instance_cached(loads, 0) == 0
    with pytest.raises(ValueError):
        choose_decode_instance_cached(loads, -1)


def test_no_cached_blocks_is_the_cache_blind_decode_choice() -> None:
    raw = [(3, 1, 10), (2, 2, 40), (4, 0, 40), (1, 3, 40)]
    cached = [CachedDecodeLoad(0, r, w, f) for r, w, f in raw]
    blind = [DecodeLoad(r, w, f) for r, w, f in raw]
    assert choose_decode_instance_cached(cached, 100) == choose_decode_instance(blind) == 1


def test_conditional_disaggregation_threshold_is_strict() -> None:
    assert prefill_locally(1000, 900, 128) is True  # 100 uncached < 128
    assert prefill_locally(1000, 872, 128) is False  # 128 is not below 128
    assert prefill_locally(50, 0, 0) is False  # threshold 0 never prefills locally
    assert prefill_locally(50, 0, 51) is True  # short prompts can skip the prefill instance entirely
    with pytest.raises(ValueError):
        prefill_locally(10, 11, 5)


def test_prefix_prefill_work_matches_the_chunk_formula() -> None:
    assert prefix_prefill_work(100, 0) == (100, 100 * 100)
    assert prefix_prefill_work(100, 64) == (36, 36 * (36 + 128))
    assert PrefixPolicy().weight(16) == 16.0 and PrefixPolicy(overlap_weight=3.5).weight(16) == 3.5


def test_repeats_of_a_prompt_in_flight_or_earlier_in_the_batch_wait() -> None:
    a, b, short = (1, 2, 3, 4, 5), (1, 2, 3, 4, 6), (7, 8, 9, 10)  # block size 4: a, b span 2 blocks
    # a repeat of an earlier member waits; a prompt differing in one token does not
    assert prompts_to_defer([a, b, a, a], [], 4) == [False, False, True, True]
    # a repeat of one in flight waits, even as the batch's first member
    assert prompts_to_defer([a, b], [a], 4) == [True, False]
    # a prompt of at most one block has no full block to share: never held back
    assert prompts_to_defer([short, short], [short], 4) == [False, False]
    assert prompts_to_defer([], [a], 4) == []
