"""A live switch whose new instance fails to build (its pool does not fit) leaves the deployment as it was (issue 27).

The fake engine on the new decode shape raises in `init_pages`, as a pool sized from memory does when the memory
is not there. The switch raises its error; the controller's `placed_of`, instances and plan are the ones it had
before, requests still complete, and nothing of the failed instance (its engine: devices and weights) stays
referenced from the controller.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence

import jax
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import KVPages
from jaxserve.runtime.engines.fake import FakeEngine
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.switch import PlanSwitcher, SwitchError
from models.config import get_config

PLAN = "disagg:prefill=tp1,decode=tp1"
NEW = "disagg:prefill=tp1,decode=tp2"  # the tp2 decode instance's pool fails


class PoolOutOfMemory(FakeEngine):
    """A fake engine whose paged pool cannot be allocated."""

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        raise MemoryError(f"no room for {num_blocks} blocks of {block_size} tokens")


class Factory:
    """Fake engines; a decode instance of tp2 gets one whose pool fails (each such engine is kept weakly)."""

    def __init__(self) -> None:
        self.config = get_config("opt-tiny")
        self.failed: list[weakref.ref[FakeEngine]] = []

    def __call__(self, spec: InstanceSpec, devices: Sequence[jax.Device]) -> FakeEngine:
        if spec.role == "decode" and spec.tp == 2:
            engine = PoolOutOfMemory(self.config, devices, tp=spec.tp, pp=spec.pp)
            self.failed.append(weakref.ref(engine))
            return engine
        return FakeEngine(self.config, devices, tp=spec.tp, pp=spec.pp)


def _controller(factory: Factory) -> Controller:
    plan = parse_deployment(PLAN).assign_devices()
    config = ControllerConfig(limits=ServingLimits(block_size=8, num_kv_blocks=64))
    c = Controller(build_engines(plan, factory), plan, config)
    c.start()
    return c


def _one_request(c: Controller, rid: str) -> list[int]:
    request = GenerateRequest(rid, (5, 6, 7, 8), SamplingParams(max_tokens=4, ignore_eos=True))
    ids, _ = c.submit(request).collect(timeout_s=60)
    return ids


def test_a_switch_whose_new_instance_fails_to_build_leaves_the_deployment_as_it_was() -> None:
    factory = Factory()
    c = _controller(factory)
    try:
        before_ids = _one_request(c, "before")
        placed_before = dict(c.placed_of)
        instances_before = c.instances
        plan_before = c.plan
        with pytest.raises(SwitchError, match="failed: no room for 64 blocks"):
            PlanSwitcher(c, factory).switch(parse_deployment(NEW))
        assert len(factory.failed) == 1  # the switch did reach the failing build
        assert c.placed_of.keys() == placed_before.keys()
        assert all(c.placed_of[n] is p for n, p in placed_before.items())
        assert [id(i) for i in c.instances] == [id(i) for i in instances_before]
        assert c.plan is plan_before
        assert _one_request(c, "after") == before_ids  # same prompt, same fake arithmetic
    finally:
        c.shutdown()


def test_nothing_of_an_instance_that_failed_to_build_stays_referenced_from_the_controller() -> None:
    factory = Factory()
    c = _controller(factory)
    try:
        with pytest.raises(SwitchError) as raised:
            PlanSwitcher(c, factory).switch(parse_deployment(NEW))
        del raised  # its traceback holds the switch's frames (and so the engine) until dropped
        gc.collect()
        assert len(factory.failed) == 1
        assert factory.failed[0]() is None, "the failed instance's engine is still referenced"
        for p in c.placed_of.values():
            assert not isinstance(p.engine, PoolOutOfMemory)
        assert all(not isinstance(i.engine, PoolOutOfMemory) for i in c.instances)
    finally:
        c.shutdown()
