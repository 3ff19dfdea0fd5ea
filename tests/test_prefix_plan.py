"""`jaxserve plan --conversations`: planning a disaggregated deployment and caching policy for multi-turn chat."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.cli import main
from jaxserve.core.plan import DeploymentPlan
from jaxserve.core.scheduling import PrefixPolicy
from models.config import get_config
from placement.conversations import ConversationSpec, generate_conversations
from placement.goodput import max_rate
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, load_profile
from placement.prefix_plan import NO_CACHE, plan_for_conversations, screen_workload
from placement.prefix_sim import prefix_goodput_search
from placement.search import SearchContext
from placement.simulator import SimOptions
from placement.slo import SloSpec

COMMON = ["--model", "opt-13b", "--device", "a100-80gb", "--profile", "a100-80gb-distserve", "--num-requests", "50"]
SLO = SloSpec(0.25, 0.1, 0.9, "joint")


def test_screen_workload_removes_exactly_the_ideal_hits() -> None:
    """One shared 32-token system prompt, fixed 16-token user turns and answers, 2 turns, block 16: turn 0 prompts
    are 48 tokens (the first conversation's has no hit, the others' share 2 system-prompt blocks: 16 left); turn 1
    prompts are 48 + 16 + 16 = 80 tokens and hit the 3 full blocks of turn 0's prompt + answer minus the answer's
    last token (63 tokens, whose KV exists): 32 left."""
    spec = ConversationSpec(
        num_system_prompts=1, system_prompt_tokens=32, min_turns=2, max_turns=2, user_tokens=16, answer_tokens=16
    )
    convs = generate_conversations(spec, 5, np.random.default_rng(0))
    plain = screen_workload(convs, 16, np.random.default_rng(1), cached=False)
    cached = screen_workload(convs, 16, np.random.default_rng(1), cached=True)
    assert sorted(plain.input_lens.tolist()) == [48] * 5 + [80] * 5
    assert sorted(cached.input_lens.tolist()) == [16] * 4 + [32] * 5 + [48]
    assert sorted(cached.output_lens.tolist()) == [16] * 10 and cached.rate == 1.0


@pytest.fixture(scope="module")
def ctx() -> SearchContext:
    latency = LatencyProvider(
        get_config("opt-13b", "float16"), get_device("a100-80gb"), load_profile("a100-80gb-distserve")
    )
    cluster = ClusterSpec(get_device("a100-80gb"), 1, 4)
    convs = generate_conversations(ConversationSpec(), 60, np.random.default_rng(0))
    return SearchContext(
        latency, cluster, screen_workload(convs, 16, np.random.default_rng(0), False), SLO, SimOptions()
    )


def test_plan_for_conversations_judges_every_arm_and_returns_the_best(ctx: SearchContext) -> None:
    convs = generate_conversations(ConversationSpec(), 60, np.random.default_rng(0))
    report = plan_for_conversations(ctx, convs, local_thresholds=(0, 256), kinds=("disagg",))
    sources = {a.source for a in report.arms}
    assert {a.kind for a in report.arms} == {"disagg"} and report.colocated_cached is None
    # Each proposed plan is judged without caching and with caching at both thresholds.
    assert len(report.arms) == 3 * len(sources)
    assert {a.policy.local_prefill_tokens for a in report.arms if a.policy.enabled} == {0, 256}
    best = report.best
    assert all(best.goodput_per_device >= a.goodput_per_device for a in report.arms)
    assert report.plan.describe() == best.plan.describe() and report.policy == best.policy
    assert report.plan.expected["goodput_rps"] == best.goodput_rps
    assert report.plan.expected["no_cache_goodput_rps_per_device"] == report.best_without_caching().goodput_per_device
    # A reported goodput is the cache-aware simulator's, recomputed here for the winner's no-cache arm.
    no_cache = next(a for a in report.arms if a.plan is best.plan and not a.policy.enabled)
    search = prefix_goodput_search(best.plan, ctx.latency, ctx.cluster, convs, ctx.slo, ctx.options, NO_CACHE)
    assert no_cache.goodput_rps == max_rate(search, ctx.rel_tol)
    # Caching moves prefill work off the prefill side: the cache screen never asks for more prefill devices.
    assert report.plain is not None and report.cached is not None

    def prefill_devices(plan: DeploymentPlan) -> int:
        return sum(i.tp * i.pp for i in plan.of_role("prefill"))

    assert prefill_devices(report.cached.plan) <= prefill_devices(report.plain.plan)
    assert 0.0 < report.hit_rate <= report.ideal_hit_rate <= 1.0


def test_plan_conversations_cli_json(capsys) -> None:
    argv = ["plan", *COMMON, "--devices-per-node", "3", "--ttft", "0.25", "--tpot", "0.1", "--conversations", "40"]
    argv += ["--local-prefill-tokens", "0", "--workers", "1", "--no-progress", "--json", "--kind", "disagg"]
    assert main(argv) == 0
    plan = DeploymentPlan.from_json(capsys.readouterr().out)
    assert plan.kind == "disagg" and plan.num_devices <= 3
    assert plan.expected["local_prefill_tokens"] == 0.0 and plan.expected["prefix_caching"] in (0.0, 1.0)
    assert plan.expected["goodput_rps_per_device"] == pytest.approx(plan.expected["goodput_rps"] / plan.num_devices)


@pytest.mark.parametrize(
    "extra",
    [
        ["--conversations", "0"],
        ["--conversations", "10", "--local-prefill-tokens", "-1"],
    ],
)
def test_plan_conversations_bad_arguments_exit_2(extra: list[str], capsys) -> None:
    assert main(["plan", *COMMON, "--ttft", "0.25", "--tpot", "0.1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err


def test_local_thresholds_must_be_non_negative(ctx: SearchContext) -> None:
    convs = generate_conversations(ConversationSpec(), 5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="thresholds"):
        plan_for_conversations(dataclasses.replace(ctx), convs, local_thresholds=(-1,))


def test_colocated_plans_are_judged_with_and_without_caching(ctx: SearchContext) -> None:
    convs = generate_conversations(ConversationSpec(), 60, np.random.default_rng(0))
    report = plan_for_conversations(ctx, convs, kinds=("colocated",))
    assert report.cached is None and report.plain is None and report.colocated_cached is not None
    assert {a.kind for a in report.arms} == {"colocated"}
    # One arm without caching and one with it per proposed plan (no transfer, so no threshold).
    assert [a.policy for a in report.arms] == [NO_CACHE, PrefixPolicy()] * (len(report.arms) // 2)
    with_cache, without = report.best_of("colocated", cached=True), report.best_of("colocated", cached=False)
    assert with_cache.goodput_per_device > without.goodput_per_device  # less prefill work in every step
    search = prefix_goodput_search(
        with_cache.plan, ctx.latency, ctx.cluster, convs, ctx.slo, ctx.options, with_cache.policy
    )
    assert with_cache.goodput_rps == max_rate(search, ctx.rel_tol)
    assert report.plan.kind == "colocated" and report.plan.expected["prefix_caching"] == 1.0
    assert 0.0 < report.hit_rate <= report.ideal_hit_rate
    with pytest.raises(ValueError, match="disagg"):
        report.best_of("disagg", cached=True)


def test_plan_conversations_cli_compares_both_kinds(capsys) -> None:
    argv = ["plan", *COMMON, "--devices-per-node", "2", "--ttft", "0.25", "--tpot", "0.1", "--conversations", "40"]
    argv += ["--local-prefill-tokens", "0", "--workers", "1", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "disagg: " in out and "colocated: " in out and "rps/device without caching" in out


def test_kinds_must_be_known(ctx: SearchContext) -> None:
    convs = generate_conversations(ConversationSpec(), 5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="kinds"):
        plan_for_conversations(ctx, convs, kinds=())
