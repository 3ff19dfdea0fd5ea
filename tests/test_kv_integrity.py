"""A KV that arrives wrong costs its request a recompute, never wrong tokens, never the decode instance (issue 27).

Embedded runtime, the fake engine (its tokens depend on every KV value, `reference_tokens`), 1 prefill + 1 decode.
The transfer into the decode instance is the real in-process one with its copy step faulted for one request,
once: the KV arrives truncated (fewer positions than the prompt), as another dtype, with a head missing, or
(with the opt-in checksum on) with its contents changed. The request is prefilled again and its stream is
token-identical to a run without the fault; the decode instance stays alive and the other requests are untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import Engine, SequenceKV, StageKV
from jaxserve.runtime.engines.fake import fake_engine_factory, reference_tokens
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.kv_connectors.in_process import InProcessTransfer
from models.config import get_config

pytestmark = pytest.mark.timeout(120)

CFG = get_config("opt-tiny")
V = CFG.vocab_size
Fault = Callable[[StageKV], StageKV]

FAULTS: dict[str, Fault] = {
    "truncated": lambda s: StageKV(k=s.k[:, :2], v=s.v[:, :2]),
    "dtype": lambda s: StageKV(k=s.k.astype(jnp.float16), v=s.v.astype(jnp.float16)),
    "missing head": lambda s: StageKV(k=s.k[:, :, 1:], v=s.v[:, :, 1:]),
    "corrupted": lambda s: StageKV(k=s.k + 1.0, v=s.v),  # same shape and dtype: only the checksum sees it
}


class FaultyCopy(InProcessTransfer):
    """The in-process transfer whose copy step applies `fault` to the first KV it moves."""

    def __init__(self, target: Engine, fault: Fault, checksum: bool) -> None:
        super().__init__(target, checksum=checksum)
        self.fault: Fault | None = fault

    def move(self, kv: SequenceKV) -> SequenceKV:
        moved = super().move(kv)
        if self.fault is None:
            return moved
        fault, self.fault = self.fault, None
        return tuple(fault(stage) for stage in moved)


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_kv_arriving_wrong_is_recomputed_never_decoded(kind: str) -> None:
    checksum = kind == "corrupted"
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1").assign_devices()
    config = ControllerConfig(limits=ServingLimits(block_size=8, num_kv_blocks=64), kv_checksum=checksum)
    transfers: list[FaultyCopy] = []

    def transfer(engine: Engine) -> FaultyCopy:
        transfers.append(FaultyCopy(engine, FAULTS[kind], checksum))
        return transfers[-1]

    c = Controller(build_engines(plan, fake_engine_factory(CFG)), plan, config, transfer=transfer)
    c.start()
    try:
        prompts = [tuple(range(3 + k, 14 + k)) for k in range(3)]
        streams = [
            c.submit(GenerateRequest(f"r{k}", p, SamplingParams(max_tokens=8, ignore_eos=True)))
            for k, p in enumerate(prompts)
        ]
        for stream, prompt in zip(streams, prompts, strict=True):
            ids, last = stream.collect(timeout_s=60)
            assert last.finish_reason == "length" and ids == reference_tokens(prompt, 8, V), stream.request_id
        assert transfers[0].fault is None  # the fault was applied
        stats = c.stats()
        assert stats.faults.num_recomputed == 1
        assert all(i.alive for i in stats.instances)
        assert all(i.num_kv_blocks_used == 0 for i in stats.instances if i.role == "decode")
    finally:
        c.shutdown(drain_timeout_s=5)


def test_the_checksum_is_off_by_default() -> None:
    assert ControllerConfig().kv_checksum is False
    assert dataclasses.fields(ControllerConfig)  # the knob is a field (documented in docs/architecture.md)
