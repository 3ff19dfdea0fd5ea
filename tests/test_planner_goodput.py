"""SLO attainment forms, the early verdict, goodput binary search and the SLO-scale search."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxserve.core.plan import parse_deployment
from models.config import get_config
from placement.goodput import GoodputSearch, base_workload, goodput, max_rate, slo_scale
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, Profile, load_profile
from placement.simulator import SimOptions
from placement.slo import SloSpec, VerdictTracker, attainment

A100 = get_device("a100-80gb")
LP = LatencyProvider(get_config("opt-13b", "float16"), A100, load_profile("a100-80gb-distserve"), prefill_tokens=512)


def test_joint_and_per_metric_attainment() -> None:
    ttft = np.array([0.1, 0.3, 0.1, 0.1])
    tpot = np.array([0.01, 0.01, 0.05, 0.01])
    assert attainment(ttft, tpot, SloSpec(0.2, 0.02, 0.9, "joint")) == 0.5  # requests 0 and 3
    assert attainment(ttft, tpot, SloSpec(0.2, 0.02, 0.9, "p90")) == 0.75  # min(3/4 TTFT, 3/4 TPOT)
    assert SloSpec(0.2, 0.02).scaled(2.0) == SloSpec(0.4, 0.04)
    with pytest.raises(ValueError):
        SloSpec(0.2, 0.02, 1.5)


def test_verdict_tracker_decides_as_soon_as_certain() -> None:
    t = VerdictTracker(10, SloSpec(1.0, 1.0, 0.8))  # need 8 of 10
    t.record_ttft(False)  # a late first token dooms the request in joint mode
    t.record_done(False, True)
    assert t.verdict() is None
    t.record_done(True, False)
    assert t.verdict() is None
    t.record_done(True, False)  # third miss: at most 7 can attain
    assert t.verdict() is False
    ok = VerdictTracker(10, SloSpec(1.0, 1.0, 0.8))
    for _ in range(8):
        ok.record_ttft(True)
        ok.record_done(True, True)
    assert ok.verdict() is True


def test_goodput_of_one_prefill_instance_is_bounded_by_its_service_rate() -> None:
    # Every prompt 512 tokens (service D): the instance can never sustain more than 1/D.
    service = LP.instance("disagg", 1, 1).prefill_stage_s(512, 512**2, 1)
    w = base_workload("fixed:512:2", 1000, seed=0)
    search = GoodputSearch(
        parse_deployment("disagg:prefill=tp1,decode=tp1"),
        LP,
        ClusterSpec(A100, 1, 2),
        w,
        SloSpec(0.4, math.inf, 0.9),
        SimOptions(mode="prefill"),
    )
    rate = max_rate(search, rel_tol=0.01)
    assert 0.7 / service < rate <= 1 / service
    assert search.meets(rate) and not search.meets(rate * 1.03)
    # A tighter TTFT SLO means less goodput; one tighter than the service time means none.
    tighter = max_rate(GoodputSearch(search.plan, LP, search.cluster, w, SloSpec(0.15, math.inf), search.options))
    assert 0 < tighter < rate
    none = GoodputSearch(search.plan, LP, search.cluster, w, SloSpec(service * 0.9, math.inf), search.options)
    assert none.zero_load_attainment() == 0.0 and max_rate(none) == 0.0


def test_a_hint_starts_the_search_near_it_and_saves_probes() -> None:
    """Re-judging a candidate on another workload sample starts at its goodput on the first: the answer is
    a passing rate with a failing one within rel_tol above it (what the cold search guarantees too), found
    with fewer simulations; a hint far off still ends in the right bracket."""
    cluster = ClusterSpec(A100, 1, 2)
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    slo = SloSpec(0.4, 0.05, 0.9)
    first = GoodputSearch(plan, LP, cluster, base_workload("sharegpt", 400, seed=0), slo)
    again = GoodputSearch(plan, LP, cluster, base_workload("sharegpt", 400, seed=1), slo)
    tol = 0.03

    class Counting(GoodputSearch):
        probes = 0

        def meets(self, rate: float) -> bool:
            Counting.probes += 1
            return super().meets(rate)

    counted = Counting(**{f: getattr(again, f) for f in ("plan", "latency", "cluster", "workload", "slo", "options")})
    cold = max_rate(counted, tol)
    cold_probes, Counting.probes = Counting.probes, 0
    hint = max_rate(first, tol)
    warm = max_rate(counted, tol, hint=hint)
    assert hint > 0 and warm > 0 and Counting.probes < cold_probes
    for rate in (cold, warm):
        assert again.meets(rate) and not again.meets(rate * (1 + tol) * 1.0001)
    assert warm == pytest.approx(cold, rel=2 * tol)
    for far in (warm / 3, warm * 3):  # a poor hint costs probes, not the answer
        got = max_rate(again, tol, hint=far)
        assert again.meets(got) and not again.meets(got * (1 + tol) * 1.0001)


def test_goodput_per_device_and_slo_scale() -> None:
    cluster = ClusterSpec(A100, 1, 4)
    w = base_workload("fixed:512:64", 300, seed=1)
    slo = SloSpec(0.4, 0.04, 0.9, "p90")
    search = GoodputSearch(parse_deployment("disagg:prefill=2xtp1,decode=tp1"), LP, cluster, w, slo)
    total, per_device = goodput(search)
    assert per_device == pytest.approx(total / 3)
    scale = slo_scale(search, rate=total / 2)
    assert scale < 1.0  # at half its goodput the deployment meets tighter SLOs
    assert GoodputSearch(search.plan, LP, cluster, w, slo.scaled(scale)).meets(total / 2)
    assert not GoodputSearch(search.plan, LP, cluster, w, slo.scaled(scale * 0.9)).meets(total / 2)


def test_bounds_charge_the_step_overhead() -> None:
    """zero_load_attainment and throughput_bound charge each step its profile step overhead, as the
    simulator does. Folded profile (ms): prefill 10 + 0.1·tokens, decode round 5; step overhead 2 ms a
    step plus 3 ms on a prompt step; every prompt 100 tokens, 11 output tokens; one prompt per batch."""
    entry = {
        "model": "opt-13b",
        "tp": 1,
        "prefill": [10.0, 0.1, 0.0],
        "decode_small": [5.0, 0.0, 0.0],
        "step_overhead": [2e-3, 0.0, 3e-3],
        "L_m": 100,
    }
    latency = LatencyProvider(
        get_config("opt-13b", "float16"), A100, Profile.from_dict({"name": "hand", "entries": [entry]})
    )
    w = base_workload("fixed:100:11", 50, seed=0)
    options = SimOptions.planning(max_decode_batch=32, max_batch_tokens=100)
    disagg = parse_deployment("disagg:prefill=tp1,decode=tp1")

    def search(plan: str, ttft: float, tpot: float) -> GoodputSearch:
        return GoodputSearch(parse_deployment(plan), latency, ClusterSpec(A100, 1, 2), w, SloSpec(ttft, tpot), options)

    # Alone: TTFT = 10 + 0.1·100 = 20 ms of kernels + 2 + 3 ms of host work = 25 ms; TPOT = 5 + 2 = 7 ms.
    assert search("disagg:prefill=tp1,decode=tp1", 0.0251, 0.0071).zero_load_attainment() == 1.0
    assert search("disagg:prefill=tp1,decode=tp1", 0.0249, 1.0).zero_load_attainment() == 0.0  # was 1 (20 ms)
    assert search("disagg:prefill=tp1,decode=tp1", 1.0, 0.0069).zero_load_attainment() == 0.0  # was 1 (5 ms)
    assert search("colocated:tp1", 0.0249, 1.0).zero_load_attainment() == 0.0
    # Prefill: one 25 ms step per prompt -> 40 rps (50 without the overhead). Decode: 32 rows, 10 rounds of
    # 7 ms each -> 70 ms per 32 requests, 457 rps. The pair is limited by prefill.
    assert GoodputSearch(disagg, latency, ClusterSpec(A100, 1, 2), w, SloSpec(1, 1), options).throughput_bound() == (
        pytest.approx(40.0)
    )
    # pp = 2 prefill: 10 ms per stage, host work 2 ms + 3 ms per stage = 8 ms on stage 0; batches pipeline
    # (the next enters stage 0 when it frees, in the runtime too): 18 ms per prompt.
    pp2 = search("disagg:prefill=tp1pp2,decode=tp1", 1.0, 1.0)
    assert pp2.throughput_bound() == pytest.approx(1 / 0.018)
    # Colocated: a 25 ms prompt step plus 10 rounds of 7 ms shared by 32 requests per request.
    assert search("colocated:tp1", 1.0, 1.0).throughput_bound() == pytest.approx(1 / (0.025 + 0.070 / 32))
