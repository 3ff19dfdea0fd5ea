"""Planning as a library call: `choose_plan` takes plain inputs and returns the plan `jaxserve plan` writes."""

from __future__ import annotations

import pytest

from jaxserve.cli import main
from jaxserve.core.plan import DeploymentPlan, PlanError
from placement.context import build_base_workload, build_cluster, build_latency, build_options, build_slo
from placement.planner import choose_plan
from placement.search import SearchContext


def _ctx(ttft: float = 0.4, tpot: float = 0.04) -> SearchContext:
    latency = build_latency("opt-13b", "a100-80gb", "a100-80gb-distserve")
    slo = build_slo(ttft, tpot, 0.9, "p90")
    assert slo is not None
    return SearchContext(
        latency,
        build_cluster(latency, 1, 4),
        build_base_workload("fixed:512:64", latency, 150),
        slo,
        build_options(),
    )


def test_choose_plan_is_what_the_command_writes(capsys) -> None:
    report = choose_plan(_ctx(), kind="auto")
    assert report.plan.limits is not None and report.plan.model == "opt-13b"
    assert report.goodput_per_device == pytest.approx(report.plan.expected["goodput_rps_per_device"])
    assert report.disagg is not None and report.colocated is not None and report.why
    argv = ["plan", "--model", "opt-13b", "--profile", "a100-80gb-distserve", "--devices-per-node", "4"]
    argv += ["--workload", "fixed:512:64", "--num-requests", "150", "--ttft", "0.4", "--tpot", "0.04"]
    argv += ["--slo-mode", "p90", "--workers", "1", "--no-progress", "--json"]
    assert main(argv) == 0
    assert DeploymentPlan.from_json(capsys.readouterr().out) == report.plan


def test_choose_plan_raises_when_nothing_meets_the_slos() -> None:
    with pytest.raises(PlanError):
        choose_plan(_ctx(ttft=0.001, tpot=0.001), kind="colocated")


def test_choose_plan_reports_its_lead_over_the_runner_up_on_common_workloads() -> None:
    ctx = _ctx()

    def reseed(seed: int):
        return build_base_workload("fixed:512:64", ctx.latency, 150, seed)

    report = choose_plan(ctx, kind="auto", reseed=reseed, seeds=2)
    assert report.runner_up is not None and report.runner_up.kind != report.plan.kind
    assert len(report.chosen_samples) == len(report.runner_up_samples) == 3
    assert min(report.chosen_samples) > 0
    lead = report.lead()
    assert lead is not None and "lead" in lead and "of 3" in lead


def test_leading_candidates_get_a_range_over_the_same_workload_samples() -> None:
    """Each phase's / kind's best candidates are re-simulated on the reseeded workloads exactly as the search
    judged them: the first sample is the search's own figure, and another is what an independent
    `GoodputSearch` of that candidate on that workload (same SLO, same mode) gives."""
    import dataclasses
    import math

    from placement.goodput import GoodputSearch, max_rate

    ctx = _ctx()

    def reseed(seed: int):
        return build_base_workload("fixed:512:64", ctx.latency, 150, seed)

    report = choose_plan(ctx, kind="auto", reseed=reseed, seeds=2, interval_top=2)
    assert report.disagg is not None and report.colocated is not None
    kinds = [c.kind for c, _ in report.candidate_intervals]
    for kind in ("prefill", "decode", "colocated"):
        meeting = [
            c for r in (report.disagg, report.colocated) for c in r.candidates if c.kind == kind and c.goodput_rps > 0
        ]
        assert kinds.count(kind) == min(2, len(meeting))
        best = max(meeting, key=lambda c: c.per_device)
        assert report.interval(best) is not None  # the kind's best always gets its range
    for cand, samples in report.candidate_intervals:
        assert len(samples) == 3 and samples[0] == cand.per_device
        lo, hi = report.interval(cand) or (math.nan, math.nan)
        assert lo == min(samples) and hi == max(samples)
    cand, samples = next((c, s) for c, s in report.candidate_intervals if c.kind == "decode")
    slo = dataclasses.replace(ctx.slo, ttft_s=math.inf)
    options = dataclasses.replace(ctx.options, mode="decode")
    search = GoodputSearch(cand.plan, ctx.latency, ctx.cluster, reseed(1001), slo, options)
    # the resampling starts its search at the candidate's goodput on the search's workload
    assert samples[2] == pytest.approx(max_rate(search, ctx.rel_tol, hint=cand.goodput_rps) / cand.num_devices)
