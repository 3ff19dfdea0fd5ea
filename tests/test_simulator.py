"""The discrete-event simulator: queueing theory, exact timelines stepped by hand, early stopping."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, parse_deployment
from models.config import get_config
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, Profile, StepOverhead, load_profile, weight_bytes_per_device
from placement.simulator import PHASES, SimOptions, simulate
from placement.slo import SloSpec
from placement.workload import Workload, generate


def kernel_only(profile: Profile) -> Profile:
    strip = {"overhead": None, "max_batch_tokens": None}
    return dataclasses.replace(
        profile,
        folded={k: dataclasses.replace(v, **strip) for k, v in profile.folded.items()},  # type: ignore[arg-type]
        appendix={k: dataclasses.replace(v, **strip) for k, v in profile.appendix.items()},  # type: ignore[arg-type]
    )


OPT13B = get_config("opt-13b", "float16")
A100 = get_device("a100-80gb")
# The kernel times alone (no per-step host overhead, the default 512-token engine cap), so timelines add up by hand.
PROFILE = kernel_only(load_profile("a100-80gb-distserve"))
LP = LatencyProvider(OPT13B, A100, PROFILE, prefill_tokens=512)


def _workload(arrivals: list[float], inputs: list[int], outputs: list[int]) -> Workload:
    return Workload(np.asarray(arrivals, dtype=float), np.asarray(inputs), np.asarray(outputs), rate=1.0)


def test_md1_mean_wait_matches_queueing_theory() -> None:
    # One prefill instance, every prompt 512 tokens = L_m so each batch is one request: an M/D/1 queue.
    service = LP.instance("disagg", 1, 1).prefill_stage_s(512, 512**2, 1)
    rate = 0.4 / service
    w = generate("fixed:512:1", rate, 20_000, np.random.default_rng(0))
    r = simulate(
        parse_deployment("disagg:prefill=tp1,decode=tp1"),
        LP,
        ClusterSpec(A100, 1, 2),
        w,
        None,
        SimOptions(mode="prefill"),
    )
    wait = np.mean(r.prefill_start_at - r.arrival_at)
    theory = rate * service**2 / (2 * (1 - rate * service))
    assert wait == pytest.approx(theory, rel=0.03)
    np.testing.assert_allclose(r.first_token_at - r.prefill_start_at, service)


@pytest.mark.parametrize("devices_per_node", [2, 1])
def test_one_request_disaggregated_timeline(devices_per_node: int) -> None:
    cluster = ClusterSpec(A100, 2, devices_per_node)
    r = simulate(parse_deployment("disagg:prefill=tp1,decode=tp1"), LP, cluster, _workload([0.5], [512], [3]))
    prefill = PROFILE.folded[("disagg", "opt-13b", 1)].prefill
    ttft = (prefill[0] + prefill[1] * 512 + prefill[2] * 512**2) / 1000
    kv = 512 * OPT13B.kv_bytes_per_token
    link = cluster.nvlink_bandwidth if devices_per_node == 2 else cluster.inter_node_bandwidth
    transfer = cluster.link_latency_s + kv / link
    a, b, c = PROFILE.folded[("disagg", "opt-13b", 1)].decode_small
    rounds = [(a + b * ctx + c) / 1000 for ctx in (513, 514)]
    assert r.first_token_at[0] == pytest.approx(0.5 + ttft)
    assert r.transfer_end_at[0] - r.transfer_start_at[0] == pytest.approx(transfer)
    assert r.finish_at[0] == pytest.approx(0.5 + ttft + transfer + sum(rounds))
    assert r.tpot_s[0] == pytest.approx((transfer + sum(rounds)) / 2)
    phases = r.phases()
    assert sum(phases[p][0] for p in PHASES) == pytest.approx(r.finish_at[0] - 0.5)


def test_pipelined_prefill_overlaps_batches() -> None:
    lp = LatencyProvider(OPT13B, A100, PROFILE, prefill_tokens=512)
    cluster = ClusterSpec(A100, 1, 8)
    plan = DeploymentPlan((InstanceSpec("prefill", 1, 2), InstanceSpec("decode", 1, 1)))
    r = simulate(plan, lp, cluster, _workload([0, 0, 0], [512] * 3, [1] * 3), None, SimOptions(mode="prefill"))
    model = lp.instance("disagg", 1, 2, cluster.nvlink_bandwidth)
    stage = model.prefill_stage_s(512, 512**2, 1)
    send = model.send_s(512)
    np.testing.assert_allclose(r.first_token_at, [2 * stage + send, 3 * stage + send, 4 * stage + send])
    np.testing.assert_allclose(r.prefill_start_at, [0, stage, 2 * stage])


def test_pipelined_prefill_charges_the_step_overhead_to_the_batch() -> None:
    """With a step overhead, the first stage does each batch's host work before its kernels: a batch alone
    is done after `prefill_step_s` (what the timed engine sleeps), the next enters when stage 0 frees."""
    from placement.step_time import prefill_step_s

    lp = LatencyProvider(OPT13B, A100, load_profile("a100-80gb-distserve"), prefill_tokens=512)
    cluster = ClusterSpec(A100, 1, 8)
    plan = DeploymentPlan((InstanceSpec("prefill", 1, 2), InstanceSpec("decode", 1, 1)))
    options = SimOptions.planning(mode="prefill", max_batch_tokens=512)  # one prompt a batch
    r = simulate(plan, lp, cluster, _workload([0, 0, 0], [512] * 3, [1] * 3), None, options)
    model, overhead = lp.instance("disagg", 1, 2, cluster.nvlink_bandwidth), lp.step_overhead("disagg", 1)
    stage, send = model.prefill_stage_s(512, 512**2, 1), model.send_s(512)
    host = overhead.step_s(512, 2, True)
    assert host > 0
    assert r.first_token_at[0] == pytest.approx(prefill_step_s(model, overhead, [512]))
    np.testing.assert_allclose(
        r.first_token_at, [2 * stage + host + send, 3 * stage + 2 * host + send, 4 * stage + 3 * host + send]
    )
    np.testing.assert_allclose(r.prefill_start_at, [0, stage + host, 2 * (stage + host)])


def test_prefill_batches_follow_lm_and_shortest_queue() -> None:
    lp = LatencyProvider(OPT13B, A100, PROFILE, prefill_tokens=512)
    plan = parse_deployment("disagg:prefill=2xtp1,decode=tp1")
    # Six 200-token prompts at t=0: shortest queue alternates them over the two instances, so each
    # instance holds 3; the first batch is the first prompt (FCFS; the instance starts on arrival),
    # the next batch takes two (400 <= 512 tokens).
    r = simulate(
        plan, lp, ClusterSpec(A100, 1, 8), _workload([0] * 6, [200] * 6, [1] * 6), None, SimOptions(mode="prefill")
    )
    model = lp.instance("disagg", 1, 1)
    one = model.prefill_stage_s(200, 200**2, 1)
    two = model.prefill_stage_s(400, 2 * 200**2, 2)
    np.testing.assert_allclose(sorted(r.first_token_at), [one, one, one + two, one + two, one + two, one + two])


def test_decode_admission_waits_for_kv_blocks() -> None:
    # A decode device with room for 2,100 tokens of KV: two 2,040-token sequences cannot coexist.
    weights = weight_bytes_per_device(OPT13B, 1, 1)
    small = dataclasses.replace(
        A100, name="small", memory_bytes=int(weights + 2100 * OPT13B.kv_bytes_per_token), usable_memory_fraction=1.0
    )
    cluster = ClusterSpec(small, 1, 2)
    lp = LatencyProvider(OPT13B, small, PROFILE)
    r = simulate(
        parse_deployment("disagg:prefill=tp1,decode=tp1"), lp, cluster, _workload([0, 0], [2000, 2000], [40, 40])
    )
    assert r.transfer_start_at[1] == pytest.approx(r.finish_at[0])  # pulled only when the first one freed its blocks
    assert r.decode_start_at[1] > r.finish_at[0]


def test_decode_batch_room_limits_admission() -> None:
    r = simulate(
        parse_deployment("disagg:prefill=tp1,decode=tp1"),
        LP,
        ClusterSpec(A100, 1, 2),
        _workload([0, 0], [100, 100], [5, 5]),
        None,
        SimOptions.planning(max_decode_batch=1),
    )
    assert r.transfer_start_at[1] == pytest.approx(r.finish_at[0])


def test_full_prefill_buffer_stops_prefill_as_in_the_runtime() -> None:
    # The decode side takes one sequence at a time (batch 1) and each runs 200 tokens, so prefilled
    # sequences wait in the prefill buffer. With one slot (the runtime's PrefillInstance bound, scaled
    # down) a prompt may not start while another sequence is running or buffered; without a slot
    # bound only KV memory limits the buffer.
    w = _workload([0, 0, 0], [100, 100, 100], [200, 200, 200])
    plan, cluster = parse_deployment("disagg:prefill=tp1,decode=tp1"), ClusterSpec(A100, 1, 2)
    opts = SimOptions.planning(max_decode_batch=1, prefill_buffer_slots=1)
    free = simulate(plan, LP, cluster, w, None, dataclasses.replace(opts, bounded_prefill_buffer=False))
    # the first arrival starts alone on the idle instance; the other two form the next batch
    assert free.prefill_start_at[0] == 0.0 and free.prefill_start_at[1] == free.prefill_start_at[2] > 0
    r = simulate(plan, LP, cluster, w, None, opts)
    assert r.prefill_start_at[1] == pytest.approx(r.transfer_end_at[0])  # slot freed by the pull
    assert r.transfer_start_at[1] == pytest.approx(r.finish_at[0])  # decode busy with request 0
    assert r.prefill_start_at[2] == pytest.approx(r.transfer_end_at[1])
    assert r.first_token_at[2] > free.first_token_at[2] + 1.0  # waited out request 0's 200 tokens


def test_colocated_prefill_priority_timeline() -> None:
    # Request 0 arrives at 0 (512 in, 4 out); request 1 arrives during request 0's first decode step.
    lp = LatencyProvider(OPT13B, A100, PROFILE)
    model = lp.instance("colocated", 1, 1)
    prefill = model.prefill_stage_s(512, 512**2, 1)
    r = simulate(
        parse_deployment("colocated:tp1"),
        lp,
        ClusterSpec(A100, 1, 1),
        _workload([0.0, prefill + 0.01], [512, 512], [4, 2]),
    )
    t = prefill
    assert r.first_token_at[0] == pytest.approx(t)
    t += model.decode_stage_s(1, 513)  # r0's first decode step runs; r1 waits for it to end
    assert r.prefill_start_at[1] == pytest.approx(t)
    t += prefill  # r1's prefill pauses r0 (prefill priority)
    assert r.first_token_at[1] == pytest.approx(t)
    t += model.decode_stage_s(2, 514 + 513)  # both decode
    assert r.finish_at[1] == pytest.approx(t)
    t += model.decode_stage_s(1, 515)
    assert r.finish_at[0] == pytest.approx(t)


def test_chunked_prefill_with_piggybacked_decode() -> None:
    lp = LatencyProvider(OPT13B, A100, PROFILE)
    model = lp.instance("colocated", 1, 1)
    r = simulate(
        parse_deployment("colocated:tp1,chunk=256"),
        lp,
        ClusterSpec(A100, 1, 1),
        _workload([0.0, 0.0], [300, 200], [3, 2]),
    )
    # Step 1: 256 tokens of r0. Step 2: r0's last 44 tokens, and r1's 200 fit in the rest (44 + 200 <= 256).
    s1 = model.chunk_stage_s(256, 256 * 256, 1, 0, 0)
    s2 = model.chunk_stage_s(244, 44 * (44 + 2 * 256) + 200 * 200, 2, 0, 0)
    assert r.first_token_at[0] == pytest.approx(s1 + s2)
    assert r.first_token_at[1] == pytest.approx(s1 + s2)
    # Step 3: both decode (one token each), nothing left to prefill.
    s3 = model.decode_stage_s(2, 301 + 201)
    assert r.finish_at[1] == pytest.approx(s1 + s2 + s3)
    s4 = model.decode_stage_s(1, 302)
    assert r.finish_at[0] == pytest.approx(s1 + s2 + s3 + s4)


def test_early_stop_gives_the_full_run_verdict_and_is_deterministic() -> None:
    cluster = ClusterSpec(A100, 1, 4)
    plan = parse_deployment("disagg:prefill=tp2,decode=tp1")
    w = generate("sharegpt", 1.0, 300, np.random.default_rng(5))
    slo = SloSpec(0.25, 0.1)
    for rate in (1.0, 30.0):
        fast = simulate(plan, LP, cluster, w.with_rate(rate), slo)
        full = simulate(plan, LP, cluster, w.with_rate(rate), slo, SimOptions(stop_early=False))
        assert fast.verdict == (full.attainment(slo) >= 0.9)
        assert fast.num_events <= full.num_events
        again = simulate(plan, LP, cluster, w.with_rate(rate), slo, SimOptions(stop_early=False))
        np.testing.assert_array_equal(again.finish_at, full.finish_at)
    assert simulate(plan, LP, cluster, w.with_rate(30.0), slo).num_events < full.num_events / 2


def test_step_overhead_on_a_hand_computed_timeline() -> None:
    # One 512-token request, 3 output tokens, disaggregated tp1/tp1 on one node, with the artifact's host
    # overhead: each step costs 2 ms + 1e-7 s per context token more, a prefill step 1 ms more.
    overhead = StepOverhead(0.002, 1e-7, 0.001)
    with_overhead = dataclasses.replace(
        PROFILE, folded={k: dataclasses.replace(v, overhead=overhead) for k, v in PROFILE.folded.items()}
    )
    lp = LatencyProvider(OPT13B, A100, with_overhead)
    cluster = ClusterSpec(A100, 1, 8)
    r = simulate(parse_deployment("disagg:prefill=tp1,decode=tp1"), lp, cluster, _workload([0.0], [512], [3]))
    a, b, c = PROFILE.folded[("disagg", "opt-13b", 1)].prefill
    prefill_s = (a + b * 512 + c * 512**2) / 1000 + 0.002 + 512e-7 + 0.001
    assert r.first_token_at[0] == pytest.approx(prefill_s, rel=1e-12)
    transfer_s = r.transfer_end_at[0] - r.transfer_start_at[0]
    da, db, dc = PROFILE.folded[("disagg", "opt-13b", 1)].decode_small
    # Two decode rounds (contexts 513 and 514), each with its host overhead.
    rounds = sum((da + db * ctx + dc * 1) / 1000 + 0.002 + ctx * 1e-7 for ctx in (513, 514))
    assert r.finish_at[0] == pytest.approx(prefill_s + transfer_s + rounds, rel=1e-12)


def test_prefill_batches_up_to_the_engine_token_cap_not_l_m() -> None:
    # Four 512-token prompts at t=0: the first starts alone on arrival, the other three queue behind it. L_m is
    # 512 (the bubble target); the engine cap is 2048, so the three then run as one batch; with the cap at 512
    # each runs alone, one after the other.
    capped = dataclasses.replace(
        PROFILE, folded={k: dataclasses.replace(v, max_batch_tokens=2048) for k, v in PROFILE.folded.items()}
    )
    lp = LatencyProvider(OPT13B, A100, capped, prefill_tokens=512)
    assert lp.prefill_token_budget("disagg", 1) == 512 and lp.engine_token_cap("disagg", 1) == 2048
    cluster = ClusterSpec(A100, 1, 8)
    w = _workload([0.0] * 4, [512] * 4, [1] * 4)
    a, b, c = PROFILE.folded[("disagg", "opt-13b", 1)].prefill
    one = (a + b * 512 + c * 512**2) / 1000
    three = (a + b * 1536 + c * 3 * 512**2) / 1000
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    r = simulate(plan, lp, cluster, w, None, SimOptions(bounded_prefill_buffer=False))
    assert r.first_token_at == pytest.approx([one] + [one + three] * 3, rel=1e-12)
    r = simulate(
        plan,
        lp,
        cluster,
        w,
        None,
        dataclasses.replace(SimOptions.planning(max_batch_tokens=512), bounded_prefill_buffer=False),
    )
    assert r.first_token_at == pytest.approx([one, 2 * one, 3 * one, 4 * one], rel=1e-12)
