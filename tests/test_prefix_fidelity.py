"""The runtime and the simulator evict the same blocks in the same order (prefix caching under pressure).

Two conversations over one shared system block take turns (A1, B1, A2, B2) one at a time, on pools
small enough that every second turn evicts: 4 prefill blocks, 6 decode blocks, block size 8. With
one request in flight at a time no decision depends on timing, so the runtime's caches (real
`Controller`, fake engine) and `PrefixSimulator`'s (replaying the runtime's send times) must see the
same event sequence; both are checked against the sequence computed by hand below.

Blocks (names are chained, so equal names mean equal prefixes): `s` the system block; `a`/`b` the
user blocks of A1/B1; `xa`/`xb` the first 8 answer tokens of A1/B1 (the decode side names prompt
+ answer but its last token at the end); `a2`/`b2` the last block of A2/B2 (answer token 9 + 7 new).

Prefill pool (4): A1 [s a] computes 16; B1 hits s, computes 8 (LRU: a b s); A2 [s a xa a2] hits
s a, needs 2 blocks with 1 free: evicts b; B2 [s b xb b2] hits s, needs 3 with 0 free: evicts
a2 xa a0 (a released request's tail becomes evictable first). Prefill evictions: b, a2, xa, a.

Decode pool (6): A1 reserves 4 (16 + 9), names s a, at the end xa; B1 hits s (pulls 8), names b,
xb (LRU: xa a xb b s, 1 free); A2 hits s a xa (pulls 8), needs 2 with 1 free: evicts xb; B2 hits
s b (pulls 16), needs 3 with 1 free: evicts a2 xa. Decode evictions: xb, a2, xa.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.prefix_cache import BlockHash, PrefixCache, block_hashes
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.fake import fake_engine_factory, reference_tokens
from jaxserve.runtime.instances import build_engines
from models.config import get_config
from placement.conversations import ConversationSet, ConversationSpec, Turn
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider
from placement.prefix_sim import PrefixSimulator
from placement.simulator import SimOptions

pytestmark = pytest.mark.timeout(120)

CFG = get_config("opt-tiny")
V = CFG.vocab_size
BS = 8
PREFILL_BLOCKS, DECODE_BLOCKS = 4, 6
SYSTEM = tuple(range(1, 9))


def _turns() -> list[Turn]:
    """A1, B1, A2, B2 with the fake engine's answers (so the runtime's next prompts are the trace's)."""
    a1 = SYSTEM + tuple(range(11, 19))
    b1 = SYSTEM + tuple(range(21, 29))
    ans_a1, ans_b1 = reference_tokens(a1, 9, V), reference_tokens(b1, 9, V)
    a2 = a1 + tuple(ans_a1) + tuple(range(31, 38))  # 32 tokens
    b2 = b1 + tuple(ans_b1) + tuple(range(41, 48))
    arr = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return [
        Turn(0, 0, 0.0, arr(a1), arr(ans_a1)),
        Turn(0, 1, 1.0, arr(a2), arr(reference_tokens(a2, 4, V))),
        Turn(1, 0, 0.0, arr(b1), arr(ans_b1)),
        Turn(1, 1, 1.0, arr(b2), arr(reference_tokens(b2, 4, V))),
    ]


def _trace():
    # at_rate orders first turns by start, then later turns by start + think: A1, B1, A2, B2.
    shared = ConversationSet(ConversationSpec(), tuple(_turns()), np.asarray([1.0, 1.0])).at_rate(1.0)
    assert [(int(c), int(t)) for c, t in zip(shared.conversation, shared.turn, strict=True)] == [
        (0, 0), (1, 0), (0, 1), (1, 1)
    ]  # fmt: skip
    return shared


def _expected() -> tuple[list[BlockHash], list[BlockHash]]:
    a1, a2, b1, b2 = (t.prompt for t in _turns())
    s, a, xa, a2_ = block_hashes(a2, BS)
    _, b, xb, _b2 = block_hashes(b2, BS)
    assert block_hashes(a1, BS) == (s, a) and block_hashes(b1, BS) == (s, b)
    return [b, a2_, xa, a], [xb, a2_, xa]


def _watch(caches: list[PrefixCache]) -> list[list[tuple[str, str | None, BlockHash | None, int]]]:
    logs: list[list[tuple[str, str | None, BlockHash | None, int]]] = []
    for cache in caches:
        log: list[tuple[str, str | None, BlockHash | None, int]] = []
        cache.observer = lambda ev, rid, name, idx, log=log: log.append((ev, rid, name, idx))
        logs.append(log)
    return logs


def _evicted(log) -> list[BlockHash]:
    return [name for ev, _, name, _ in log if ev == "evict"]


def _hits(log) -> list[int]:
    return [idx for ev, _, _, idx in log if ev == "acquire"]


def test_runtime_and_simulator_evict_the_same_blocks_in_the_same_order() -> None:
    shared = _trace()
    expected_prefill, expected_decode = _expected()

    # The runtime: one request at a time, each turn's prompt from the previous answer it really gave.
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True),
        limits=ServingLimits(block_size=BS, num_kv_blocks=DECODE_BLOCKS),
        prefill_num_kv_blocks=PREFILL_BLOCKS,
    )
    c = Controller(build_engines(plan, fake_engine_factory(CFG)), plan, config)
    rt_prefill, rt_decode = _watch([c.prefill_instances[0].cache, c.decode_instances[0].cache])
    c.start()
    try:
        pulled = []
        for i, prompt in enumerate(shared.prompts):
            ids, last = c.submit(
                GenerateRequest(
                    str(i),
                    tuple(int(x) for x in prompt),
                    SamplingParams(max_tokens=len(shared.answers[i]), ignore_eos=True),
                )
            ).collect(timeout_s=60)
            assert ids == shared.answers[i].tolist()
            assert last.timings is not None
            pulled.append(last.timings.kv_transfer_tokens)
    finally:
        c.shutdown(drain_timeout_s=0)

    # The simulator on the same trace, each request sent long after the previous one finished.
    device = get_device("cpu")
    sim = PrefixSimulator(
        plan,
        LatencyProvider(CFG, device),
        ClusterSpec(device, 1, 8),
        shared,
        options=SimOptions.planning(block_size=BS),
        prefill_pool_blocks=PREFILL_BLOCKS,
        decode_pool_blocks=DECODE_BLOCKS,
        sent_at=np.asarray([0.0, 10.0, 20.0, 30.0]),
    )
    sim_prefill, sim_decode = _watch([sim.prefill_caches[0], sim.decode_caches[0]])
    result = sim.run()
    assert result.finished.all()
    assert result.arrival_at.tolist() == [0.0, 10.0, 20.0, 30.0]  # a replay: nothing rescheduled

    assert _evicted(rt_prefill) == _evicted(sim_prefill) == expected_prefill
    assert _evicted(rt_decode) == _evicted(sim_decode) == expected_decode
    # Every event (acquire with its hits, commit of each name at its position, release), in order.
    assert [e[0] != "acquire" or e[3] for e in rt_decode] == [e[0] != "acquire" or e[3] for e in sim_decode]
    strip = lambda log: [(ev, name, idx) for ev, _, name, idx in log]  # noqa: E731
    assert strip(rt_prefill) == strip(sim_prefill)
    assert strip(rt_decode) == strip(sim_decode)
    assert _hits(rt_prefill) == [0, 1, 2, 1]  # blocks
    assert _hits(rt_decode) == [0, 1, 3, 2]
    assert pulled == [16, 8, 8, 16] == sim._transferred.tolist()
    stats = sim.stats()
    assert stats.computed_tokens == 16 + 8 + 16 + 24
    assert stats.num_prefill_evictions == 4 and stats.num_decode_evictions == 3
