"""Choosing the deployment: the planner as one library call (`jaxserve plan`, tests and replanning use it).

`choose_plan(ctx, ...)` runs the searches a plan needs — Algorithm 1 (high node affinity) or 2 (low) for the
disaggregated kind, the colocated search, with `kind="auto"` both and the better goodput per device — verifies
an Algorithm-1 plan by a joint simulation (the per-phase searches judge each phase alone), optionally searches
the prefill:decode ratio, and returns the placed `DeploymentPlan` (model, expected metrics and the serving
limits it was planned with filled in) with a `PlanReport` of how it was chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import DeploymentPlan, PlanError
from placement.candidates import (
    Candidate,
    Evaluated,
    Job,
    Key,
    SearchContext,
    SearchResult,
    candidate_samples,
    job_key,
    plan_job,
)
from placement.latency import kv_capacity_tokens
from placement.precision import describe
from placement.search import (
    algorithm1,
    algorithm1_jobs,
    algorithm2,
    algorithm2_jobs,
    algorithm2_phase_jobs,
    assign_nodes,
    choose_deployment,
    colocated_jobs,
    colocated_search,
    evaluate_all,
    ratio_search,
    replicate_colocated,
)
from placement.workload import Workload

PlanKind = Literal["auto", "disagg", "colocated"]
Affinity = Literal["high", "low"]


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """How the plan was chosen: every search's result, the joint check, the kind decision."""

    plan: DeploymentPlan
    result: SearchResult  # the search whose plan was chosen
    goodput_rps: float  # the chosen plan's goodput (joint simulation for a verified Algorithm-1 plan)
    why: str
    disagg: SearchResult | None = None
    colocated: SearchResult | None = None
    joint_rps: float | None = None  # the joint simulation of the best disaggregated plan, when verified
    disagg_per_device: float = 0.0
    ratio: SearchResult | None = None
    failures: tuple[str, ...] = ()  # kinds that found no plan (with kind="auto" the other may still win)
    # With `reseed`: goodput per device of the chosen plan and of the runner-up (the other kind's best) over
    # the search's workload and `seeds` more samples of it (common random numbers: both see the same ones).
    chosen_samples: tuple[float, ...] = ()
    runner_up: DeploymentPlan | None = None
    runner_up_samples: tuple[float, ...] = ()
    # With `reseed`: the leading candidates of each search (the best `interval_top` per phase / kind) with
    # their goodput per device on the same workload samples, the search's own first.
    candidate_intervals: tuple[tuple[Candidate, tuple[float, ...]], ...] = ()

    def interval(self, cand: Candidate) -> tuple[float, float] | None:
        """The range of `cand`'s goodput per device over the workload samples, when it was re-simulated."""
        for c, samples in self.candidate_intervals:
            if c is cand:
                return min(samples), max(samples)
        return None

    def lead(self) -> str | None:
        """The chosen plan's lead over the runner-up, with each one's range over the seeds."""
        if not self.chosen_samples or not self.runner_up_samples or self.runner_up is None:
            return None
        a, b = self.chosen_samples, self.runner_up_samples
        mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
        wins = sum(x > y for x, y in zip(a, b, strict=True))
        return (
            f"{describe(self.plan)} {mean_a:.3g} rps/device [{min(a):.3g}, {max(a):.3g}] vs runner-up "
            f"{describe(self.runner_up)} {mean_b:.3g} [{min(b):.3g}, {max(b):.3g}] over {len(a)} workload samples: "
            f"lead {100 * (mean_a / mean_b - 1) if mean_b > 0 else float('inf'):+.1f} %, ahead on {wins} of {len(a)}"
        )

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.plan.num_devices


def planned_limits(plan: DeploymentPlan, ctx: SearchContext) -> ServingLimits:
    """The limits the plan was simulated with, the KV blocks made concrete: what the smallest decode / colocated
    instance's memory holds when the options left them to the device (the server applies one number to all);
    the token and decode batch caps the profile's engines ran with where the options took them from it."""
    opts = ctx.options
    caps = {opts.token_cap(ctx.latency.profile_token_cap(plan.kind, i.tp)) for i in plan.instances}
    decode_batch = opts.decode_batch_cap(ctx.latency.profile_decode_batch(plan.kind))
    limits = opts.served_limits(token_cap=min(caps), decode_batch=decode_batch)
    if limits.num_kv_blocks is None:
        blocks = min(
            kv_capacity_tokens(ctx.cfg, ctx.cluster.device, i.tp, i.pp, i.quantization) // limits.block_size
            for i in plan.instances
            if i.role != "prefill"
        )
        limits = dataclasses.replace(limits, num_kv_blocks=max(1, blocks))
    return limits


def choose_plan(
    ctx: SearchContext,
    *,
    kind: PlanKind = "auto",
    affinity: Affinity = "high",
    rate: float | None = None,
    workers: int = 1,
    verify: bool = True,
    compare_colocated: bool = False,
    ratio_devices: int = 0,
    progress: Callable[[int, int], None] | None = None,
    reseed: Callable[[int], Workload] | None = None,
    seeds: int = 2,
    interval_top: int = 3,
    prune: bool = True,
    cache: Evaluated | None = None,
) -> PlanReport:
    """The deployment to serve `ctx`'s workload under its SLOs; raises PlanError when none meets them.

    With `prune` candidates that provably cannot be picked (nor be among the `interval_top` leaders) are
    not simulated (`evaluate_all`): the same plan, faster; they show as `Candidate.pruned`. `cache` carries
    simulated candidates between calls on the same workload, SLOs and options (`evaluate_all`)."""
    if rate is not None and rate <= 0:
        raise ValueError("rate must be positive")
    cluster, latency = ctx.cluster, ctx.latency
    disagg = colocated = ratio = None
    joint = None
    failures: list[str] = []
    # The candidates of every search this call runs, in two parallel maps: first every phase alone and
    # every colocated shape; then what starts from those results (Algorithm 2's pairs, from their phases)
    # or needs them (the joint check of Algorithm 1's plan).
    # A search needs its best few candidates exactly (its pick, the leaders given a range over seeds); the
    # others may be skipped once their throughput bound shows they cannot be among them (`evaluate_all`).
    local_search = kind != "colocated" and (affinity == "low" or verify)  # Algorithm 2 runs
    first, prunable = _first_jobs(ctx, kind, affinity, local_search, compare_colocated)
    keep = max(1, interval_top)
    evaluated = evaluate_all(first, workers, progress, prunable if prune else None, keep, cluster, cache)
    if kind != "colocated" and affinity == "high":
        try:
            disagg = algorithm1(ctx, rate, workers=workers, progress=progress, evaluated=evaluated)
        except PlanError as e:
            if kind == "disagg":
                raise
            failures.append(f"disaggregated: {e}")
    second: list[Job] = []
    prunable = {}
    if local_search:
        with contextlib.suppress(PlanError, KeyError):  # KeyError: no phase results (no pairs fit)
            pairs = algorithm2_jobs(ctx, evaluated)
            second += pairs
            prunable = _competing(pairs)
    disagg_plan = None
    if disagg is not None:
        disagg_plan = assign_nodes(disagg.plan, cluster, pair_stages=False)
        if verify:  # Algorithm 1 judged each phase alone; check the whole deployment against both SLOs
            second.insert(0, plan_job(ctx, disagg_plan))  # the longest job of the map (a cold search): first
    evaluated.update(evaluate_all(second, workers, progress, prunable if prune else None, keep, cache=cache))
    if kind != "colocated" and affinity == "low":
        try:
            disagg = algorithm2(ctx, rate, workers=workers, progress=progress, evaluated=evaluated)
            disagg_plan = assign_nodes(disagg.plan, cluster, pair_stages=True)
        except PlanError as e:
            if kind == "disagg":
                raise
            failures.append(f"disaggregated: {e}")
    if kind != "disagg" or compare_colocated:
        try:
            colocated = colocated_search(ctx, workers=workers, progress=progress, evaluated=evaluated)
        except PlanError as e:
            if kind == "colocated" or disagg is None:
                raise PlanError("; ".join([*failures, f"colocated: {e}"])) from None
            failures.append(f"colocated: {e}")
    if disagg_plan is not None and affinity == "high" and verify:
        joint = evaluated[("disagg", disagg_plan.instances)].goodput_rps
    disagg_rps = joint if joint is not None else (disagg.goodput_rps if disagg else 0.0)
    disagg_pd = disagg_rps / disagg_plan.num_devices if disagg_plan is not None else 0.0
    if kind != "colocated" and affinity == "high" and verify:
        better = _node_local_beats(ctx, rate, workers, progress, evaluated, disagg_plan, disagg_pd)
        if better is not None:
            disagg, disagg_plan = better
            joint = disagg_rps = disagg.goodput_rps
            disagg_pd = disagg_rps / disagg_plan.num_devices
            failures = [f for f in failures if not f.startswith("disaggregated")]
    chosen, why = choose_deployment(disagg, disagg_pd, colocated if kind != "disagg" else None)
    if chosen == "disagg":
        assert disagg is not None and disagg_plan is not None
        result, plan, goodput_rps = disagg, disagg_plan, disagg_rps
        if ratio_devices:
            shapes = (disagg.plan.of_role("prefill")[0], disagg.plan.of_role("decode")[0])
            ratio = ratio_search(ctx, *shapes, max_devices=ratio_devices, workers=workers, progress=progress)
    else:
        assert colocated is not None
        result = replicate_colocated(ctx, colocated, rate)
        plan = assign_nodes(result.plan, cluster)
        goodput_rps = result.goodput_rps
    expected = {
        "goodput_rps": goodput_rps,
        "goodput_rps_per_device": goodput_rps / plan.num_devices,
        "search_goodput_rps": result.goodput_rps,
        "ttft_slo_s": ctx.slo.ttft_s,
        "tpot_slo_s": ctx.slo.tpot_s,
        "attainment": ctx.slo.attainment,
    }
    if disagg is not None and colocated is not None and kind == "auto":
        expected["disagg_goodput_rps_per_device"] = disagg_pd
        expected["colocated_goodput_rps_per_device"] = colocated.goodput_per_device
    if rate is not None:
        expected["target_rate_rps"] = rate
    plan = dataclasses.replace(plan, model=latency.cfg.name, expected=expected, limits=planned_limits(plan, ctx))
    if chosen == "disagg":
        runner_up, runner_rps = _colocated_runner_up(ctx, colocated, rate)
    else:
        runner_up, runner_rps = disagg_plan, disagg_rps
    chosen_samples: tuple[float, ...] = ()
    runner_samples: tuple[float, ...] = ()
    intervals: tuple[tuple[Candidate, tuple[float, ...]], ...] = ()
    if reseed is not None and seeds > 0:
        leaders = _leaders([r for r in (disagg, colocated) if r is not None], interval_top)
        # with a runner-up, the chosen plan and it are re-simulated whole, on the search's workload too
        pair = ((plan, goodput_rps), (runner_up, runner_rps)) if runner_up is not None else ()
        intervals, whole = _resampled(ctx, leaders, pair, [reseed(1000 + i) for i in range(seeds)], workers)
        if whole:
            chosen_samples, runner_samples = whole
    return PlanReport(
        plan=plan,
        result=result,
        goodput_rps=goodput_rps,
        why=why,
        disagg=disagg,
        colocated=colocated,
        joint_rps=joint,
        disagg_per_device=disagg_pd,
        ratio=ratio,
        failures=tuple(failures),
        chosen_samples=chosen_samples,
        runner_up=runner_up,
        runner_up_samples=runner_samples,
        candidate_intervals=intervals,
    )


def _first_jobs(
    ctx: SearchContext, kind: PlanKind, affinity: Affinity, local_search: bool, compare_colocated: bool
) -> tuple[list[Job], dict[Key, frozenset[Key]]]:
    """The first map's jobs — every phase alone (Algorithm 1's shapes, Algorithm 2's segments) and every
    colocated shape — and which of them may be pruned (`evaluate_all`). A search that finds no job here raises
    its PlanError again when it runs, where it is handled."""
    first: list[Job] = []
    prunable: dict[Key, frozenset[Key]] = {}
    alg2_phases: list[Job] = []
    if local_search:
        with contextlib.suppress(PlanError):
            alg2_phases = algorithm2_phase_jobs(ctx)
    if kind != "colocated" and affinity == "high":
        with contextlib.suppress(PlanError):
            alg1 = algorithm1_jobs(ctx)
            first += alg1
            # Algorithm 2's pairs start from their phases' goodputs: those are needed whatever they are
            prunable.update(_competing(alg1, exclude=alg2_phases))
    first += alg2_phases
    if kind != "disagg" or compare_colocated:
        with contextlib.suppress(PlanError):
            coloc = colocated_jobs(ctx)
            first += coloc
            prunable.update(_competing(coloc))
    return first, prunable


def _node_local_beats(
    ctx: SearchContext,
    rate: float | None,
    workers: int,
    progress: Callable[[int, int], None] | None,
    evaluated: Evaluated,
    disagg_plan: DeploymentPlan | None,
    disagg_pd: float,
) -> tuple[SearchResult, DeploymentPlan] | None:
    """Algorithm 2's best node-local placement when it serves more per device than Algorithm 1's plan.

    Algorithm 1 pairs phases judged alone, blind to the KV each pair must move. Every placement of Algorithm 2
    (both phases' stages on one node, KV over NVLink) is allowed under high affinity too, and its pairs are
    judged jointly: taking it when it serves more per device means high affinity never returns less than low
    affinity on the same cluster."""
    try:
        local = algorithm2(ctx, rate, workers=workers, progress=progress, evaluated=evaluated)
        # with a target rate Algorithm 2 replicates pairs without counting nodes: more than fit is no plan
        local_plan = assign_nodes(local.plan, ctx.cluster, pair_stages=True)
    except PlanError:
        return None
    local_pd = local.goodput_rps / local_plan.num_devices
    if disagg_plan is not None and local_pd <= disagg_pd * (1 + 1e-9):
        return None
    prior = f"{disagg_pd:.3g} rps/device jointly" if disagg_plan is not None else "no plan"
    reason = f"{local.reason}; beats Algorithm 1's phase-wise pairing ({prior}) once KV transfers count"
    return dataclasses.replace(local, reason=reason), local_plan


def _colocated_runner_up(
    ctx: SearchContext, colocated: SearchResult | None, rate: float | None
) -> tuple[DeploymentPlan | None, float]:
    """The colocated search's plan as the runner-up of a disaggregated choice, placed, and its goodput."""
    if colocated is None:
        return None, 0.0
    replicated = replicate_colocated(ctx, colocated, rate)
    return assign_nodes(replicated.plan, ctx.cluster), replicated.goodput_rps


def _resampled(
    ctx: SearchContext,
    leaders: list[Candidate],
    plans: Sequence[tuple[DeploymentPlan, float | None]],
    workloads: list[Workload],
    workers: int,
) -> tuple[tuple[tuple[Candidate, tuple[float, ...]], ...], list[tuple[float, ...]]]:
    """Each leader's goodput per device on the search's workload and on `workloads` (common random numbers),
    and each whole plan's on all of them (`candidate_samples`)."""
    resampled, whole = candidate_samples(ctx, leaders, workloads, workers, plans=plans)
    intervals = tuple((c, (c.per_device, *more)) for c, more in zip(leaders, resampled, strict=True))
    return intervals, whole


def _competing(jobs: Sequence[Job], exclude: Sequence[Job] = ()) -> dict[Key, frozenset[Key]]:
    """The jobs of one search as `evaluate_all`'s `prunable`: each (but `exclude`) competes with all of them."""
    keys = frozenset(job_key(j) for j in jobs)
    skip = {job_key(j) for j in exclude}
    return {k: keys for k in keys if k not in skip}


def _leaders(results: list[SearchResult], top: int) -> list[Candidate]:
    """The `top` best candidates (goodput per device, meeting the SLOs somewhere) of each kind of each search."""
    out: list[Candidate] = []
    for result in results:
        kinds = dict.fromkeys(c.kind for c in result.candidates)
        for kind in kinds:
            ranked = sorted(
                (c for c in result.candidates if c.kind == kind and c.goodput_rps > 0), key=lambda c: -c.per_device
            )
            out.extend(ranked[:top])
    return out
