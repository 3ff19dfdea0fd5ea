"""The planner's pruning (issue 28: skipping candidates whose throughput bound cannot beat the best found)
chooses what the planner chose without it: the same plan and goodput as a run with pruning off, and as the
unpruned code recorded before the change (`jaxserve plan ... --json` at commit 41cecf1)."""

from __future__ import annotations

import pytest

from placement.context import build_base_workload, build_cluster, build_latency, build_options
from placement.planner import choose_plan
from placement.search import SearchContext, job_bound_per_device
from placement.slo import SloSpec


def _ctx(model: str, profile: str | None, nodes: int, per_node: int, workload: str, n: int, ttft: float, tpot: float):
    latency = build_latency(model, "a100-80gb", profile)
    cluster = build_cluster(latency, nodes, per_node)
    return SearchContext(
        latency,
        cluster,
        build_base_workload(workload, latency, n),
        SloSpec(ttft, tpot),
        # the serving default decode cap, which the recorded plans below were made with (the profile's 1024 lets
        # nearly every candidate's bound stay above the leaders, so little is pruned)
        build_options(max_decode_batch=32),
    )


def _shape(report) -> list[tuple[str, int, int]]:
    return [(i.role, i.tp, i.pp) for i in report.plan.instances]


@pytest.mark.parametrize("workers", [1, 2])  # 2: decisions from the jobs two places back, in worker processes
def test_pruning_keeps_the_plan_and_every_simulated_candidate(workers: int) -> None:
    ctx = _ctx("opt-13b", "a100-80gb-distserve", 1, 8, "fixed:512:64", 120, 0.4, 0.04)
    pruned = choose_plan(ctx, workers=workers, seeds=0, interval_top=2)
    full = choose_plan(ctx, workers=1, seeds=0, interval_top=2, prune=False)
    assert pruned.plan == full.plan and pruned.goodput_rps == full.goodput_rps
    assert pruned.why == full.why and pruned.result.reason == full.result.reason
    before = {(c.kind, c.label): c for r in (full.disagg, full.colocated) if r for c in r.candidates}
    after = [c for r in (pruned.disagg, pruned.colocated) if r for c in r.candidates]
    skipped = [c for c in after if c.pruned]
    assert skipped, "this configuration should let the planner skip some candidates"
    for c in after:
        old = before[(c.kind, c.label)]
        if c.pruned_bound_rps is not None:  # skipped: its bound is above what it would have reached
            assert c.goodput_rps == 0.0 and old.goodput_rps <= c.pruned_bound_rps * (1 + 1e-12)
        else:
            assert c == old
    # a skipped candidate is below the kind's best two (interval_top) even at its bound
    for c in skipped:
        assert c.pruned_bound_rps is not None
        rivals = sorted((o.per_device for o in after if o.kind == c.kind and not o.pruned), reverse=True)
        assert c.pruned_bound_rps / c.num_devices < rivals[1]


def test_bound_is_never_beaten() -> None:
    """What pruning rests on: no candidate's goodput exceeds its throughput bound."""
    from placement.search import algorithm1_jobs, evaluate_job

    ctx = _ctx("opt-13b", "a100-80gb-distserve", 1, 4, "fixed:512:64", 80, 0.4, 0.04)
    for job in algorithm1_jobs(ctx):
        cand = evaluate_job(job)
        assert cand.per_device <= job_bound_per_device(job) * (1 + 1e-12)


# Recorded from the unpruned code (commit 41cecf1, `jaxserve plan --model M --device a100-80gb --nodes N
# --devices-per-node 8 --workload sharegpt --ttft T --tpot P [--profile a100-80gb-distserve] --json`: 400 requests).
RECORDED = {
    "opt-13b": (
        ("a100-80gb-distserve", 1, 0.25, 0.1),
        [("prefill", 4, 1)] + [("decode", 1, 1)] * 4,
        15.887135573081121,
    ),
    "opt-66b": ((None, 4, 0.4, 0.1), [("colocated", 8, 1)] * 4, 8.225802780202091),
    "opt-175b": ((None, 4, 4.0, 0.2), [("colocated", 6, 1)] * 4, 3.754147859475992),
}


@pytest.mark.parametrize(
    "model",
    ["opt-13b", pytest.param("opt-66b", marks=pytest.mark.slow), pytest.param("opt-175b", marks=pytest.mark.heavy)],
)
def test_chosen_plan_is_the_recorded_one(model: str) -> None:
    (profile, nodes, ttft, tpot), shape, goodput = RECORDED[model]
    ctx = _ctx(model, profile, nodes, 8, "sharegpt", 400, ttft, tpot)
    report = choose_plan(ctx, workers=2, seeds=0)
    assert _shape(report) == shape
    assert report.goodput_rps == pytest.approx(goodput, rel=1e-12)
