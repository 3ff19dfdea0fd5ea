"""A resumed request that no longer fits a smaller prefill pool fails alone; it never blocks the queue (issue 27).

Prefix caching on, so a prefill instance prefills on its own KV pool: 4 blocks of 8 tokens (32 tokens), while
each decode instance's pool holds 512. A request with a 20-token prompt and 40 output tokens fits both at
admission. Its decode instance dies after 16 tokens were streamed: resuming it means prefilling 20 + 15 = 35
tokens, which the prefill pool can never hold. It must fail alone with an error saying so, and the requests
behind it (and later ones) must complete token-identical; before, it sat at the head of the prefill
instance's FCFS queue forever and everything behind it waited.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import pytest

from jaxserve.core.errors import EngineDeadError
from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import KVPages, StepBatch
from jaxserve.runtime.engines.fake import FakeEngine, reference_tokens
from jaxserve.runtime.instances import build_engines
from models.config import get_config

pytestmark = pytest.mark.timeout(120)

CFG = get_config("opt-tiny")
V = CFG.vocab_size


class DiesAfter(FakeEngine):
    """Dies on its 16th decode step."""

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        if self.num_decode_calls + 1 >= 16:
            raise RuntimeError("device lost")
        return super().decode_step(batch, pages)


def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> FakeEngine:
    cls = DiesAfter if spec.role == "decode" and devices[0].id == 1 else FakeEngine  # decode-0 (device 1) dies
    return cls(CFG, devices, tp=spec.tp, pp=spec.pp)


def _wait(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """A deadline for a hang only."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"condition not reached within {timeout_s} s"
        time.sleep(0.01)


def test_a_resumed_request_too_long_for_the_prefill_pool_fails_alone() -> None:
    plan = parse_deployment("disagg:prefill=tp1,decode=2xtp1").assign_devices()
    config = ControllerConfig(
        limits=ServingLimits(block_size=8, num_kv_blocks=64),
        prefix_policy=PrefixPolicy(enabled=True),
        prefill_num_kv_blocks=4,
    )
    c = Controller(build_engines(plan, factory), plan, config)
    c.start()
    try:
        long_prompt = tuple(range(3, 23))  # 20 tokens: fits the 32-token prefill pool
        doomed = c.submit(GenerateRequest("long", long_prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
        _wait(lambda: c.decode_instances[0].error is not None)  # alone in flight, it went to decode-0, which died
        behind = [
            (c.submit(GenerateRequest(f"short-{k}", (5, 6, 7 + k), SamplingParams(max_tokens=6, ignore_eos=True))), k)
            for k in range(4)
        ]
        for stream, k in behind:  # the prefill instance's queue is not blocked by the one that cannot resume
            ids, last = stream.collect(timeout_s=60)
            assert last.finish_reason == "length" and ids == reference_tokens((5, 6, 7 + k), 6, V)
        with pytest.raises(EngineDeadError, match=r"cannot be resumed: .*\(35\).*\(32 tokens\)"):
            doomed.collect(timeout_s=60)
        assert c.stats().num_live_requests == 0
    finally:
        c.shutdown(drain_timeout_s=0)
