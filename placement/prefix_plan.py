"""Planning for a multi-turn workload served with prefix caching (`jaxserve plan --conversations N`).

Caching changes what a deployment must do: most of a later turn's prompt is already cached, so the
prefill side shrinks and the best split moves toward fewer prefill devices (docs/prefix_caching.md).
A colocated instance caches prefixes the same way (one pool: prompt + answer of every finished turn,
and nothing ever crosses a link), so colocated deployments are candidates too.
The cache-aware simulator (`placement/prefix_sim.py`) replays whole conversations and costs far more
per probe than the plain one, too much for every candidate of Algorithm 1/2. So planning is two steps:

1. **Screen.** Run the ordinary planner (`choose_plan`, per kind: disaggregated, colocated) on the *cache-adjusted*
   workload: each request's prompt minus what an unbounded prefix cache would serve it
   (`SharedPrefixWorkload.ideal_hits`), Poisson arrivals. That view is optimistic (finite caches
   evict, routing misses), but it moves the search where caching moves the optimum. The planner is
   also run on the plain workload (every prompt in full): the plan one would serve without caching.
2. **Judge.** Every proposed plan is replayed over the conversations by `PrefixGoodputSearch`:
   without caching, and with caching (a disaggregated plan at each conditional-disaggregation
   threshold; a colocated one has no transfer to skip, so one caching arm). The plan and policy with
   the most goodput per device win. Every goodput reported is a judged one, never the screen's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from jaxserve.core.plan import DeploymentPlan, PlanError
from jaxserve.core.scheduling import PrefixPolicy
from placement.conversations import ConversationSet
from placement.goodput import max_rate
from placement.planner import Affinity, PlanReport, choose_plan
from placement.prefix_sim import prefix_goodput_search, simulate_prefix
from placement.search import SearchContext
from placement.workload import Workload, arrival_times

NO_CACHE = PrefixPolicy(enabled=False)
Kind = Literal["disagg", "colocated"]


@dataclasses.dataclass(frozen=True)
class JudgedArm:
    """One plan under one caching policy, replayed over the conversations."""

    source: str  # which screen proposed the plan: "cached" or "plain"
    plan: DeploymentPlan
    policy: PrefixPolicy
    goodput_rps: float

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.plan.num_devices

    @property
    def kind(self) -> Kind:
        return "colocated" if self.plan.kind == "colocated" else "disagg"

    @property
    def label(self) -> str:
        if not self.policy.enabled:
            return "no cache"
        local = self.policy.local_prefill_tokens
        return f"cache + routing + local<{local}" if local else "cache + routing"


@dataclasses.dataclass(frozen=True)
class CachingPlanReport:
    plan: DeploymentPlan  # the winner, placed, `expected` filled from the judged replay
    policy: PrefixPolicy  # the caching policy it was judged best with
    arms: tuple[JudgedArm, ...]
    cached: PlanReport | None  # the disaggregated screen on the cache-adjusted workload (None: not searched)
    plain: PlanReport | None  # the screen on the plain workload (None: no plan meets the SLOs without caching)
    ideal_hit_rate: float  # share of prompt tokens an unbounded cache would serve
    hit_rate: float  # the winner's hit rate, replayed at its goodput
    colocated_cached: PlanReport | None = None  # the colocated screens (None: not searched, or nothing met the SLOs)
    colocated_plain: PlanReport | None = None

    @property
    def best(self) -> JudgedArm:
        return max(self.arms, key=lambda a: (a.goodput_per_device, a.policy.enabled))

    def best_without_caching(self, kind: Kind | None = None) -> JudgedArm:
        return self.best_of(kind, cached=False)

    def best_of(self, kind: Kind | None = None, *, cached: bool) -> JudgedArm:
        """The best judged arm of one kind (None: any) with or without caching; raises when none was judged."""
        arms = [a for a in self.arms if a.policy.enabled == cached and (kind is None or a.kind == kind)]
        if not arms:
            raise ValueError(f"no {kind or 'plan'} was judged {'with' if cached else 'without'} caching")
        return max(arms, key=lambda a: a.goodput_per_device)


def screen_workload(
    conversations: ConversationSet, block_size: int, rng: np.random.Generator, cached: bool
) -> Workload:
    """The conversations' requests as an open-loop workload at rate 1 (shuffled, Poisson arrivals);
    with `cached`, each prompt minus the tokens an unbounded cache would serve it."""
    shared = conversations.at_rate(1.0)
    inputs = shared.workload.input_lens.copy()
    if cached:
        inputs = np.maximum(inputs - shared.ideal_hits(block_size), 1)
    order = rng.permutation(len(inputs))
    n = len(inputs)
    return Workload(arrival_times(rng, 1.0, n), inputs[order], shared.workload.output_lens[order], 1.0)


def plan_for_conversations(
    ctx: SearchContext,
    conversations: ConversationSet,
    *,
    local_thresholds: Sequence[int] = (0, 256),
    kinds: Sequence[Kind] = ("disagg", "colocated"),
    affinity: Affinity = "high",
    workers: int = 1,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> CachingPlanReport:
    """The plan and caching policy serving `conversations` with the most goodput per device.

    `kinds`: which deployments to search (disaggregated, colocated). `ctx.workload` is not used (the
    conversations are the workload); its latency, cluster, SLO and options are. Raises `PlanError`
    when no plan of any kind meets the SLOs even on the cache-adjusted workload.
    """
    if any(t < 0 for t in local_thresholds) or not local_thresholds:
        raise ValueError("local_thresholds: one or more thresholds >= 0 (0: always disaggregate)")
    if not kinds or any(k not in ("disagg", "colocated") for k in kinds):
        raise ValueError(f"kinds: one or more of 'disagg', 'colocated'; got {tuple(kinds)}")
    bs = ctx.options.limits.block_size
    rng = np.random.default_rng(seed)
    cached_ctx = dataclasses.replace(ctx, workload=screen_workload(conversations, bs, rng, cached=True))
    plain_ctx = dataclasses.replace(ctx, workload=screen_workload(conversations, bs, rng, cached=False))

    def screen(kind: Kind, c: SearchContext) -> PlanReport | None:
        try:
            return choose_plan(c, kind=kind, affinity=affinity, workers=workers, progress=progress)
        except PlanError:
            return None

    screens: dict[tuple[Kind, str], PlanReport | None] = {}
    for kind in dict.fromkeys(kinds):
        screens[kind, "cached"] = screen(kind, cached_ctx)
        # Nothing meets the SLOs without caching (None): the cached screen's plan is judged alone.
        screens[kind, "plain"] = screen(kind, plain_ctx)
    if all(screens[kind, "cached"] is None for kind in kinds):
        failures = "; ".join(f"{kind}: no plan meets the SLOs" for kind in dict.fromkeys(kinds))
        raise PlanError(f"{failures} (even on the cache-adjusted workload)")
    disagg_policies = [NO_CACHE, *(PrefixPolicy(local_prefill_tokens=t) for t in sorted(set(local_thresholds)))]
    colocated_policies = [NO_CACHE, PrefixPolicy()]  # nothing to transfer, so no threshold to choose
    arms: list[JudgedArm] = []
    for kind in dict.fromkeys(kinds):
        proposals: list[tuple[str, DeploymentPlan]] = []
        for source in ("cached", "plain"):
            report = screens[kind, source]
            if report is not None and all(report.plan.describe() != p.describe() for _, p in proposals):
                proposals.append((source, report.plan))
        for source, plan in proposals:
            for policy in disagg_policies if kind == "disagg" else colocated_policies:
                search = prefix_goodput_search(
                    plan, ctx.latency, ctx.cluster, conversations, ctx.slo, ctx.options, policy
                )
                arms.append(JudgedArm(source, plan, policy, max_rate(search, ctx.rel_tol)))
    best = max(arms, key=lambda a: (a.goodput_per_device, a.policy.enabled))
    hit_rate = 0.0
    if best.goodput_rps > 0 and best.policy.enabled:
        _, stats = simulate_prefix(
            best.plan, ctx.latency, ctx.cluster, conversations.at_rate(best.goodput_rps), ctx.slo, ctx.options,
            best.policy,
        )  # fmt: skip
        hit_rate = stats.hit_rate
    no_cache = max((a for a in arms if not a.policy.enabled), key=lambda a: a.goodput_per_device)
    shared = conversations.at_rate(1.0)
    ideal = float(shared.ideal_hits(bs).sum() / shared.workload.input_lens.sum())
    expected = dict(best.plan.expected)
    expected.update(
        goodput_rps=best.goodput_rps,
        goodput_rps_per_device=best.goodput_per_device,
        prefix_caching=float(best.policy.enabled),
        local_prefill_tokens=float(best.policy.local_prefill_tokens),
        predicted_hit_rate=hit_rate,
        no_cache_goodput_rps_per_device=no_cache.goodput_per_device,
    )
    for key in ("search_goodput_rps", "disagg_goodput_rps_per_device", "colocated_goodput_rps_per_device"):
        expected.pop(key, None)
    plan = dataclasses.replace(best.plan, expected=expected)
    return CachingPlanReport(
        plan,
        best.policy,
        tuple(arms),
        screens.get(("disagg", "cached")),
        screens.get(("disagg", "plain")),
        ideal,
        hit_rate,
        screens.get(("colocated", "cached")),
        screens.get(("colocated", "plain")),
    )
