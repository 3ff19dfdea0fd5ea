"""Choosing the deployment: the planner as one library call (`jaxserve plan`, tests and replanning use it).

`choose_plan(ctx, ...)` runs the searches a plan needs — Algorithm 1 (high node affinity) or 2 (low) for the
disaggregated kind, the colocated search, with `kind="auto"` both and the better goodput per device — verifies
an Algorithm-1 plan by a joint simulation (the per-phase searches judge each phase alone; with several allowed
precisions, also at the precisions near each phase's own: `precision_variants`), optionally searches
the prefill:decode ratio, and returns the placed `DeploymentPlan` (model, expected metrics and the serving
limits it was planned with filled in) with a `PlanReport` of how it was chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import DeploymentPlan, PlanError, Role
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
    phase_candidate,
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
    simulated candidates between calls on the same workload, SLOs and options (`evaluate_all`).

    Four steps: the searches generate and evaluate their candidates and each picks its best (`_search`), the
    kinds are compared and the winner replicated (`_select`), the plan gets what it was planned with
    (`_finish`), and with `reseed` the choice is re-simulated on more workload samples (`_resample_choice`)."""
    if rate is not None and rate <= 0:
        raise ValueError("rate must be positive")
    how = _How(kind, affinity, rate, workers, verify, compare_colocated, progress, interval_top, prune, cache)
    searched = _search(ctx, how)
    chosen = _select(ctx, searched, how, ratio_devices)
    plan = _finish(ctx, searched, chosen, how)
    if chosen.kind == "disagg":
        runner_up, runner_rps = _colocated_runner_up(ctx, searched.colocated, rate)
    else:
        runner_up, runner_rps = searched.disagg_plan, searched.disagg_rps
    chosen_samples: tuple[float, ...] = ()
    runner_samples: tuple[float, ...] = ()
    intervals: tuple[tuple[Candidate, tuple[float, ...]], ...] = ()
    if reseed is not None and seeds > 0:
        intervals, chosen_samples, runner_samples = _resample_choice(
            ctx, searched, (plan, chosen.goodput_rps), (runner_up, runner_rps), reseed, seeds, how
        )
    return PlanReport(
        plan=plan,
        result=chosen.result,
        goodput_rps=chosen.goodput_rps,
        why=chosen.why,
        disagg=searched.disagg,
        colocated=searched.colocated,
        joint_rps=searched.joint,
        disagg_per_device=searched.disagg_pd,
        ratio=chosen.ratio,
        failures=tuple(searched.failures),
        chosen_samples=chosen_samples,
        runner_up=runner_up,
        runner_up_samples=runner_samples,
        candidate_intervals=intervals,
    )


@dataclasses.dataclass(frozen=True)
class _How:
    """`choose_plan`'s options, as its steps read them."""

    kind: PlanKind
    affinity: Affinity
    rate: float | None
    workers: int
    verify: bool
    compare_colocated: bool
    progress: Callable[[int, int], None] | None
    interval_top: int  # the leaders per search and kind given a range over seeds
    prune: bool
    cache: Evaluated | None

    @property
    def keep(self) -> int:
        """The leaders per search and kind that must be simulated (`evaluate_all`'s `keep`)."""
        return max(1, self.interval_top)

    @property
    def disagg_high(self) -> bool:
        """Algorithm 1 runs (and, with `verify`, its plan is checked jointly and against Algorithm 2's)."""
        return self.kind != "colocated" and self.affinity == "high"

    @property
    def local_search(self) -> bool:
        """Algorithm 2 runs: low affinity, or high affinity's check against the node-local placements."""
        return self.kind != "colocated" and (self.affinity == "low" or self.verify)

    @property
    def colocated_search(self) -> bool:
        return self.kind != "disagg" or self.compare_colocated


@dataclasses.dataclass
class _Searched:
    """What the searches found, before the kinds are compared: each kind's best and the disaggregated plan placed."""

    evaluated: Evaluated
    disagg: SearchResult | None = None
    disagg_plan: DeploymentPlan | None = None
    colocated: SearchResult | None = None
    joint: float | None = None  # the joint simulation of the disaggregated plan (verified Algorithm 1)
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def disagg_rps(self) -> float:
        return self.joint if self.joint is not None else (self.disagg.goodput_rps if self.disagg else 0.0)

    @property
    def disagg_pd(self) -> float:
        return self.disagg_rps / self.disagg_plan.num_devices if self.disagg_plan is not None else 0.0


@dataclasses.dataclass(frozen=True)
class _Chosen:
    kind: str  # "disagg" | "colocated"
    why: str
    result: SearchResult  # the search whose plan was chosen (a colocated one replicated)
    plan: DeploymentPlan  # placed
    goodput_rps: float
    ratio: SearchResult | None = None


def _search(ctx: SearchContext, how: _How) -> _Searched:
    """Candidate generation and evaluation, in two parallel maps — first every phase alone and every colocated
    shape; then what starts from those results (Algorithm 2's pairs, from their phases) or needs them (the joint
    check of Algorithm 1's plan) — and each search's pick from them.

    A search needs its best few candidates exactly (its pick, the leaders given a range over seeds); the others
    may be skipped once their throughput bound shows they cannot be among them (`evaluate_all`)."""
    first, prunable = _first_jobs(ctx, how.kind, how.affinity, how.local_search, how.compare_colocated)
    evaluated = evaluate_all(
        first, how.workers, how.progress, prunable if how.prune else None, how.keep, ctx.cluster, how.cache
    )
    found = _Searched(evaluated)
    if how.disagg_high:
        found.disagg = _attempt(
            how,
            found.failures,
            lambda: algorithm1(ctx, how.rate, workers=how.workers, progress=how.progress, evaluated=evaluated),
        )
    if found.disagg is not None:
        found.disagg_plan = assign_nodes(found.disagg.plan, ctx.cluster, pair_stages=False)
    second, prunable = _second_jobs(ctx, evaluated, found.disagg_plan, how)
    evaluated.update(
        evaluate_all(second, how.workers, how.progress, prunable if how.prune else None, how.keep, cache=how.cache)
    )
    if how.kind != "colocated" and how.affinity == "low":

        def low() -> None:
            found.disagg = algorithm2(ctx, how.rate, workers=how.workers, progress=how.progress, evaluated=evaluated)
            found.disagg_plan = assign_nodes(found.disagg.plan, ctx.cluster, pair_stages=True)

        _attempt(how, found.failures, low)
    if how.colocated_search:
        try:
            found.colocated = colocated_search(ctx, workers=how.workers, progress=how.progress, evaluated=evaluated)
        except PlanError as e:
            if how.kind == "colocated" or found.disagg is None:
                raise PlanError("; ".join([*found.failures, f"colocated: {e}"])) from None
            found.failures.append(f"colocated: {e}")
    if found.disagg_plan is not None and how.disagg_high and how.verify:
        found.joint = evaluated[("disagg", found.disagg_plan.instances)].goodput_rps
        _best_joint_precisions(ctx, found)
    return found


# Algorithm 1 gives each phase the precision that serves most alone; at the chosen shapes, the precisions within
# this share of it are also simulated jointly (prefill bursts make decode batches larger than a decode instance
# alone sees, and larger batches favour a faster matmul over fewer bytes: the best pair alone is not always the
# best pair together).
JOINT_PRECISION_MARGIN = 0.10


def precision_variants(ctx: SearchContext, plan: DeploymentPlan, evaluated: Evaluated) -> list[DeploymentPlan]:
    """`plan` (Algorithm 1's: one shape per role) with each role's precision replaced by those whose phase alone
    at that shape serves within `JOINT_PRECISION_MARGIN` of the plan's own; the plan itself first."""
    choices: dict[str, list[str | None]] = {}
    roles: tuple[Role, ...] = ("prefill", "decode")
    for role in roles:
        inst = plan.of_role(role)[0]
        own = phase_candidate(ctx, evaluated, role, inst.tp, inst.pp, inst.quantization)
        floor = (1 - JOINT_PRECISION_MARGIN) * own.goodput_rps if own is not None else float("inf")
        near = [inst.quantization]
        for q in ctx.precisions:
            cand = phase_candidate(ctx, evaluated, role, inst.tp, inst.pp, q)
            if q != inst.quantization and cand is not None and cand.goodput_rps > 0 and cand.goodput_rps >= floor:
                near.append(q)
        choices[role] = near
    return [
        dataclasses.replace(
            plan,
            instances=tuple(
                dataclasses.replace(i, quantization=q_p if i.role == "prefill" else q_d) for i in plan.instances
            ),
        )
        for q_p in choices["prefill"]
        for q_d in choices["decode"]
    ]


def _best_joint_precisions(ctx: SearchContext, found: _Searched) -> None:
    """Take the precision pair of `precision_variants` that serves most jointly (ties keep Algorithm 1's)."""
    assert found.disagg is not None and found.disagg_plan is not None and found.joint is not None
    best, best_rps = found.disagg_plan, found.joint
    for variant in precision_variants(ctx, found.disagg_plan, found.evaluated)[1:]:
        rps = found.evaluated[("disagg", variant.instances)].goodput_rps
        if rps > best_rps * (1 + 1e-9):
            best, best_rps = variant, rps
    if best is found.disagg_plan:
        return
    before = describe(found.disagg_plan)
    q = {i.role: i.quantization for i in best.instances}
    unplaced = dataclasses.replace(
        found.disagg.plan,
        instances=tuple(dataclasses.replace(i, quantization=q[i.role]) for i in found.disagg.plan.instances),
    )
    reason = (
        f"{found.disagg.reason}; jointly {describe(best)} serves {best_rps:.3g} rps against "
        f"{found.joint:.3g} for {before} (the phases' precisions alone)"
    )
    found.disagg = dataclasses.replace(found.disagg, plan=unplaced, reason=reason)
    found.disagg_plan, found.joint = best, best_rps


_T = TypeVar("_T")


def _attempt(how: _How, failures: list[str], search: Callable[[], _T]) -> _T | None:
    """A disaggregated search's result; with kind auto a PlanError is noted in `failures` (the colocated kind
    may still win) instead of raised."""
    try:
        return search()
    except PlanError as e:
        if how.kind == "disagg":
            raise
        failures.append(f"disaggregated: {e}")
        return None


def _second_jobs(
    ctx: SearchContext, evaluated: Evaluated, disagg_plan: DeploymentPlan | None, how: _How
) -> tuple[list[Job], dict[Key, frozenset[Key]]]:
    """The second map's jobs — Algorithm 2's pairs (from their phases' results) and the joint check of Algorithm
    1's plan — and which of them may be pruned (the pairs, among themselves)."""
    second: list[Job] = []
    prunable: dict[Key, frozenset[Key]] = {}
    if how.local_search:
        with contextlib.suppress(PlanError, KeyError):  # KeyError: no phase results (no pairs fit)
            pairs = algorithm2_jobs(ctx, evaluated)
            second += pairs
            prunable = _competing(pairs)
    if disagg_plan is not None and how.disagg_high and how.verify:
        # Algorithm 1 judged each phase alone; check the whole deployment against both SLOs (at the precisions
        # near its phases' own too): the longest jobs of the map (cold searches), first
        second[:0] = [plan_job(ctx, p) for p in precision_variants(ctx, disagg_plan, evaluated)]
    return second, prunable


def _select(ctx: SearchContext, found: _Searched, how: _How, ratio_devices: int) -> _Chosen:
    """Selection: Algorithm 2's node-local placement where it beats Algorithm 1's verified plan, then the kind with
    more goodput per device, its plan replicated and placed (and the xPyD ratio of a disaggregated one)."""
    if how.disagg_high and how.verify:
        better = _node_local_beats(
            ctx, how.rate, how.workers, how.progress, found.evaluated, found.disagg_plan, found.disagg_pd
        )
        if better is not None:
            found.disagg, found.disagg_plan = better
            found.joint = found.disagg.goodput_rps
            found.failures = [f for f in found.failures if not f.startswith("disaggregated")]
    disagg, colocated = found.disagg, found.colocated
    kind, why = choose_deployment(disagg, found.disagg_pd, colocated if how.kind != "disagg" else None)
    if kind == "colocated":
        assert colocated is not None
        result = replicate_colocated(ctx, colocated, how.rate)
        return _Chosen(kind, why, result, assign_nodes(result.plan, ctx.cluster), result.goodput_rps)
    assert disagg is not None and found.disagg_plan is not None
    ratio = None
    if ratio_devices:
        shapes = (disagg.plan.of_role("prefill")[0], disagg.plan.of_role("decode")[0])
        ratio = ratio_search(ctx, *shapes, max_devices=ratio_devices, workers=how.workers, progress=how.progress)
    return _Chosen(kind, why, disagg, found.disagg_plan, found.disagg_rps, ratio)


def _finish(ctx: SearchContext, found: _Searched, chosen: _Chosen, how: _How) -> DeploymentPlan:
    """The chosen plan with its model, what it is expected to deliver and the limits it was planned with."""
    plan, goodput_rps = chosen.plan, chosen.goodput_rps
    expected = {
        "goodput_rps": goodput_rps,
        "goodput_rps_per_device": goodput_rps / plan.num_devices,
        "search_goodput_rps": chosen.result.goodput_rps,
        "ttft_slo_s": ctx.slo.ttft_s,
        "tpot_slo_s": ctx.slo.tpot_s,
        "attainment": ctx.slo.attainment,
    }
    if found.disagg is not None and found.colocated is not None and how.kind == "auto":
        expected["disagg_goodput_rps_per_device"] = found.disagg_pd
        expected["colocated_goodput_rps_per_device"] = found.colocated.goodput_per_device
    if how.rate is not None:
        expected["target_rate_rps"] = how.rate
    return dataclasses.replace(plan, model=ctx.latency.cfg.name, expected=expected, limits=planned_limits(plan, ctx))


def _resample_choice(
    ctx: SearchContext,
    found: _Searched,
    chosen: tuple[DeploymentPlan, float],
    runner_up: tuple[DeploymentPlan | None, float],
    reseed: Callable[[int], Workload],
    seeds: int,
    how: _How,
) -> tuple[tuple[tuple[Candidate, tuple[float, ...]], ...], tuple[float, ...], tuple[float, ...]]:
    """Reporting how sure the choice is: the leading candidates of each search and (with a runner-up) the chosen
    plan and the runner-up, re-simulated on `seeds` more workload samples."""
    leaders = _leaders([r for r in (found.disagg, found.colocated) if r is not None], how.interval_top)
    # with a runner-up, the chosen plan and it are re-simulated whole, on the search's workload too
    other, other_rps = runner_up
    pair: tuple[tuple[DeploymentPlan, float | None], ...] = (chosen, (other, other_rps)) if other is not None else ()
    intervals, whole = _resampled(ctx, leaders, pair, [reseed(1000 + i) for i in range(seeds)], how.workers)
    if whole:
        return intervals, whole[0], whole[1]
    return intervals, (), ()


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
