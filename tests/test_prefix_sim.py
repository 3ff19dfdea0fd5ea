"""PrefixSimulator: caching off is the plain simulator; hits, partial pulls and local prefills by hand."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from jaxserve.core.plan import parse_deployment
from jaxserve.core.scheduling import PrefixPolicy
from models.config import get_config
from placement.conversations import ConversationSpec, SharedPrefixWorkload, generate_conversations
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, load_profile
from placement.prefix_sim import PrefixSimulator, simulate_prefix
from placement.simulator import SimOptions, simulate
from placement.slo import SloSpec
from placement.workload import Workload

TIMESTAMPS = (
    "prefill_start_at",
    "first_token_at",
    "transfer_start_at",
    "transfer_end_at",
    "decode_start_at",
    "finish_at",
)


@pytest.fixture(scope="module")
def a100() -> tuple[LatencyProvider, ClusterSpec]:
    device = get_device("a100-80gb")
    latency = LatencyProvider(get_config("opt-13b", "float16"), device, load_profile("a100-80gb-distserve"))
    return latency, ClusterSpec(device, 1, 8)


def test_caching_off_is_exactly_the_plain_simulator(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    # Later turns arrive when the previous one finished (closed loop); replayed as a plain trace with
    # those arrival times, the cache-blind simulator gives every request the same timestamps.
    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=2xtp2,decode=2xtp1").assign_devices(8)
    shared = generate_conversations(ConversationSpec(), 60, np.random.default_rng(0)).at_rate(6.0)
    off, stats = simulate_prefix(plan, latency, cluster, shared, policy=PrefixPolicy(enabled=False))
    assert off.num_finished == len(shared)
    order = np.argsort(off.arrival_at, kind="stable")
    w = shared.workload
    trace = Workload(off.arrival_at[order], w.input_lens[order], w.output_lens[order], w.rate)
    plain = simulate(plan, latency, cluster, trace)
    for name in TIMESTAMPS:
        assert np.array_equal(getattr(plain, name), getattr(off, name)[order], equal_nan=True), name
    total = int(w.input_lens.sum())
    assert stats.computed_tokens == stats.prompt_tokens == total and stats.hit_rate == 0.0
    single = int(w.input_lens[w.output_lens == 1].sum())  # never pulled
    assert stats.transferred_tokens == total - single


def test_next_turn_is_sent_think_time_after_the_previous_finishes(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1").assign_devices(8)
    shared = generate_conversations(ConversationSpec(), 10, np.random.default_rng(2)).at_rate(1.0)
    result, _ = simulate_prefix(plan, latency, cluster, shared)
    for i, j in enumerate(shared.next_turn):
        if j >= 0:
            assert result.arrival_at[j] == pytest.approx(result.finish_at[i] + shared.think_s[j])


TINY = ConversationSpec(
    num_system_prompts=1,
    system_prompt_tokens=8,
    min_turns=2,
    max_turns=2,
    user_tokens=3,
    answer_tokens=5,
    think_time_s=30.0,
    vocab_size=1000,
)


def _tiny_run(a100: tuple[LatencyProvider, ClusterSpec], policy: PrefixPolicy) -> PrefixSimulator:
    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1").assign_devices(8)
    shared = generate_conversations(TINY, 1, np.random.default_rng(5)).at_rate(1.0)
    sim = PrefixSimulator(plan, latency, cluster, shared, options=SimOptions.planning(block_size=4), policy=policy)
    sim.run()
    return sim


def test_second_turn_prefills_the_suffix_and_pulls_only_missing_blocks(
    a100: tuple[LatencyProvider, ClusterSpec],
) -> None:
    # Turn 1: 11 prompt tokens (8 system + 3 user), answer 5. Turn 2: 19 tokens.
    # The prefill cache saw turn 1's prompt: 2 full blocks (8 tokens) -> turn 2 computes 11.
    # The decode cache kept prompt + answer but the last token (15 tokens): 3 blocks -> pull 19 - 12 = 7.
    sim = _tiny_run(a100, PrefixPolicy())
    stats = sim.stats()
    assert (stats.prompt_tokens, stats.computed_tokens, stats.transferred_tokens) == (30, 22, 18)
    assert stats.kv_bytes_moved == 18 * sim.kv_bytes_per_token
    model = sim.prefills[0].model
    host_s = sim.prefills[0].overhead.step_s(19, 1, True)  # the step's host overhead, over its 19-token context
    assert sim.first_token_at[1] - sim.prefill_start_at[1] == pytest.approx(
        model.prefill_stage_s(11.0, 11.0 * (11 + 2 * 8), 1) + host_s
    )
    assert all(c.num_pinned == 0 for c in sim.prefill_caches + sim.decode_caches)
    assert sim.decodes[0].free_blocks == sim.decode_caches[0].num_available == sim.decode_caches[0].num_blocks


def test_short_uncached_suffix_is_prefilled_on_the_decode_instance(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    # Threshold 8: turn 1 lacks 11 tokens on the decode side (remote); turn 2 lacks 7 (local, no pull).
    # The local prefill keeps one token to compute, so it starts from the 12 cached tokens.
    sim = _tiny_run(a100, PrefixPolicy(local_prefill_tokens=8))
    stats = sim.stats()
    assert stats.num_local_prefills == 1
    assert (stats.computed_tokens, stats.transferred_tokens) == (11 + 7, 11)
    assert sim.transfer_end_at[1] == sim.transfer_start_at[1] == sim.first_token_at[1]
    model = sim.decodes[0].model
    host_s = sim.decodes[0].overhead.step_s(19, 1, True)  # the mixed step's host overhead (19-token prompt)
    assert sim.first_token_at[1] - sim.prefill_start_at[1] == pytest.approx(
        model.chunk_stage_s(7.0, 7.0 * 31, 1, 0, 0) + host_s
    )
    assert sim.finish_at[1] > sim.first_token_at[1]
    assert all(c.num_pinned == 0 for c in sim.prefill_caches + sim.decode_caches)


def test_caching_saves_work_and_leaks_nothing_under_load(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=2xtp2,decode=2xtp1").assign_devices(8)
    shared = generate_conversations(ConversationSpec(), 60, np.random.default_rng(0)).at_rate(6.0)
    off, s_off = simulate_prefix(plan, latency, cluster, shared, policy=PrefixPolicy(enabled=False))
    sim = PrefixSimulator(plan, latency, cluster, shared, policy=PrefixPolicy(local_prefill_tokens=128))
    on = sim.run()
    s_on = sim.stats()
    assert on.num_finished == off.num_finished == len(shared)
    ideal = shared.ideal_hit_tokens(16)
    assert s_on.prompt_tokens - s_on.computed_tokens <= ideal
    assert s_off.hit_rate == 0.0 and s_on.hit_rate > 0.5 and s_on.num_local_prefills > 0
    assert s_on.transferred_tokens < 0.3 * s_off.transferred_tokens
    assert np.nanpercentile(on.ttft_s, 90) < np.nanpercentile(off.ttft_s, 90)
    for c, d in zip(sim.decode_caches, sim.decodes, strict=True):
        assert c.num_pinned == 0 and d.free_blocks == c.num_available == c.num_blocks
    assert all(c.num_pinned == 0 for c in sim.prefill_caches)


def test_refuses_per_phase_modes(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    latency, cluster = a100
    shared = generate_conversations(TINY, 1, np.random.default_rng(0)).at_rate(1.0)
    with pytest.raises(ValueError, match="full mode"):
        plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
        PrefixSimulator(plan, latency, cluster, shared, options=dataclasses.replace(SimOptions(), mode="prefill"))


@pytest.mark.parametrize("spec", ["colocated:tp1", "colocated:tp1,chunk=8"])
def test_colocated_second_turn_starts_after_its_cached_prefix(
    a100: tuple[LatencyProvider, ClusterSpec], spec: str
) -> None:
    # One pool holds turn 1's prompt + answer but the last token (15 tokens: 3 blocks of 4), so
    # turn 2 (19 tokens) computes 19 - 12 = 7; nothing crosses a link. With chunk=8 the policy
    # cuts turn 2 as [0, 8) [8, 16) [16, 19): the first chunk is cached whole, the second runs
    # [12, 16): the same 7 tokens, over 2 steps.
    latency, cluster = a100
    plan = parse_deployment(spec).assign_devices(8)
    shared = generate_conversations(TINY, 1, np.random.default_rng(5)).at_rate(1.0)
    sim = PrefixSimulator(plan, latency, cluster, shared, options=SimOptions.planning(block_size=4))
    sim.run()
    stats = sim.stats()
    assert (stats.prompt_tokens, stats.computed_tokens, stats.transferred_tokens) == (30, 11 + 7, 0)
    assert stats.kv_bytes_moved == 0.0 and stats.num_colocated_evictions == 0
    (cache,) = sim.colocated_caches
    assert cache.stats.num_hit_tokens == 12
    assert cache.num_pinned == 0 and sim.colocated[0].free_blocks == cache.num_available == cache.num_blocks
    if spec == "colocated:tp1":  # turn 2 prefilled in one step: its 7 new tokens over 12 cached
        c = sim.colocated[0]
        host_s = c.overhead.step_s(19, 1, True)
        assert sim.first_token_at[1] - sim.prefill_start_at[1] == pytest.approx(
            c.model.chunk_stage_s(7.0, 7.0 * (7 + 2 * 12), 1, 0, 0) + host_s
        )


def test_colocated_caching_off_is_exactly_the_plain_simulator(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    latency, cluster = a100
    plan = parse_deployment("colocated:2xtp1,chunk=256").assign_devices(8)
    shared = generate_conversations(ConversationSpec(), 30, np.random.default_rng(0)).at_rate(2.0)
    off, stats = simulate_prefix(plan, latency, cluster, shared, policy=PrefixPolicy(enabled=False))
    assert off.num_finished == len(shared)
    order = np.argsort(off.arrival_at, kind="stable")
    w = shared.workload
    trace = Workload(off.arrival_at[order], w.input_lens[order], w.output_lens[order], w.rate)
    plain = simulate(plan, latency, cluster, trace)
    for name in TIMESTAMPS:
        assert np.array_equal(getattr(plain, name), getattr(off, name)[order], equal_nan=True), name
    assert stats.computed_tokens == stats.prompt_tokens and stats.transferred_tokens == 0


def test_colocated_caching_saves_work_and_leaks_nothing(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    latency, cluster = a100
    plan = parse_deployment("colocated:tp1").assign_devices(8)
    shared = generate_conversations(ConversationSpec(), 30, np.random.default_rng(0)).at_rate(2.0)
    off, _ = simulate_prefix(plan, latency, cluster, shared, policy=PrefixPolicy(enabled=False))
    sim = PrefixSimulator(plan, latency, cluster, shared)
    on = sim.run()
    s_on = sim.stats()
    assert on.num_finished == len(shared)
    assert s_on.hit_rate > 0.5 and s_on.prompt_tokens - s_on.computed_tokens <= shared.ideal_hit_tokens(16)
    assert np.nanpercentile(on.ttft_s, 90) < np.nanpercentile(off.ttft_s, 90)
    (cache,) = sim.colocated_caches
    assert cache.num_pinned == 0 and sim.colocated[0].free_blocks == cache.num_available == cache.num_blocks


def test_verdict_counts_only_the_steady_state_window(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1").assign_devices(8)
    shared = generate_conversations(ConversationSpec(), 41, np.random.default_rng(1)).at_rate(0.5)
    slo = SloSpec(0.25, 0.1)
    sim = PrefixSimulator(plan, latency, cluster, shared, slo, warmup_fraction=0.25)
    result = sim.run()
    first = shared.workload.arrival_at[:41]
    assert sim.window == (first[10], first[40])
    mask = sim.measured
    assert mask.sum() < len(shared) and np.all(result.arrival_at[mask] >= first[10])
    ok = (result.ttft_s[mask] <= 0.25) & (result.tpot_s[mask] <= 0.1)
    assert result.verdict == (ok.mean() >= 0.9)


@pytest.mark.slow
def test_caching_raises_goodput_of_a_prefill_bound_deployment(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    from placement.goodput import max_rate
    from placement.prefix_sim import prefix_goodput_search

    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=tp1,decode=2xtp1").assign_devices(8)
    convs = generate_conversations(ConversationSpec(), 300, np.random.default_rng(0))
    slo = SloSpec(0.25, 0.1)
    off = max_rate(prefix_goodput_search(plan, latency, cluster, convs, slo, policy=PrefixPolicy(enabled=False)), 0.05)
    on = max_rate(prefix_goodput_search(plan, latency, cluster, convs, slo, policy=PrefixPolicy()), 0.05)
    assert on > 1.2 * off


def test_local_prefills_take_batch_room(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    # Threshold 100 > every prompt: all requests prefill on the decode instance; with a batch of 1
    # they must run one after another (a local prefill holds its slot from admission on).
    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1").assign_devices(8)
    shared = generate_conversations(TINY, 4, np.random.default_rng(0)).at_rate(100.0)
    opts = SimOptions.planning(block_size=4, max_decode_batch=1)
    sim = PrefixSimulator(plan, latency, cluster, shared, options=opts, policy=PrefixPolicy(local_prefill_tokens=100))
    result = sim.run()
    assert sim.stats().num_local_prefills == len(shared) == result.num_finished
    spans = sorted(zip(result.prefill_start_at, result.finish_at, strict=True))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def test_small_decode_pool_evicts_the_previous_turn(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    # Runtime-sized pools (block 4). Decode, 6 blocks: turn 1 reserves 4 (16 tokens) and leaves 3
    # named; turn 2 reserves 6 (24 tokens): its 3 cached ones + 3 free, no eviction, pulls 19 - 12.
    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1").assign_devices(8)
    shared = generate_conversations(TINY, 1, np.random.default_rng(5)).at_rate(1.0)
    sim = PrefixSimulator(
        plan,
        latency,
        cluster,
        shared,
        options=SimOptions.planning(block_size=4),
        decode_pool_blocks=6,
        prefill_pool_blocks=3,
    )
    sim.run()
    stats = sim.stats()
    assert sim.decode_caches[0].num_blocks == 6 and sim.prefill_caches[0].num_blocks == 3
    assert stats.transferred_tokens == 11 + 7 and stats.num_decode_evictions == 0
    # The 3-block prefill pool: turn 2 (19 tokens, 5 blocks) cannot be pinned -> computed in full.
    assert stats.computed_tokens == 11 + 19 and stats.num_prefill_evictions == 0


def test_identical_prompts_sent_together_wait_for_the_first(a100: tuple[LatencyProvider, ClusterSpec]) -> None:
    # Four single-turn requests sent at once (11-token prompts, block size 4): an unrelated prompt runs
    # alone, and three copies of one prompt queue behind it. The runtime's rule (`prompts_to_defer`)
    # runs one copy and holds back the repeats until its 2 full blocks are named, so each repeat
    # computes only its last 3 tokens (the next batch holds both repeats, and again only one runs).
    # Without the rule the three copies would share a batch and compute 11 tokens each.
    latency, cluster = a100
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1").assign_devices(8)
    other, prompt = np.arange(200, 211, dtype=np.int64), np.arange(100, 111, dtype=np.int64)
    n = 4
    shared = SharedPrefixWorkload(
        workload=Workload(np.zeros(n), np.full(n, 11), np.full(n, 4), 1.0),
        prompts=(other, prompt, prompt, prompt),
        answers=(np.arange(4, dtype=np.int64),) * n,
        conversation=np.arange(n),
        turn=np.zeros(n, dtype=np.int64),
        think_s=np.zeros(n),
        next_turn=np.full(n, -1),
        num_first=n,
    )
    sim = PrefixSimulator(
        plan, latency, cluster, shared, options=SimOptions.planning(block_size=4), policy=PrefixPolicy()
    )
    sim.run()
    stats = sim.stats()
    assert np.isfinite(sim.finish_at).all()
    assert all(c.num_pinned == 0 for c in sim.prefill_caches + sim.decode_caches)
    assert (stats.computed_tokens, stats.num_deferred) == (11 + 11 + 3 + 3, 2 + 1)
    assert sim.prefill_start_at[1] < sim.prefill_start_at[2] < sim.prefill_start_at[3]
