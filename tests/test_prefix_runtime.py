"""Prefix caching in the real runtime loops, over the hand-computable fake engine.

The fake engine recovers each row's context from the paged pool through its block table, so a
cached block holding the wrong KV, or a pull writing to the wrong blocks, changes the tokens:
every stream is checked against `reference_tokens`. Counts (cached tokens, positions pulled,
bytes) are computed by hand for a two-turn conversation with block size 8.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import jax
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import Engine, KVPages, PrefilledSequence, PrefillItem, PrefillResult, StepBatch
from jaxserve.runtime.engines.fake import FakeEngine, fake_engine_factory, reference_tokens
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.kv_connectors.base import TransferState
from jaxserve.runtime.kv_connectors.in_process import InProcessHandle, InProcessTransfer
from models.config import get_config

CFG = get_config("opt-tiny")  # vocab 512, 256 positions, 4 heads, 2 layers
V = CFG.vocab_size
BS = 8
TOKEN_BYTES = 2 * CFG.num_layers * CFG.num_heads * 4  # the fake's K and V: [L, T, H, 1] float32


def _controller(spec: str, factory=None, transfer=None, **overrides) -> Controller:
    config = ControllerConfig(limits=ServingLimits(block_size=BS, num_kv_blocks=64), **overrides)
    plan = parse_deployment(spec)
    c = Controller(build_engines(plan, factory or fake_engine_factory(CFG)), plan, config, transfer=transfer)
    c.start()
    return c


def _req(rid: str, prompt: Sequence[int], max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _caches(c: Controller):
    return [inst.cache for inst in c.instances]


def _assert_nothing_pinned(c: Controller) -> None:
    deadline = time.monotonic() + 10
    while any(cache.num_pinned for cache in _caches(c)) and time.monotonic() < deadline:
        time.sleep(0.01)
    for inst in c.instances:
        assert inst.cache.num_pinned == 0, inst.name
        assert inst.cache.num_available == inst.cache.num_blocks, inst.name
    assert c.stats().num_live_requests == 0


P1 = tuple(range(1, 21))  # 20 tokens: 2 full blocks + 4
NEW = tuple(range(100, 110))  # the user's next message: 10 tokens


def _two_turns(c: Controller):
    ids1, last1 = c.submit(_req("t1", P1)).collect(timeout_s=60)
    p2 = P1 + tuple(ids1) + NEW  # 36 tokens: 4 full blocks + 4
    ids2, last2 = c.submit(_req("t2", p2)).collect(timeout_s=60)
    assert ids1 == reference_tokens(P1, 6, V) and ids2 == reference_tokens(p2, 6, V)
    assert last1.timings is not None and last2.timings is not None
    return last1.timings, last2.timings


@pytest.mark.parametrize("caching", [False, True])
def test_two_turns_disaggregated_hits_and_bytes_by_hand(caching: bool) -> None:
    c = _controller("disagg:prefill=tp2,decode=tp1", prefix_policy=PrefixPolicy(enabled=caching))
    try:
        t1, t2 = _two_turns(c)
        # Turn 1: nothing cached; all 20 positions pulled (padded to 32 in the dense copy).
        assert (t1.cached_prompt_tokens, t1.kv_transfer_tokens, t1.kv_transfer_bytes) == (0, 20, 32 * TOKEN_BYTES)
        if not caching:
            assert (t2.cached_prompt_tokens, t2.kv_transfer_tokens) == (0, 36)
            assert t2.kv_transfer_bytes == 64 * TOKEN_BYTES
            return
        # Turn 2 (36 tokens): the prefill cache holds turn 1's prompt blocks (2 full = 16 tokens);
        # the decode cache holds turn 1's prompt + answer but its last token (25 tokens = 3 full
        # blocks = 24), so the pull moves 36 - 24 = 12 positions (padded to 16).
        assert t2.cached_prompt_tokens == 16
        assert (t2.kv_transfer_tokens, t2.kv_transfer_bytes) == (12, 16 * TOKEN_BYTES)
        prefill, decode = c.prefill_instances[0], c.decode_instances[0]
        assert prefill.num_computed_tokens == 20 + 20  # turn 2 computed 36 - 16
        assert prefill.cache.num_cached == 4  # p2's 4 full blocks, the first 2 being P1's
        assert decode.cache.num_cached == 5  # turn 2 finished: 36 + 5 = 41 tokens -> 5 blocks (3 of turn 1)
        stats = c.stats()
        assert stats.kv_transfer_tokens == 20 + 12
        assert {s.name: s.num_prefix_hit_tokens for s in stats.instances} == {"prefill-0": 16, "decode-0": 24}
        _assert_nothing_pinned(c)
    finally:
        c.shutdown(drain_timeout_s=0)


def test_local_prefill_of_a_short_uncached_suffix_moves_nothing() -> None:
    policy = PrefixPolicy(local_prefill_tokens=16)
    c = _controller("disagg:prefill=tp1,decode=tp1", prefix_policy=policy)  # enabled: the policy's default
    try:
        t1, t2 = _two_turns(c)
        assert t1.prefill_instance == "prefill-0" and t1.kv_transfer_tokens == 20  # 20 uncached >= 16: remote
        # Turn 2 lacks 36 - 24 = 12 < 16 tokens on the decode instance: prefilled there, no pull.
        assert (t2.prefill_instance, t2.decode_instance) == ("decode-0", "decode-0")
        assert (t2.cached_prompt_tokens, t2.kv_transfer_tokens, t2.kv_transfer_bytes) == (24, 0, 0)
        assert c.decode_instances[0].num_local_prefills == 1
        assert c.decode_instances[0].num_local_prefill_tokens == 12
        assert c.stats().num_transfers == 1
        _assert_nothing_pinned(c)
    finally:
        c.shutdown(drain_timeout_s=0)


@pytest.mark.parametrize("spec", ["colocated:tp1", "colocated:tp2,chunk=8"])
def test_colocated_hits_its_own_pool(spec: str) -> None:
    c = _controller(spec, prefix_policy=PrefixPolicy(enabled=True))
    try:
        _, t2 = _two_turns(c)
        assert t2.cached_prompt_tokens == 24  # prompt + answer of turn 1 but its last token: 3 blocks
        _assert_nothing_pinned(c)
    finally:
        c.shutdown(drain_timeout_s=0)


def test_routing_sends_a_conversation_back_to_the_instances_holding_it() -> None:
    c = _controller("disagg:prefill=2xtp1,decode=2xtp1", prefix_policy=PrefixPolicy(enabled=True))
    try:
        convs = [tuple(range(1 + 40 * k, 21 + 40 * k)) for k in range(4)]
        first = {}
        for k, p in enumerate(convs):
            ids, last = c.submit(_req(f"a{k}", p)).collect(60)
            first[k] = (last.timings.prefill_instance, last.timings.decode_instance, ids)
        for k, p in enumerate(convs):
            p2 = p + tuple(first[k][2]) + NEW
            ids, last = c.submit(_req(f"b{k}", p2)).collect(60)
            assert ids == reference_tokens(p2, 6, V)
            t = last.timings
            assert (t.prefill_instance, t.decode_instance) == first[k][:2]
            assert (t.cached_prompt_tokens, t.kv_transfer_tokens) == (16, 12)
        _assert_nothing_pinned(c)
    finally:
        c.shutdown(drain_timeout_s=0)


# ---- the leak test: cancels, a failed pull, a dead instance ------------------------------------


class _FailedHandle:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.num_bytes = 0
        self.seconds = 0.0

    def poll(self) -> TransferState:
        return TransferState.FAILED

    def wait(self, timeout_s: float | None = None) -> TransferState:
        return TransferState.FAILED

    def insert(self, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        raise AssertionError("a failed pull must never be inserted")


class _FlakyTransfer:
    """In-process pulls, except the first and every `every`-th after it fail.

    Failing the first makes the fault certain: how many pulls an instance starts depends on which
    cancels land before their pull, i.e. on timing."""

    def __init__(self, engine: Engine, every: int) -> None:
        self.inner = InProcessTransfer(engine)
        self.every = every
        self.num_started = 0

    def start(self, seq: PrefilledSequence) -> InProcessHandle | _FailedHandle:
        self.num_started += 1
        if self.num_started % self.every == 1:
            return _FailedHandle(seq.request_id)
        return self.inner.start(seq)


class _DyingEngine(FakeEngine):
    die_at_decode: int = 10**9
    die_at_prefill: int = 10**9  # a caching prefill instance prefills batches with no cache hit densely

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        if self.num_prefill_calls + 1 >= self.die_at_prefill:
            raise RuntimeError("device lost")
        return super().prefill(items)

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        if self.num_decode_calls + 1 >= self.die_at_decode:
            raise RuntimeError("device lost")
        return super().decode_step(batch, pages)


def _dying(name_role: str, die_at_decode: int, die_at_prefill: int = 10**9):
    counts: dict[str, int] = {}

    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> FakeEngine:
        i = counts.get(spec.role, 0)
        counts[spec.role] = i + 1
        if f"{spec.role}-{i}" == name_role:
            engine = _DyingEngine(CFG, devices, tp=spec.tp, pp=spec.pp)
            engine.die_at_decode = die_at_decode
            engine.die_at_prefill = die_at_prefill
            return engine
        return FakeEngine(CFG, devices, tp=spec.tp, pp=spec.pp)

    return factory


def _conversation_load(c: Controller, seed: int, cancel_share: float) -> None:
    """3 rounds over 6 conversations sharing a system prompt; some requests are cancelled mid-stream."""
    rng = random.Random(seed)
    system = tuple(range(300, 316))
    history = {k: system + tuple(range(10 * k, 10 * k + 5)) for k in range(6)}
    for rnd in range(3):
        streams = {k: c.submit(_req(f"r{rnd}-{k}", history[k], max_tokens=12)) for k in history}
        cancelled = {k for k in history if rng.random() < cancel_share}
        for k in cancelled:
            time.sleep(rng.random() * 0.01)
            streams[k].cancel()
        for k, stream in streams.items():
            ids, last = stream.collect(timeout_s=60)
            if k in cancelled and last.finish_reason == "abort":
                continue
            assert ids == reference_tokens(history[k], 12, V), (rnd, k)
            history[k] = history[k] + tuple(ids) + (7, 7, 7)


@pytest.mark.parametrize(
    "spec,factory,transfer_every",
    [
        ("disagg:prefill=2xtp1,decode=2xtp1", None, 3),  # every third pull fails (recomputed)
        ("disagg:prefill=2xtp1,decode=2xtp1", _dying("decode-0", 9), 0),  # a decode instance dies
        ("disagg:prefill=2xtp1,decode=2xtp1", _dying("prefill-0", 1, die_at_prefill=1), 0),  # a prefill instance dies
        ("colocated:2xtp1,chunk=8", _dying("colocated-0", 12), 0),
    ],
    ids=["failed-pulls", "dead-decode", "dead-prefill", "dead-colocated"],
)
def test_nothing_stays_pinned_after_cancels_and_faults(spec, factory, transfer_every) -> None:
    transfer = (lambda engine: _FlakyTransfer(engine, transfer_every)) if transfer_every else None
    policy = PrefixPolicy(local_prefill_tokens=12)
    c = _controller(spec, factory=factory, transfer=transfer, prefix_policy=policy)
    try:
        _conversation_load(c, seed=1, cancel_share=0.3)
        if transfer_every:
            assert c.stats().faults.num_failed_pulls > 0
        if factory is not None:
            assert any(inst.error is not None for inst in c.instances)
        assert sum(s.num_prefix_hit_tokens for s in c.stats().instances) > 0
        live = [inst for inst in c.instances if inst.error is None]
        for inst in live:
            assert inst.cache.num_pinned == 0, inst.name
            assert inst.cache.num_available == inst.cache.num_blocks, inst.name
        assert c.stats().num_live_requests == 0
    finally:
        c.shutdown(drain_timeout_s=0)


def test_samples_of_one_prompt_share_its_blocks() -> None:
    """n > 1: the samples after the first find the prompt cached (a duplicate waits one batch for it)."""
    c = _controller("disagg:prefill=tp1,decode=tp1", prefix_policy=PrefixPolicy(enabled=True))
    try:
        streams = [c.submit(_req(f"n{j}", P1)) for j in range(3)]
        lasts = [s.collect(timeout_s=60) for s in streams]
        assert all(ids == reference_tokens(P1, 6, V) for ids, _ in lasts)
        cached = sorted(last.timings.cached_prompt_tokens for _, last in lasts)
        assert cached == [0, 16, 16]  # 20 tokens: 2 full blocks shared, the 4-token tail computed again
        assert c.prefill_instances[0].num_computed_tokens == 20 + 4 + 4
        _assert_nothing_pinned(c)
    finally:
        c.shutdown(drain_timeout_s=0)
