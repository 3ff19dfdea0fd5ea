"""A live switch never stalls serving, and a switch that fails or is stopped leaves nothing behind (issue 27).

Embedded runtime, the hand-computable fake engine on 8 virtual CPU devices. The switch's new instance (a tp2
decode instance, `OLD` -> `NEW`) gets an engine that misbehaves in one way per test: its bucket warm-up (a
compile) holds until the test opens a gate, its first decode step hangs, it dies, or building it waits for a
gate. Orders are set by events; the only clocks are deadlines for hangs and the switch's own warm-up timeout.

* a staged instance compiling under its lock is invisible to the serving path: a client's disconnect
  (cancel) and a `/metrics` scrape are answered while the compile still holds (they used to wait for it);
* a second `POST /admin/deployment` while one runs gets 409 with a clear message;
* a staged decode instance that hangs in its warm-up: the switch times out, and the routed prefill
  instance's buffer slots its warm-up pulls held are freed, so with one prefill instance later requests
  still complete (they used to hang forever);
* a staged decode instance that dies in its warm-up fails the switch (it used to be routed, dead);
* shutdown (SIGTERM) during a switch drains the clients' requests and stops the switch at its next step:
  no new instance is left running and the plan is the one serving;
* a drain-first switch whose build fails rebuilds the instances it drained, and says so.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import httpx
import jax
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import DeploymentPlan, InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.runtime.controller import Controller, ControllerConfig, WarmupConfig
from jaxserve.runtime.engines.contract import KVPages, StepBatch, WarmupSpec
from jaxserve.runtime.engines.fake import FakeEngine, reference_tokens
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.switch import PlanSwitcher, SwitchAbortedError, SwitchError
from jaxserve.serving.server import ServerConfig, ServerThread
from jaxserve.tools.replan_loop import ReplanLoop, ReplanLoopConfig
from models.config import get_config

pytestmark = pytest.mark.timeout(240)

CFG = get_config("opt-tiny")
V = CFG.vocab_size
OLD = "disagg:prefill=tp1,decode=tp1"
NEW = "disagg:prefill=tp1,decode=tp2"  # decode-1 (tp2) is added, decode-0 retires
ADMIN_KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}


class Gates:
    def __init__(self) -> None:
        self.entered = threading.Event()  # the misbehaving part began
        self.release = threading.Event()  # the test lets it go on

    def hold(self) -> None:
        self.entered.set()
        assert self.release.wait(timeout=180), "the test never released the gate"


@dataclasses.dataclass
class _Warmed:
    pages: KVPages | None


class SlowWarmup(FakeEngine):
    """Bucket warm-up (run under the staged instance's lock, as the real engine's compile is) held at the gate."""

    capabilities = dataclasses.replace(FakeEngine.capabilities, bucket_warmup=True)
    gates: Gates

    def warmup(self, spec: WarmupSpec, pages: KVPages | None = None) -> _Warmed:
        self.gates.hold()
        return _Warmed(pages)


class HangingDecode(FakeEngine):
    """Its first decode step hangs at the gate (a stuck device); pulls started meanwhile never finish."""

    gates: Gates

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        self.gates.hold()
        return super().decode_step(batch, pages)


class DyingDecode(FakeEngine):
    gates: Gates

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        self.gates.entered.set()
        raise RuntimeError("device lost during warm-up")


class Factory:
    """Fake engines; the switch's tp2 decode instance gets `staged` (or its build waits, with `gate_build`)."""

    def __init__(self, staged: type[FakeEngine] = FakeEngine, gate_build: bool = False) -> None:
        self.staged = staged
        self.gate_build = gate_build
        self.gates = Gates()

    def __call__(self, spec: InstanceSpec, devices: Sequence[jax.Device]) -> FakeEngine:
        if spec.role == "decode" and spec.tp == 2:
            if self.gate_build:
                self.gates.hold()
            engine = self.staged(CFG, devices, tp=spec.tp, pp=spec.pp)
            engine.gates = self.gates  # type: ignore[attr-defined]
            return engine
        return FakeEngine(CFG, devices, tp=spec.tp, pp=spec.pp)


def _controller(factory: Factory, spec: str = OLD, **limits: int) -> Controller:
    config = ControllerConfig(
        limits=ServingLimits(block_size=8, num_kv_blocks=128, **limits), warmup=WarmupConfig(buckets=True)
    )
    plan = parse_deployment(spec).assign_devices()
    c = Controller(build_engines(plan, factory), plan, config)
    c.start()
    return c


def _request(rid: str, prompt: tuple[int, ...] = (5, 6, 7, 8), n: int = 6) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))


def _completes(c: Controller, rid: str, prompt: tuple[int, ...] = (5, 6, 7, 8), n: int = 6) -> None:
    ids, last = c.submit(_request(rid, prompt, n)).collect(timeout_s=60)
    assert last.finish_reason == "length" and ids == reference_tokens(prompt, n, V), rid


def _in_thread(fn, *args: object) -> tuple[threading.Thread, dict[str, object]]:  # type: ignore[no-untyped-def]
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # the test thread inspects it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _wait(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """A deadline for a hang only; the verdict is the state reached."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"condition not reached within {timeout_s} s"
        time.sleep(0.01)


def _worker_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"jaxserve-{name}" and t.is_alive()]


def test_a_staged_compile_never_stalls_cancel_metrics_or_a_second_switch() -> None:
    factory = Factory(SlowWarmup)
    c = _controller(factory)
    switcher = PlanSwitcher(c, factory, drain_timeout_s=30)
    loop = ReplanLoop(c, ReplanLoopConfig(mode="off"), switcher=switcher)
    loop.start()
    config = ServerConfig(grpc_port=0, http_port=0, admin_key=ADMIN_KEY, warmup=False, drain_timeout_s=5.0)
    try:
        with ServerThread(c, config, admin=loop) as server:
            url = server.http_url
            poster, posted = _in_thread(
                lambda: httpx.post(f"{url}/admin/deployment", content=NEW, headers=AUTH, timeout=180)
            )
            assert factory.gates.entered.wait(60)  # decode-1 is staged, compiling under its lock
            # a streaming client reads its first token, then disconnects: the server cancels it on its loop
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                next(line for line in response.iter_lines() if line.startswith("data:"))
            scraped, scrape = _in_thread(lambda: httpx.get(f"{url}/metrics", timeout=60))
            scraped.join(timeout=60)
            assert "value" in scrape, "the /metrics scrape waited on the staged instance's compile"
            assert scrape["value"].status_code == 200  # type: ignore[attr-defined]
            stats, snapshot = _in_thread(c.stats)
            stats.join(timeout=60)
            assert "value" in snapshot, "stats() waited on the staged instance's compile"
            _wait(lambda: c.stats().num_live_requests == 0)  # the disconnected stream is cancelled
            assert {s.name for s in c.stats().instances} == {"prefill-0", "decode-0"}  # staged: not serving
            # a second switch meanwhile: 409, saying why
            busy = httpx.post(f"{url}/admin/deployment", content=OLD, headers=AUTH, timeout=60)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "switch_running"
            assert "already running" in busy.json()["error"]["message"]
            assert not factory.gates.release.is_set()  # all of the above while the compile still held
            factory.gates.release.set()
            poster.join(timeout=180)
            assert posted["value"].status_code == 200, posted  # type: ignore[attr-defined]
            assert c.plan.describe() == NEW
            _completes(c, "after")
    finally:
        factory.gates.release.set()
        loop.stop()
        c.shutdown(drain_timeout_s=5)


def test_a_staged_decode_hanging_in_its_warm_up_frees_the_routed_prefills_buffer() -> None:
    factory = Factory(HangingDecode)
    c = _controller(factory, prefill_buffer_slots=2)  # one prefill instance, two buffer slots
    try:
        _completes(c, "before")
        with pytest.raises(SwitchError, match="the deployment is as it was") as info:
            PlanSwitcher(c, factory, warmup_timeout_s=10).switch(parse_deployment(NEW))
        assert factory.gates.entered.is_set()  # decode-1 hung in its first step, warm-up pulls behind it
        # the timeout names the new instance that did not answer and says what to do
        message = str(info.value)
        assert "the new instance decode-1 gave no token for its warm-up request (prefill-0 -> decode-1" in message
        assert "warm-up timeout of 10 s" in message and "warmup_timeout_s" in message
        assert "check decode-1's log" in message
        assert c.plan.describe() == OLD and set(c.placed_of) == {"prefill-0", "decode-0"}
        _wait(lambda: c.stats().num_live_requests == 0)  # the switch's warm-up requests are gone
        prefill = next(s for s in c.stats().instances if s.role == "prefill")
        assert prefill.num_prefill_buffer_used == 0 and prefill.num_waiting == 0
        for k in range(4):  # more than the buffer's slots: they must all get through
            _completes(c, f"after-{k}", (9, 10, 11 + k))
    finally:
        factory.gates.release.set()
        c.shutdown(drain_timeout_s=5)


def test_a_staged_decode_dying_in_its_warm_up_fails_the_switch_and_frees_everything() -> None:
    factory = Factory(DyingDecode)
    c = _controller(factory, prefill_buffer_slots=2)
    try:
        with pytest.raises(SwitchError, match=r"decode-1 died.*device lost"):
            PlanSwitcher(c, factory, warmup_timeout_s=60).switch(parse_deployment(NEW))
        assert factory.gates.entered.is_set()
        assert c.plan.describe() == OLD and set(c.placed_of) == {"prefill-0", "decode-0"}
        assert [i.name for i in c.switch_steps.routed_instances()] == ["prefill-0", "decode-0"]
        _wait(lambda: c.stats().num_live_requests == 0)
        for k in range(4):
            _completes(c, f"after-{k}", (9, 10, 11 + k))
        prefill = next(s for s in c.stats().instances if s.role == "prefill")
        assert prefill.num_prefill_buffer_used == 0
    finally:
        c.shutdown(drain_timeout_s=5)


def test_shutdown_during_a_switchs_build_drains_clients_and_stops_the_switch() -> None:
    factory = Factory(gate_build=True)
    c = _controller(factory)
    try:
        switch, switched = _in_thread(PlanSwitcher(c, factory, warmup_timeout_s=60).switch, parse_deployment(NEW))
        assert factory.gates.entered.wait(60)  # the switch is loading decode-1's weights
        stream = c.submit(_request("client", n=40))
        c.shutdown(drain_timeout_s=60)  # SIGTERM: the server drains (run_until_signal -> JaxServeServer.stop)
        ids, last = stream.collect(timeout_s=60)
        assert last.finish_reason == "length" and ids == reference_tokens((5, 6, 7, 8), 40, V)
        factory.gates.release.set()  # the build ends after the shutdown
        switch.join(timeout=120)
        assert isinstance(switched.get("error"), SwitchAbortedError), switched
        assert "shutting down" in str(switched["error"])
        assert not _worker_threads("decode-1")  # nothing of the new plan runs
        assert c.plan.describe() == OLD and set(c.placed_of) == {"prefill-0", "decode-0"}
    finally:
        factory.gates.release.set()
        c.shutdown(drain_timeout_s=0)


def test_shutdown_during_a_staged_compile_does_not_wait_for_it() -> None:
    factory = Factory(SlowWarmup)
    c = _controller(factory)
    try:
        switch, switched = _in_thread(PlanSwitcher(c, factory, warmup_timeout_s=60).switch, parse_deployment(NEW))
        assert factory.gates.entered.wait(60)
        stopper, stopped = _in_thread(c.shutdown, 30.0)
        stopper.join(timeout=60)
        assert not stopper.is_alive() and "error" not in stopped, "shutdown waited for the staged compile"
        assert not factory.gates.release.is_set()
        factory.gates.release.set()
        switch.join(timeout=120)
        assert isinstance(switched.get("error"), SwitchAbortedError), switched
        _wait(lambda: not _worker_threads("decode-1"))
        assert c.plan.describe() == OLD
    finally:
        factory.gates.release.set()
        c.shutdown(drain_timeout_s=0)


class FailingPrefill(Factory):
    """A tp1 prefill instance cannot be built (out of memory)."""

    def __call__(self, spec: InstanceSpec, devices: Sequence[jax.Device]) -> FakeEngine:
        if spec.role == "prefill" and spec.tp == 1:
            raise MemoryError("no room for the weights")
        return FakeEngine(CFG, devices, tp=spec.tp, pp=spec.pp)


def test_a_drain_first_switch_whose_build_fails_rebuilds_what_it_drained() -> None:
    start = "disagg:prefill=2xtp2,decode=2xtp2"  # all 8 devices
    factory = FailingPrefill()
    c = _controller(factory, start)
    target = DeploymentPlan(
        (InstanceSpec("prefill", 2), InstanceSpec("prefill", 1), InstanceSpec("prefill", 1), InstanceSpec("decode", 2))
    )
    try:
        _completes(c, "before")
        with pytest.raises(SwitchError) as info:
            PlanSwitcher(c, factory).switch(target)
        message = str(info.value)
        assert "no room for the weights" in message
        assert "prefill-1, decode-1 had been drained first" in message and "were rebuilt" in message
        assert "the deployment is as it was (disagg:prefill=2xtp2,decode=2xtp2)" in message
        assert c.plan.describe() == start
        assert [i.name for i in c.switch_steps.routed_instances()] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
        assert sorted(d for i in c.plan.instances for d in i.devices or ()) == list(range(8))
        assert not c.switch_steps.retiring
        for k in range(4):
            _completes(c, f"after-{k}", (9, 10, 11 + k))
    finally:
        c.shutdown(drain_timeout_s=5)
