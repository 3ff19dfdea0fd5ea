"""Online replanning on the real embedded runtime (8 virtual CPU devices, the hand-computable fake engine).

The load shifts from short prompts / long outputs to long prompts / short outputs; the detector fires
once, the background replanner picks a deployment with more prefill, the switch happens under load,
every request completes with exactly the tokens a run without a switch gives (`reference_tokens`), and
the retired instances are stopped with no KV block or prefill-buffer slot in use, and are freed.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import DeploymentPlan, InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import NO_PREFIX_CACHING
from jaxserve.core.workload_monitor import DetectorConfig, MonitorConfig
from jaxserve.runtime.controller import Controller, ControllerConfig, RequestStream
from jaxserve.runtime.engines.fake import fake_engine_factory, reference_tokens
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.switch import PlanSwitcher, SwitchError, SwitchInProgressError, match_instances
from jaxserve.tools.replan_loop import ReplanLoop, ReplanLoopConfig
from models.config import get_config

CFG = get_config("opt-tiny")  # vocab 512, 256 positions, 4 heads
V = CFG.vocab_size
FACTORY = fake_engine_factory(CFG)


def _controller(spec: str, **overrides: object) -> Controller:
    config = ControllerConfig(limits=ServingLimits(block_size=16, num_kv_blocks=256), **overrides)  # type: ignore[arg-type]
    plan = parse_deployment(spec).assign_devices()
    c = Controller(build_engines(plan, FACTORY), plan, config)
    c.start()
    return c


class Load:
    """Open-loop arrivals on a thread: `phase` picks the length mix; every stream is kept for checking."""

    def __init__(self, controller: Controller, rate: float, seed: int = 0) -> None:
        self.controller = controller
        self.rate = rate
        self.rng = np.random.default_rng(seed)
        self.phase = "chat"
        self.sent: list[tuple[RequestStream, tuple[int, ...], int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def lengths(self) -> tuple[int, int]:
        if self.phase == "chat":  # short prompts, long outputs
            return int(self.rng.integers(4, 17)), int(self.rng.integers(30, 61))
        return int(self.rng.integers(150, 221)), int(self.rng.integers(2, 7))  # long prompts, short outputs

    def _run(self) -> None:
        k = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            n_in, n_out = self.lengths()
            prompt = tuple(int(t) for t in self.rng.integers(3, V, size=n_in))
            req = GenerateRequest(f"r{k}", prompt, SamplingParams(max_tokens=n_out, ignore_eos=True))
            self.sent.append((self.controller.submit(req), prompt, n_out))
            k += 1
            next_at += 1.0 / self.rate
            self._stop.wait(max(next_at - time.monotonic(), 0.0))

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def check_all(self) -> list[object]:
        """Every request finished with exactly the no-switch tokens; their final timings."""
        timings = []
        for stream, prompt, n_out in self.sent:
            ids, last = stream.collect(timeout_s=120)
            assert last.finish_reason == "length", stream.request_id
            assert ids == reference_tokens(prompt, n_out, V), stream.request_id
            timings.append(last.timings)
        return timings


def _planning_context():
    """OPT-13B on A100 coefficients (the shipped profile): the planner's view, not the fake engine's speed."""
    from placement.hardware import ClusterSpec, get_device
    from placement.latency import LatencyProvider, load_profile
    from placement.search import SearchContext
    from placement.slo import SloSpec
    from placement.workload import Workload

    lat = LatencyProvider(get_config("opt-13b"), get_device("a100-80gb"), load_profile("a100-80gb-distserve"))
    one = np.ones(1, dtype=np.int64)
    return SearchContext(lat, ClusterSpec(lat.device, 1, 8), Workload(np.zeros(1), one, one, 1.0),
                         SloSpec(0.25, 0.1), max_pp=1)  # fmt: skip


def _wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_match_keeps_instances_of_the_same_role_and_shape() -> None:
    routed = list(
        zip(
            ["prefill-0", "decode-0", "decode-1"],
            parse_deployment("disagg:prefill=tp1,decode=2xtp1").instances,
            strict=True,
        )
    )
    pairs, retiring = match_instances(routed, parse_deployment("disagg:prefill=2xtp1,decode=tp2"))
    assert [k for _, k in pairs] == ["prefill-0", None, None]
    assert retiring == ["decode-0", "decode-1"]


FIRST_PLAN = "disagg:prefill=tp1,decode=tp2"


def _shift_loop(mode: str) -> tuple[Controller, PlanSwitcher, ReplanLoop, Load, weakref.ref]:
    """prefill=tp1,decode=tp2 under chat load, the loop in `mode`, then the load turns to long prompts.

    The planner's answer for long prompts has tp1 decode instances: the tp2 one retires under load."""
    # caching off: the checks count every prompt token as transferred (a hit transfers only the uncached part)
    c = _controller(FIRST_PLAN, prefix_policy=NO_PREFIX_CACHING)
    first_decode = weakref.ref(c.decode_instances[0])
    switcher = PlanSwitcher(c, FACTORY, drain_timeout_s=60)
    config = ReplanLoopConfig(
        mode=mode,  # type: ignore[arg-type]
        monitor=MonitorConfig(window_s=2.0, slice_s=0.5),
        detector=DetectorConfig(rate_change=5.0, min_requests=20, sustain_s=2.0, cooldown_s=600.0),
        apply_corrections=False,  # the profile is OPT-13B on an A100, not this engine: its factors mean nothing here
        horizon_s=60.0,
        num_requests=200,
    )
    loop = ReplanLoop(c, config, switcher=switcher, context=_planning_context(), weights_load_s=1.0).start()
    load = Load(c, rate=40.0).start()
    try:
        time.sleep(3.0)  # chat: the first full window becomes the detector's reference
        assert loop.num_rounds == 0
        load.phase = "long"
        _wait_for(lambda: loop.last_decision is not None, 120)
        time.sleep(1.0)  # more load after the decision
    finally:
        load.stop()
    return c, switcher, loop, load, first_decode


@pytest.mark.slow  # ~30 s; the default run stays well under 15 minutes
def test_shift_fires_once_replans_to_more_prefill_and_switches_under_load() -> None:
    c, switcher, loop, load, first_decode = _shift_loop("auto")
    try:
        timings = load.check_all()  # every request, token for token
        decision = loop.last_decision
        assert decision is not None and decision["action"] == "switched", decision
        assert loop.num_rounds == 1  # the detector fired once
        d = decision["decision"]
        assert isinstance(d, dict) and d["switch"]
        new_plan = parse_deployment(d["candidate"]["plan"])  # type: ignore[index]
        prefill_devices = sum(i.num_devices for i in new_plan.of_role("prefill"))
        assert prefill_devices > 1  # long prompts: more prefill than prefill=tp1 had
        assert c.plan.describe() == new_plan.describe()
        report = switcher.last_report
        assert report is not None and "prefill-0" in report.kept  # same role and shape: kept, not rebuilt
        assert report.added  # the plan grew: new instances were built, warmed and routed
        # the switch happened under load: requests kept arriving before it started and after its routing
        # switch; while the new instances were built and warmed, hand-offs went to the old set only.
        # (By hand-off, not arrival: a request that arrived just before the routing switch may finish its
        # prefill after it and rightly go to a new decode instance. A pull starts after its hand-off.)
        before = [t for t in timings if t.arrival_at < report.started_at]  # type: ignore[attr-defined]
        after = [t for t in timings if t.arrival_at > report.routed_at]  # type: ignore[attr-defined]
        assert before and after, (len(before), len(after))
        assert all(t.transfer_start_at is not None for t in timings)  # type: ignore[attr-defined]
        pulled_before = [t for t in timings if t.transfer_start_at < report.routed_at]  # type: ignore[attr-defined]
        assert {t.decode_instance for t in pulled_before} <= {"decode-0"}  # type: ignore[attr-defined]
        assert {t.decode_instance for t in after} <= {*report.kept, *report.added}  # type: ignore[attr-defined]
        # whatever retired: drained (not moved), stopped with nothing in use, and gone
        assert report.num_moved == 0
        for s in report.retired:
            assert s.num_kv_blocks_used == 0 and s.num_prefill_buffer_used == 0 and s.num_running == 0
            assert s.name not in c.instance_names
        assert c.switch_steps.retiring == ()
        assert "decode-0" in {s.name for s in report.retired}  # the tp2 decode instance, drained under load
        gc.collect()
        assert first_decode() is None  # the retired instance is gone, its KV pool with it
        snap = loop.workload_snapshot()
        assert snap["num_switches"] == 1 and snap["plan"] == new_plan.describe()
        # the detector's overload trigger now watches the new plan's predicted goodput
        assert loop.detector.capacity_rps == d["candidate"]["goodput_rps"]  # type: ignore[index]
        assert snap["detector"]["capacity_rps"] == loop.detector.capacity_rps  # type: ignore[index]
    finally:
        loop.stop()
        c.shutdown()


@pytest.mark.slow  # ~25 s; the default run stays well under 15 minutes
def test_advise_exposes_the_better_plan_and_keeps_serving_the_current_one() -> None:
    c, switcher, loop, load, _ = _shift_loop("advise")
    try:
        load.check_all()
        decision = loop.last_decision
        assert decision is not None and decision["action"] == "advised", decision
        assert loop.num_rounds == 1 and loop.num_switches == 0 and switcher.last_report is None
        assert c.plan.describe() == FIRST_PLAN
        snap = loop.workload_snapshot()
        advised = snap["advised_plan"]
        assert isinstance(advised, dict)
        assert DeploymentPlan.from_dict(advised).describe() == decision["decision"]["candidate"]["plan"]  # type: ignore[index]
        # only advised: the plan still serving is the current one, and so is the goodput the detector watches
        assert loop.detector.capacity_rps == decision["decision"]["current"]["goodput_rps"]  # type: ignore[index]
    finally:
        loop.stop()
        c.shutdown()


def test_switch_with_zero_drain_time_moves_running_decodes_token_for_token() -> None:
    """Retiring instances that still hold requests at the drain timeout hand them over (re-route path)."""
    c = _controller("disagg:prefill=tp1,decode=tp1")
    switcher = PlanSwitcher(c, FACTORY, drain_timeout_s=0.0)
    load = Load(c, rate=40.0, seed=3).start()  # chat: long outputs, so decode-0 holds running requests
    try:
        time.sleep(1.5)
        report = switcher.switch(parse_deployment("disagg:prefill=tp1,decode=tp2"))
        time.sleep(0.5)
    finally:
        load.stop()
    try:
        load.check_all()  # moved mid-stream, yet no token lost, repeated or changed
        assert report.kept == ("prefill-0",) and report.added == ("decode-1",)
        assert report.num_moved > 0 and [s.name for s in report.retired] == ["decode-0"]
        assert report.retired[0].num_kv_blocks_used == 0
        assert c.plan.describe() == "disagg:prefill=tp1,decode=tp2"
    finally:
        c.shutdown()


def test_retired_instances_are_freed_and_a_switch_refuses_what_it_cannot_do() -> None:
    c = _controller("disagg:prefill=tp1,decode=tp1")
    switcher = PlanSwitcher(c, FACTORY)
    try:
        refs = [weakref.ref(i) for i in c.instances]
        engines = [weakref.ref(p.engine) for p in c.placed_of.values()]
        report = switcher.switch(parse_deployment("disagg:prefill=tp2,decode=tp2"))
        assert report.kept == () and {s.name for s in report.retired} == {"prefill-0", "decode-0"}
        gc.collect()
        assert all(r() is None for r in refs)  # instances, their KV pools and buffers: freed
        assert all(r() is None for r in engines)  # and the engines (weights) with them
        # the new instances serve
        stream = c.submit(GenerateRequest("after", (5, 6, 7), SamplingParams(max_tokens=4, ignore_eos=True)))
        assert stream.collect(timeout_s=60)[0] == reference_tokens((5, 6, 7), 4, V)
        with pytest.raises(SwitchError, match="colocated"):
            switcher.switch(parse_deployment("colocated:tp1"))
        with pytest.raises(SwitchError, match="new devices"):
            switcher.switch(parse_deployment("disagg:prefill=5xtp1,decode=4xtp1"))
        assert c.plan.describe() == "disagg:prefill=tp2,decode=tp2"
    finally:
        c.shutdown()


def test_too_few_free_devices_drains_retiring_instances_first() -> None:
    """All 8 devices in use: the retiring instances are drained first and their devices reused."""
    c = _controller("disagg:prefill=2xtp2,decode=2xtp2")
    switcher = PlanSwitcher(c, FACTORY)
    target = DeploymentPlan(
        (InstanceSpec("prefill", 2), InstanceSpec("prefill", 1), InstanceSpec("prefill", 1), InstanceSpec("decode", 2))
    )
    load = Load(c, rate=20.0, seed=5).start()
    try:
        time.sleep(0.8)
        report = switcher.switch(target)
        time.sleep(0.5)
    finally:
        load.stop()
    try:
        load.check_all()
        assert report.drained_first and report.kept == ("prefill-0", "decode-0")
        assert {s.name for s in report.retired} == {"prefill-1", "decode-1"}
        assert c.plan.describe() == target.describe()
        # prefill-1 held devices 2-3, decode-1 6-7: the new tp1 prefills run on what the drain freed
        assert [i.devices for i in c.plan.instances] == [(0, 1), (2,), (3,), (4, 5)]
        # no kept instance of a role: the switch is refused before anything changes
        with pytest.raises(SwitchError, match="no \\['decode'\\] instance serving"):
            switcher.switch(parse_deployment("disagg:prefill=2xtp2,decode=tp4"))
        assert c.plan.describe() == target.describe()
    finally:
        c.shutdown()


def test_one_switch_at_a_time() -> None:
    c = _controller("disagg:prefill=tp1,decode=tp1")
    switcher = PlanSwitcher(c, FACTORY)
    try:
        with switcher._lock, pytest.raises(SwitchInProgressError):  # a switch is running
            switcher.switch(parse_deployment("disagg:prefill=2xtp1,decode=tp1"))
    finally:
        c.shutdown()


def test_step_sweep_feeds_observed_against_predicted_step_times_per_instance() -> None:
    """Each step the instances log reaches the monitor once, with the latency model's prediction for it."""
    from placement.hardware import get_device
    from placement.latency import LatencyProvider
    from placement.replan_decision import predicted_step_s

    c = _controller("disagg:prefill=tp1,decode=tp2")
    latency = LatencyProvider(CFG, get_device("cpu"))  # the roofline of this host
    loop = ReplanLoop(c, ReplanLoopConfig(monitor=MonitorConfig(window_s=30.0, slice_s=0.25)), latency=latency)
    try:
        loop.controller.workload_hook = loop
        since = time.monotonic()
        for k in range(6):
            # no prompt starts like another: a prefix-cache hit (caching is on by default) makes a "mixed" step,
            # which the loop skips (the latency model predicts whole prefills and decodes only)
            prompt = tuple(range(3 + 60 * k, 3 + 60 * k + 5 * (k + 1)))
            got = c.submit(GenerateRequest(f"s{k}", prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
            assert got.collect(timeout_s=60)[0] == reference_tokens(prompt, 5, V)
        loop.tick()
        loop.tick()  # a second sweep adds nothing twice
        time.sleep(0.3)  # the slice holding the steps completes
        window = loop.monitor.window(time.monotonic())
        for entry in c.step_records(since):
            name, steps = str(entry["name"]), entry["steps"]
            assert isinstance(steps, list) and steps
            spec = c.placed_of[name].spec
            model = latency.instance("disagg", spec.tp, spec.pp)
            predicted = sum(
                predicted_step_s(model, s["kind"], tuple(s["prompt_lengths"]), s["batch"], s["ctx_sum"]) for s in steps
            )
            corr = window.corrections[name]
            assert corr.num_steps == len(steps) and corr.role == entry["role"]
            assert corr.observed_s == pytest.approx(sum(s["seconds"] for s in steps))
            assert corr.predicted_s == pytest.approx(predicted)
        assert window.num_arrivals == 6 and window.num_finished == 6
        hist = window.output_lengths
        assert hist.counts[hist.edges.index(4)] == 6 and hist.max_seen == 5  # every output in the [4, 6) bin
    finally:
        c.shutdown()


@pytest.mark.slow  # ~15 s; the default run stays well under 15 minutes
def test_colocated_deployments_switch_too() -> None:
    """colocated:tp1 -> colocated:tp2: the new instance warms up alone, the old one drains its batch."""
    c = _controller("colocated:tp1")
    switcher = PlanSwitcher(c, FACTORY)
    load = Load(c, rate=30.0, seed=9).start()
    try:
        time.sleep(1.0)
        report = switcher.switch(parse_deployment("colocated:tp2"))
        time.sleep(0.5)
    finally:
        load.stop()
    try:
        load.check_all()
        assert report.kept == () and report.added == ("colocated-1",)
        assert [s.name for s in report.retired] == ["colocated-0"] and report.retired[0].num_kv_blocks_used == 0
        assert c.plan.describe() == "colocated:tp2" and c.plan.instances[0].devices == (1, 2)
    finally:
        c.shutdown()


def test_a_quantized_deployment_is_replanned_at_the_precisions_it_serves() -> None:
    """Replanning searches what the deployment serves: a plan served at w8a8 / int4 is never replanned at the
    checkpoint's precision (the planner's default), and a checkpoint-precision plan stays there."""
    from jaxserve.tools.replan_loop import planning_context, served_precisions

    served = DeploymentPlan(instances=(InstanceSpec("prefill", quantization="w8a8"),
                                       InstanceSpec("decode", quantization="int4")))  # fmt: skip
    assert served_precisions(served) == ("int4", "w8a8")
    assert served_precisions(parse_deployment("disagg:prefill=tp1,decode=tp1")) == (None,)
    ctx = planning_context(get_config("opt-13b"), "a100-80gb", "a100-80gb-distserve", 8, 0.25, 0.1,
                           served_precisions(served))  # fmt: skip
    assert ctx.precisions == ("int4", "w8a8")
