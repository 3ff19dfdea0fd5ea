"""Planning as a library call: `choose_plan` takes plain inputs and returns the plan `jaxserve plan` writes."""

from __future__ import annotations

import pytest

from jaxserve.cli import main
from jaxserve.plan import DeploymentPlan, PlanError
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
