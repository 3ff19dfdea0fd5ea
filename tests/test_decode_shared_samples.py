"""`n` > 1 on the decode side: the samples of one prompt share its full blocks (prefix caching on).

The samples of an `n` request are requests with the same prompt that reach the decode instance
together. The first one's pull brings the prompt's full blocks; the others wait for them to be
named, pin them (ref counts) and pull only the rest, each into its own copy of the last, partial
block. Checked by hand with the fake engine (whose tokens read the pool through the block tables)
and a pull slowed down so that all three samples are at the decode instance while the first pull is
in flight (before the change each reserved and pulled a whole copy), and with the tiny OPT: seeded
samples equal the same requests run one by one without caching.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
from serving_helpers import SlowFakeEngine

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import NO_PREFIX_CACHING, PrefixPolicy
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import Engine, KVPages, PrefilledSequence
from jaxserve.runtime.engines.fake import reference_tokens
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.kv_connectors.base import TransferState
from jaxserve.runtime.kv_connectors.in_process import InProcessHandle, InProcessTransfer
from models.config import get_config

CFG = get_config("opt-tiny")
BS = 8


class _SlowHandle:
    """An in-process pull that reports PENDING for `delay_s` after it started."""

    def __init__(self, inner: InProcessHandle, delay_s: float) -> None:
        self.inner = inner
        self.ready_at = time.monotonic() + delay_s
        self.request_id = inner.request_id

    @property
    def num_bytes(self) -> int:
        return self.inner.num_bytes

    @property
    def seconds(self) -> float | None:
        return self.inner.seconds

    def poll(self) -> TransferState:
        return TransferState.PENDING if time.monotonic() < self.ready_at else self.inner.poll()

    def wait(self, timeout_s: float | None = None) -> TransferState:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self.inner.wait(timeout_s)

    def insert(self, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        return self.inner.insert(num_tokens, pages, block_table)


class _SlowTransfer:
    def __init__(self, engine: Engine, delay_s: float) -> None:
        self.inner = InProcessTransfer(engine)
        self.delay_s = delay_s

    def start(self, seq: PrefilledSequence) -> _SlowHandle:
        return _SlowHandle(self.inner.start(seq), self.delay_s)


def _fake_factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> SlowFakeEngine:
    return SlowFakeEngine(CFG, devices, tp=spec.tp, pp=spec.pp, decode_delay_s=0.02)


def _warm(c: Controller, sampling: SamplingParams) -> None:
    """One request of another prompt with the same shapes: later steps compile nothing, so the samples
    reach the decode instance while the first one's (slowed) pull is still in flight."""
    prompt = tuple(range(200, 220))
    assert c.submit(GenerateRequest("warm", prompt, sampling)).collect(timeout_s=60)[0] == reference_tokens(
        prompt, sampling.max_tokens, CFG.vocab_size
    )


def test_three_samples_hold_the_prompt_blocks_once_and_pull_only_the_tail() -> None:
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True), limits=ServingLimits(block_size=BS, num_kv_blocks=64)
    )
    c = Controller(build_engines(plan, _fake_factory), plan, config, transfer=lambda engine: _SlowTransfer(engine, 0.2))
    c.start()
    try:
        prompt = tuple(range(1, 21))  # 20 tokens: 2 full blocks + 4
        sampling = SamplingParams(max_tokens=44, ignore_eos=True)  # 20 + 44 = 64 tokens: 8 blocks per sample
        _warm(c, sampling)
        streams = [c.submit(GenerateRequest(f"s{j}", prompt, sampling)) for j in range(3)]
        for s in streams:
            assert s.collect(timeout_s=60)[0] == reference_tokens(prompt, 44, CFG.vocab_size)
        decode = c.decode_instances[0]
        # Whole copies: 3 x 8 = 24 blocks. Shared: the 2 full prompt blocks once, plus each sample's own
        # 6 (its copy of the partial block, then room for its answer): 8 + 6 + 6 = 20.
        assert decode.max_blocks_used == 20
        assert decode.cache.stats.num_hit_tokens == 2 * 16
        assert c.stats().kv_transfer_tokens == 20 + (20 + 4 + 4)  # the later samples pull only the partial block
        deadline = time.monotonic() + 10
        while decode.cache.num_pinned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.cache.num_available == decode.cache.num_blocks
    finally:
        c.shutdown(drain_timeout_s=0)


def test_without_caching_each_sample_holds_a_whole_copy() -> None:
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    config = ControllerConfig(prefix_policy=NO_PREFIX_CACHING, limits=ServingLimits(block_size=BS, num_kv_blocks=64))
    c = Controller(build_engines(plan, _fake_factory), plan, config, transfer=lambda engine: _SlowTransfer(engine, 0.2))
    c.start()
    try:
        prompt = tuple(range(1, 21))
        sampling = SamplingParams(max_tokens=44, ignore_eos=True)
        _warm(c, sampling)
        streams = [c.submit(GenerateRequest(f"w{j}", prompt, sampling)) for j in range(3)]
        for s in streams:
            assert s.collect(timeout_s=60)[0] == reference_tokens(prompt, 44, CFG.vocab_size)
        assert c.decode_instances[0].max_blocks_used == 24
        assert c.stats().kv_transfer_tokens == 20 + 3 * 20
    finally:
        c.shutdown(drain_timeout_s=0)


def _seeded(tag: str, prompt: tuple[int, ...]) -> list[GenerateRequest]:
    return [
        GenerateRequest(f"{tag}{j}", prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=11 + j))
        for j in range(3)
    ]


def test_seeded_samples_sharing_blocks_equal_the_same_requests_one_by_one() -> None:
    """Together (sharing the prompt's blocks, each writing its own copy of the partial one) == one by one.

    Both arms run with caching on: with it off, the later samples' prompts are computed whole instead
    of over the cached prefix, float rounding differs, and a seeded sample at a near tie may differ.
    """
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    prompt = tuple(range(5, 42))  # 37 tokens: 2 full blocks of 16 + 5
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True), limits=ServingLimits(block_size=16, num_kv_blocks=32)
    )
    with Controller.from_plan("opt-tiny", plan, config=config) as one_by_one:
        separate = [one_by_one.submit(r).collect(timeout_s=120)[0] for r in _seeded("a", prompt)]
    with Controller.from_plan("opt-tiny", plan, config=config) as on:
        streams = [on.submit(r) for r in _seeded("b", prompt)]  # together
        shared = [s.collect(timeout_s=120)[0] for s in streams]
        decode = on.decode_instances[0]
        assert decode.cache.stats.num_hit_tokens == 2 * 32  # samples 2 and 3 pinned the 2 full blocks
        deadline = time.monotonic() + 10
        while decode.cache.num_pinned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.cache.num_pinned == 0 and decode.cache.num_available == decode.cache.num_blocks
    assert shared == separate
    assert len({tuple(ids) for ids in shared}) == 3  # three different samples
