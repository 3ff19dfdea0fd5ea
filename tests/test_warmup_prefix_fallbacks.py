"""Prefix caching while the background warm-up still compiles its KV copies: each fallback, counted by hand.

`ModelEngine.warmup` with `background` compiles a caching prefill instance's KV copies on its background thread
(the insert of a densely prefilled prompt, the gather of a prompt's KV out of the pool, the slice a partial pull
moves); `Engine.kv_copy_compiled` says which are in. Until one is, the instances take a path that compiles
nothing: the prompt's KV is not kept (insert), the hit batch is prefilled densely (gather), the pull moves the
whole KV and skips the blocks the decode instance holds (slice). The hand-computable fake engine recovers each
row's context from the pool through its block table, so a fallback that wrote the wrong blocks or kept a block
it never wrote changes the tokens; the same two-turn conversation as `test_prefix_runtime.py` (block size 8).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import jax
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import KVCopy
from jaxserve.runtime.engines.fake import FakeEngine, reference_tokens
from jaxserve.runtime.instances import build_engines
from models.config import get_config

CFG = get_config("opt-tiny")
V = CFG.vocab_size
TOKEN_BYTES = 2 * CFG.num_layers * CFG.num_heads * 4  # the fake's K and V: [L, T, H, 1] float32
P1 = tuple(range(1, 21))  # 20 tokens: 2 full blocks + 4
NEW = tuple(range(100, 110))


class _StillCompiling(FakeEngine):
    """A fake engine whose background warm-up has not compiled the KV copies in `cold` yet."""

    def __init__(self, devices: Sequence[jax.Device], tp: int, pp: int, cold: Collection[KVCopy]) -> None:
        super().__init__(CFG, devices, tp=tp, pp=pp)
        self.cold = cold

    def kv_copy_compiled(self, kind: KVCopy, padded: int, from_padded: int = 0) -> bool:
        return kind not in self.cold


def _factory(cold: Collection[KVCopy]) -> Callable[[InstanceSpec, Sequence[jax.Device]], FakeEngine]:
    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> FakeEngine:
        return _StillCompiling(devices, spec.tp, spec.pp, cold)

    return factory


def _req(rid: str, prompt: tuple[int, ...]) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=6, ignore_eos=True))


@pytest.mark.parametrize("cold", ["insert", "gather", "slice"])
def test_two_turns_while_a_kv_copy_still_compiles(cold: KVCopy) -> None:
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    config = ControllerConfig(limits=ServingLimits(block_size=8, num_kv_blocks=64), prefix_policy=PrefixPolicy())
    c = Controller(build_engines(plan, _factory({cold})), plan, config)
    c.start()
    try:
        ids1, _ = c.submit(_req("t1", P1)).collect(timeout_s=60)
        p2 = P1 + tuple(ids1) + NEW  # 36 tokens: 4 full blocks + 4
        ids2, last2 = c.submit(_req("t2", p2)).collect(timeout_s=60)
        assert ids1 == reference_tokens(P1, 6, V) and ids2 == reference_tokens(p2, 6, V)
        t2 = last2.timings
        assert t2 is not None
        prefill, decode = c.prefill_instances[0], c.decode_instances[0]
        if cold == "insert":  # turn 1's KV never entered the prefill pool: turn 2 finds nothing there
            assert (t2.cached_prompt_tokens, prefill.num_computed_tokens, prefill.cache.num_cached) == (0, 20 + 36, 0)
        elif cold == "gather":  # turn 2 hits 16 tokens but is prefilled densely; its new blocks are kept
            assert (t2.cached_prompt_tokens, prefill.num_computed_tokens, prefill.cache.num_cached) == (0, 20 + 36, 4)
        else:  # the prefill side as usual (16 cached)
            assert (t2.cached_prompt_tokens, prefill.num_computed_tokens, prefill.cache.num_cached) == (16, 20 + 20, 4)
        if cold == "slice":  # the decode instance holds 24 positions, yet all 36 move (padded to 64)
            assert (t2.kv_transfer_tokens, t2.kv_transfer_bytes) == (36, 64 * TOKEN_BYTES)
        else:  # 36 - 24 = 12 positions move (padded to 16)
            assert (t2.kv_transfer_tokens, t2.kv_transfer_bytes) == (12, 16 * TOKEN_BYTES)
        assert decode.cache.num_cached == 5  # 36 + 5 = 41 tokens -> 5 blocks, as without the fallback
        # a third turn reads turn 2's blocks back from both pools: a block kept but never written would show here
        p3 = p2 + tuple(ids2) + NEW
        ids3, _ = c.submit(_req("t3", p3)).collect(timeout_s=60)
        assert ids3 == reference_tokens(p3, 6, V)
    finally:
        c.shutdown(drain_timeout_s=0)
