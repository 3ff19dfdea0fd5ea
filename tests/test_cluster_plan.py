"""Planning at cluster scale (`placement/cluster_plan.py`): a unit searched by simulation, then replicated."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError
from models.config import get_config
from placement.cluster_plan import (
    full_cluster_check,
    plan_cluster,
    plan_unit,
    replicated_workload,
    unit_context,
)
from placement.goodput import GoodputSearch, base_workload
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider
from placement.planner import choose_plan
from placement.search import SearchContext
from placement.slo import SloSpec

A100 = get_device("a100-80gb")
OPT175 = LatencyProvider(get_config("opt-175b", "float16"), A100)  # roofline


def _ctx(nodes: int, num_requests: int = 400) -> SearchContext:
    # the OPT-175B chatbot setting of the issue (ShareGPT, TTFT 4 s, TPOT 0.2 s)
    return SearchContext(
        OPT175, ClusterSpec(A100, nodes, 8), base_workload("sharegpt", num_requests, 0), SloSpec(4, 0.2)
    )


def test_replicated_plan_is_the_unit_plan_on_every_unit_of_nodes() -> None:
    ctx = _ctx(10)  # two units of 4 nodes and 2 nodes left over
    report = plan_cluster(ctx, kind="disagg", affinity="low", check_units=0)
    unit = choose_plan(unit_context(ctx, 4), kind="disagg", affinity="low")
    assert report.unit.plan == unit.plan and report.num_units == 2 and report.unit_nodes == 4
    plan = report.plan
    # the unit's instances, node for node, on nodes 0-3 and 4-7; the rest on nodes 8-9
    n = len(unit.plan.instances)
    for k in range(2):
        for a, b in zip(plan.instances[k * n : (k + 1) * n], unit.plan.instances, strict=True):
            assert (a.role, a.tp, a.pp) == (b.role, b.tp, b.pp)
            assert a.nodes == tuple(x + 4 * k for x in b.nodes or ())
            assert a.devices == tuple(d + 32 * k for d in b.devices or ())
    assert report.rest is not None and report.rest.plan.kind == unit.plan.kind
    assert all(min(i.nodes or ()) >= 8 for i in plan.instances[2 * n :])
    # Algorithm 2's pairs stay node-local: each stage of a pair's prefill and decode on one node
    for p, d in zip(plan.instances[0::2], plan.instances[1::2], strict=True):
        assert p.role == "prefill" and d.role == "decode" and p.nodes == d.nodes
    # what the plan says: units, the rest, idle devices; the goodputs summed without a check
    assert report.idle_devices == ctx.cluster.num_devices - plan.num_devices
    assert plan.expected["num_units"] == 2 and plan.expected["idle_devices"] == report.idle_devices
    assert report.goodput_rps == pytest.approx(2 * unit.goodput_rps + report.rest.goodput_rps)
    assert "left over" in report.why and plan.limits is not None


def test_a_cluster_no_larger_than_a_unit_gets_the_search_plan_unchanged() -> None:
    ctx = _ctx(4)
    report = plan_cluster(ctx, kind="disagg", affinity="low")
    assert report.plan == choose_plan(ctx, kind="disagg", affinity="low").plan
    assert report.num_units == 1 and report.rest is None and not report.replicated


def test_bounded_check_predicts_the_full_cluster_simulation_at_16_nodes() -> None:
    """Where a full-cluster simulation still finishes (16 × 8), the replicated plan's predicted goodput per
    device — two units simulated together — is within 2 % of one simulation of all four units serving all
    four units' requests. 800 requests per unit keep the goodput below the throughput bound, where a finite
    trace would pass whatever the plan (and the comparison would show nothing)."""
    ctx = _ctx(16, num_requests=800)
    report = plan_cluster(ctx, kind="disagg", affinity="high", workers=2)
    assert report.num_units == 4 and report.check_units == 2
    predicted, simulated = full_cluster_check(ctx, report)
    search = GoodputSearch(report.plan, OPT175, ctx.cluster, replicated_workload(ctx.workload, 4, 1), ctx.slo)
    assert simulated < 0.97 * search.throughput_bound() / report.plan.num_devices  # not at the bound
    assert predicted == pytest.approx(simulated, rel=0.02)
    # the units alone (no pooling) predict less: what the check adds
    assert report.replicated_rps < report.goodput_rps


def test_with_a_rate_whole_units_carry_what_they_can_and_one_more_search_the_rest() -> None:
    ctx = _ctx(12)
    full = plan_cluster(ctx, kind="disagg", affinity="low", check_units=0)
    g_unit = full.unit.goodput_rps
    report = plan_cluster(ctx, kind="disagg", affinity="low", rate=1.5 * g_unit, check_units=0)
    assert report.num_units == 1 and report.rest is not None
    assert report.goodput_rps >= 1.5 * g_unit * 0.999
    with pytest.raises(PlanError, match="needs more than"):
        plan_cluster(ctx, kind="disagg", affinity="low", rate=10 * g_unit, check_units=0)


def test_replicated_workload_keeps_the_lengths_of_every_unit() -> None:
    w = base_workload("sharegpt", 50, 0)
    merged = replicated_workload(w, 3, seed=7)
    assert len(merged) == 150 and merged.rate == pytest.approx(3 * w.rate)
    assert np.all(np.diff(merged.arrival_at) >= 0)
    assert sorted(merged.input_lens.tolist()) == sorted(w.input_lens.tolist() * 3)
    assert set(w.arrival_at.tolist()) <= set(merged.arrival_at.tolist())  # the first stream is the search's


def test_plan_unit_finds_the_repeated_set() -> None:
    p, d = InstanceSpec("prefill", 2, 1), InstanceSpec("decode", 1, 1)
    unit, k = plan_unit(DeploymentPlan((p, p, p, d, d, d, d, d, d)))
    assert k == 3 and [i.role for i in unit.instances] == ["prefill", "decode", "decode"]
    same, one = plan_unit(DeploymentPlan((p, p, d)))
    assert one == 1 and same.instances == (p, p, d)


def test_slos_no_unit_meets_fail_at_once_and_a_model_too_large_for_a_unit_gets_a_larger_one() -> None:
    ctx = dataclasses.replace(_ctx(64), slo=SloSpec(0.001, 0.001))
    with pytest.raises(PlanError):  # no search of the whole 64 nodes: the unit's answer is final
        plan_cluster(ctx, kind="colocated", check_units=0)
    # OPT-175B needs more than one A100 per instance: on nodes of 2 devices a unit of 1 node fits nothing
    small = SearchContext(OPT175, ClusterSpec(A100, 8, 2), base_workload("sharegpt", 100, 0), SloSpec(8, 0.4))
    report = plan_cluster(small, kind="disagg", unit_nodes=1, check_units=0)
    assert report.unit_nodes > 1 and report.plan.num_devices <= 16


def test_the_plan_command_replicates_the_unit_and_writes_every_instance(capsys, tmp_path) -> None:
    from jaxserve.cli import main

    argv = ["plan", "--model", "opt-175b", "--device", "a100-80gb", "--devices-per-node", "8", "--workload"]
    argv += ["sharegpt", "--ttft", "4", "--tpot", "0.2", "--kind", "disagg", "--affinity", "low", "--seeds", "0"]
    argv += ["--workers", "1", "--no-progress", "--check-units", "0"]
    out = tmp_path / "plan.json"
    assert main([*argv, "--nodes", "8", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "searched one unit of 4 node(s)" in printed and "over the cluster: 2 unit(s) of 4 node(s)" in printed
    plan = DeploymentPlan.from_json(out.read_text())
    unit = choose_plan(unit_context(_ctx(8), 4), kind="disagg", affinity="low").plan
    assert len(plan.instances) == 2 * len(unit.instances) and plan.expected["num_units"] == 2
    assert max(n for i in plan.instances for n in i.nodes or ()) == 7
    # --unit-nodes 0: the whole cluster searched at once, as before units
    assert main([*argv, "--nodes", "8", "--unit-nodes", "0", "--json"]) == 0
    whole = DeploymentPlan.from_json(capsys.readouterr().out)
    assert "num_units" not in whole.expected
