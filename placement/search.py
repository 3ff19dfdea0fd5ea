"""Placement search: which tp × pp each phase gets, how many instances, and on which devices.

* `algorithm1` (high node affinity, DistServe Algorithm 1): every feasible (tp, pp) is searched once
  as a prefill-only instance (goodput against the TTFT SLO alone) and once as a decode-only instance
  (against the TPOT SLO alone); the best per-device configuration of each phase is kept and
  replicated: n = ⌈R / goodput_prefill⌉, m = ⌈R / goodput_decode⌉ for a target rate R. Without R the
  cluster is the budget: the (prefill shape, decode shape, n, m) group with the highest
  min(n·g_p, m·g_d) per device, copied as often as it fits.
* `algorithm2` (low node affinity, Algorithm 2): for each stage count pp ≤ nodes, every pair of
  intra-node segments (tp_p, tp_d) with tp_p + tp_d ≤ devices per node is simulated *jointly* (one
  prefill and one decode instance, stage s of both on node s, so KV moves over NVLink) against both
  SLOs; the best per-device pair is replicated. Each pair's goodput search starts at the lesser of its
  two segments' goodputs as phases alone (the same phase jobs Algorithm 1 runs), near which it lands.
* `colocated_search` ("vLLM++"): the best (tp, pp) for a colocated instance.
* `ratio_search` (xPyD): for given prefill and decode shapes, the replica counts x:y that maximise
  joint per-device goodput — the coupling Algorithm 1 ignores.

Candidates are evaluated in worker processes (`placement/worker_pool.py`; what a job and a candidate are:
`placement/candidates.py`); results are collected by candidate index and ties broken by enumeration order,
so the answer depends only on the inputs and the seed, not on scheduling. `evaluate_all` runs the jobs of
several searches in one map (`placement.planner.choose_plan` does); each search then takes its candidates
from that map.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError
from models.config import ModelConfig, supports_tp
from placement.candidates import (
    Candidate,
    Evaluated,
    Job,
    Key,
    SearchContext,
    SearchResult,
    best_candidate,
    candidate_job,
    candidate_samples,
    evaluate_job,
    job_bound_per_device,
    job_devices,
    job_key,
    make_job,
    plan_job,
)
from placement.hardware import ClusterSpec
from placement.latency import DeploymentKind, fits
from placement.precision import shape
from placement.worker_pool import WorkerPool, pool_map

# the names the searches' callers import from here (the candidates' module holds them)
__all__ = [
    "Candidate",
    "Evaluated",
    "Job",
    "Key",
    "SearchContext",
    "SearchResult",
    "candidate_job",
    "candidate_samples",
    "evaluate_job",
    "job_bound_per_device",
    "job_key",
    "plan_job",
]


# ---------------------------------------------------------------------------------------------
# Enumeration
# ---------------------------------------------------------------------------------------------
def tp_degrees(cfg: ModelConfig, max_tp: int) -> list[int]:
    """Tensor-parallel degrees up to `max_tp` that shard the model (`models.config.tp_problems`): query heads
    and MLP split evenly, K/V heads split (tp divides them) or replicated (tp a multiple of them)."""
    return [tp for tp in range(1, max_tp + 1) if supports_tp(cfg, tp)]


def instance_shapes(
    ctx: SearchContext, engine: DeploymentKind, max_devices: int, quantization: str | None = None
) -> list[tuple[int, int]]:
    """Feasible (tp, pp): tp within a node, tp·pp ≤ max_devices, weights (at `quantization`) + one full sequence
    of KV fit."""
    cfg, cluster = ctx.cfg, ctx.cluster
    out = []
    for tp in tp_degrees(cfg, cluster.devices_per_node):
        if not ctx.latency.supports(engine, tp):
            continue
        for pp in range(1, min(cfg.num_layers, max_devices // tp, ctx.max_pp or cfg.num_layers) + 1):
            if fits(cfg, cluster.device, tp, pp, quantization=quantization):
                out.append((tp, pp))
    return out


Shape = tuple[int, int, str | None]  # (tp, pp, quantization) of an instance the search may propose


def precision_shapes(ctx: SearchContext, engine: DeploymentKind, max_devices: int) -> list[Shape]:
    """`instance_shapes` at each of the context's precisions, precision-major (the checkpoint's alone: as before)."""
    return [(tp, pp, q) for q in ctx.precisions for tp, pp in instance_shapes(ctx, engine, max_devices, q)]


def evaluate_all(
    jobs: Sequence[Job],
    workers: int = 2,
    progress: Callable[[int, int], None] | None = None,
    prunable: Mapping[Key, frozenset[Key]] | None = None,
    keep: int = 1,
    cluster: ClusterSpec | None = None,
    cache: Evaluated | None = None,
) -> Evaluated:
    """Evaluate the jobs of several searches in one parallel map (better balanced than one map each, one
    pool); the searches then take their candidates from the result (their `evaluated` argument).

    `prunable` maps jobs that may be skipped to the candidates their search picks among (its keys). A
    search needs the best `keep` candidates of a kind exactly (its pick, and the leaders `choose_plan`
    gives a range over seeds), the others only to know they are not among them. The jobs run in a fixed
    sequence: each kind's `keep` prunable jobs of highest throughput bound per device
    (`GoodputSearch.throughput_bound`: no goodput exceeds it), the jobs that are not prunable, then the
    other prunable ones, each kind's by bound. A prunable job is skipped when its bound is below the
    `keep`-th best goodput per device of its search and kind among the jobs at least `workers` places
    before it in the sequence — and, for a phase alone with `cluster` given (Algorithm 1), below the best
    balanced prefill + decode group among them (`_best_fill`: a group's goodput per device is below each
    member's). Which jobs a decision sees is fixed by the sequence, not by which worker finishes first, so
    for the same inputs and `workers` the same candidates are skipped on every run; a skipped one could
    not have been picked, so the searches choose what they would have chosen without pruning. Skipped
    candidates carry their bound (`Candidate.pruned`).

    `cache`, shared by several calls over the same workload, SLOs and simulator options (the unit searches of
    `placement.cluster_plan`), holds what earlier calls simulated: a job found there is not run again (its
    result also counts as a rival for pruning), and this call's simulated candidates are added to it.
    """
    every = list({job_key(j): j for j in jobs}.values())
    known = {job_key(j): cache[job_key(j)] for j in every if cache is not None and job_key(j) in cache}
    unique = [j for j in every if job_key(j) not in known]
    prunable = prunable or {}
    bounds = {job_key(j): job_bound_per_device(j) for j in unique if job_key(j) in prunable}
    by_kind: dict[str, list[Job]] = {}
    for j in unique:  # each kind's prunable jobs, highest bound first (ties: enumeration order)
        if job_key(j) in bounds:
            by_kind.setdefault(j[1], []).append(j)
    for queue in by_kind.values():
        queue.sort(key=lambda j: -bounds[job_key(j)])
    keep = max(1, keep)
    # Whole deployments first, phases alone last: the long jobs start early and the short ones fill the
    # workers at the end (a long one last would leave the other worker idle while it runs).
    cost = _COST_ORDER.get
    kinds = sorted(by_kind, key=lambda k: cost(k, 0))
    sequence = [j for k in kinds for j in by_kind[k][:keep]]  # never skipped: fewer than `keep` rivals before them
    leading = len(sequence)
    sequence += sorted((j for j in unique if job_key(j) not in bounds), key=lambda j: cost(j[1], 0))
    sequence += [j for k in kinds for j in by_kind[k][keep:]]
    lag = max(1, workers)

    results: dict[int, Candidate] = {}

    def gated(i: int) -> bool:
        return i >= leading and job_key(sequence[i]) in bounds

    def skip(i: int) -> bool:  # sees the jobs at least `lag` places before job i (all yielded by now)
        key = job_key(sequence[i])
        seen = {**known, **{job_key(sequence[n]): results[n] for n in range(i - lag + 1)}}
        return bounds[key] * (1 + 1e-6) < _prune_threshold(sequence[i][1], seen, prunable[key], keep, cluster)

    with WorkerPool(workers) as pool:
        for i, cand in pool.stream(evaluate_job, sequence, skip, gated, lag):
            results[i] = cand if cand is not None else _pruned(sequence[i], bounds[job_key(sequence[i])])
            if progress:
                progress(len(results), len(sequence))
    evaluated = {job_key(sequence[i]): c for i, c in results.items()}
    if cache is not None:  # a pruned candidate was skipped for rivals of this call only: never reuse it
        cache.update((k, c) for k, c in evaluated.items() if not c.pruned)
    evaluated.update(known)
    return {job_key(j): evaluated[job_key(j)] for j in every}


def _pruned(job: Job, bound_per_device: float) -> Candidate:
    devices = job_devices(job[1], job[2])
    return Candidate(job[1], job[2], 0.0, devices, pruned_bound_rps=bound_per_device * devices)


def _prune_threshold(
    kind: str, done: Evaluated, search: frozenset[Key], keep: int, cluster: ClusterSpec | None
) -> float:
    """Goodput per device a `kind` candidate of `search` must be able to reach to matter (0: any may).

    The 1e-6 margin the caller adds keeps the search's near-tie rule (`_best`: within 1e-9 the first in
    enumeration order stays) out of reach of a skipped candidate."""
    rivals = [c for key, c in done.items() if key in search]
    rates = sorted((c.per_device for c in rivals if c.kind == kind and c.goodput_rps > 0), reverse=True)
    if len(rates) < keep:
        return 0.0
    need = rates[keep - 1]
    if kind in ("prefill", "decode"):  # Algorithm 1 without a rate picks a group of both phases
        fill = _best_fill(rivals, cluster) if cluster is not None else None
        need = min(need, fill[0]) if fill is not None else 0.0
    return need


_COST_ORDER = {"colocated": 0, "disagg": 0, "decode": 1, "prefill": 2}


def _evaluate(
    jobs: Sequence[Job], workers: int, progress: Callable[[int, int], None] | None, evaluated: Evaluated | None
) -> tuple[Candidate, ...]:
    if evaluated is not None and all(job_key(j) in evaluated for j in jobs):
        return tuple(evaluated[job_key(j)] for j in jobs)
    return tuple(pool_map(evaluate_job, jobs, workers, progress))


def _phase_plan(ctx: SearchContext, tp: int, pp: int, quantization: str | None = None) -> DeploymentPlan:
    """A one-instance-per-phase plan: the other phase's instance is a placeholder the mode skips."""
    return DeploymentPlan(
        (
            InstanceSpec("prefill", tp, pp, quantization=quantization),
            InstanceSpec("decode", tp, pp, quantization=quantization),
        ),
        model=ctx.cfg.name,
    )


def phase_candidate(
    ctx: SearchContext, evaluated: Evaluated, role: str, tp: int, pp: int, quantization: str | None
) -> Candidate | None:
    """The candidate of one phase alone at (tp, pp, quantization) among `evaluated` (None: not evaluated)."""
    return evaluated.get((role, _phase_plan(ctx, tp, pp, quantization).instances))


def _phase_jobs(ctx: SearchContext, shapes: Iterable[Shape]) -> list[Job]:
    jobs = []
    for tp, pp, q in shapes:
        plan = _phase_plan(ctx, tp, pp, q)
        jobs.append(make_job(ctx, "prefill", plan))
        jobs.append(make_job(ctx, "decode", plan))
    return jobs


# ---------------------------------------------------------------------------------------------
# Algorithm 1
# ---------------------------------------------------------------------------------------------
def algorithm1_jobs(ctx: SearchContext, max_nodes_per_instance: int | None = None) -> list[Job]:
    """Every feasible (tp, pp), once as a prefill-only and once as a decode-only instance."""
    cluster = ctx.cluster
    nodes = max_nodes_per_instance or cluster.num_nodes
    shapes = precision_shapes(ctx, "disagg", nodes * cluster.devices_per_node)
    if not shapes:
        raise PlanError(f"{ctx.cfg.name} does not fit on any tp x pp of {cluster.device.name} within {nodes} node(s)")
    return _phase_jobs(ctx, shapes)


def algorithm1(
    ctx: SearchContext,
    rate: float | None = None,
    max_nodes_per_instance: int | None = None,
    workers: int = 2,
    progress: Callable[[int, int], None] | None = None,
    evaluated: Evaluated | None = None,
) -> SearchResult:
    cluster = ctx.cluster
    cands = _evaluate(algorithm1_jobs(ctx, max_nodes_per_instance), workers, progress, evaluated)
    best_p = best_candidate(c for c in cands if c.kind == "prefill")
    best_d = best_candidate(c for c in cands if c.kind == "decode")
    if best_p is None or best_d is None:
        raise PlanError("no configuration meets the SLOs even at the lowest rate; relax --ttft/--tpot or --attainment")
    if rate is not None:
        p_inst, d_inst = best_p.instance, best_d.instance
        g_p, g_d = best_p.goodput_rps, best_d.goodput_rps
        n, m = math.ceil(rate / g_p), math.ceil(rate / g_d)
        why = f"rate {rate:g} rps needs ceil({rate:g}/{g_p:.3g}) = {n} prefill and ceil({rate:g}/{g_d:.3g}) = {m} decode instances"
    else:
        # No target rate: the cluster is the budget. Pick the prefill/decode shapes and counts that
        # fit it with the highest balanced per-device goodput (no simulation, just the phase results).
        chosen = _best_fill(cands, cluster)
        if chosen is None:
            raise PlanError(
                f"no prefill + decode instance pair of {ctx.cfg.name} fits in {cluster.num_devices} devices"
            )
        _, _, cp, cd, n, m = chosen
        p_inst, d_inst, g_p, g_d = cp.instance, cd.instance, cp.goodput_rps, cd.goodput_rps
        group = n * p_inst.num_devices + m * d_inst.num_devices
        copies = max(
            k for k in range(1, cluster.num_devices // group + 1) if _placeable(p_inst, k * n, d_inst, k * m, cluster)
        )
        why = (
            f"{n} prefill + {m} decode instances ({group} devices) balance the phases best per device; "
            f"{copies} cop{'y' if copies == 1 else 'ies'} of that group fit on {cluster.num_nodes} x "
            f"{cluster.devices_per_node} devices"
        )
        n, m = n * copies, m * copies
    plan = DeploymentPlan(tuple([p_inst] * n + [d_inst] * m), model=ctx.cfg.name)
    goodput = min(n * g_p, m * g_d)
    reason = (
        f"best prefill {shape(p_inst)} ({g_p / p_inst.num_devices:.3g} rps/device under TTFT), best decode "
        f"{shape(d_inst)} ({g_d / d_inst.num_devices:.3g} rps/device under TPOT); {why}"
    )
    return SearchResult(plan, goodput, cands, reason)


def _best_fill(
    cands: Iterable[Candidate], cluster: ClusterSpec
) -> tuple[float, int, Candidate, Candidate, int, int] | None:
    """(score, order, prefill, decode, n, m): the placeable group of n prefill + m decode instances with the
    highest balanced goodput per device, min(n·g_p, m·g_d) / devices; None when no group fits."""
    cands = list(cands)
    fills: list[tuple[float, int, Candidate, Candidate, int, int]] = []
    order = 0
    for cp in (c for c in cands if c.kind == "prefill" and c.goodput_rps > 0):
        for cd in (c for c in cands if c.kind == "decode" and c.goodput_rps > 0):
            for n, m, score in _fill_options(
                cp.goodput_rps, cp.num_devices, cd.goodput_rps, cd.num_devices, cluster.num_devices
            ):
                fills.append((score, order, cp, cd, n, m))
                order += 1
    # Best balanced per-device goodput first; ties keep enumeration order. Each stage's tp group must
    # fit inside one node, so the first group `assign_nodes` can put on the cluster wins.
    fills.sort(key=lambda f: (-f[0], f[1]))
    return next((f for f in fills if _placeable(f[2].instance, f[4], f[3].instance, f[5], cluster)), None)


def _fill_options(g_p: float, dev_p: int, g_d: float, dev_d: int, total: int) -> list[tuple[int, int, float]]:
    """Counts n, m ≥ 1 with n·dev_p + m·dev_d ≤ total and their per-device goodput min(n·g_p, m·g_d) / devices.

    Only counts where neither phase has an idle spare instance: n ≤ ceil(m·g_d / g_p) and vice versa.
    """
    out = []
    for n in range(1, total // dev_p + 1):
        for m in range(1, (total - n * dev_p) // dev_d + 1):
            if (n - 1) * g_p >= m * g_d or (m - 1) * g_d >= n * g_p:
                continue  # one instance fewer of a phase would serve as much
            out.append((n, m, min(n * g_p, m * g_d) / (n * dev_p + m * dev_d)))
    return out


def _fill_counts(g_p: float, dev_p: int, g_d: float, dev_d: int, total: int) -> tuple[int, int, float] | None:
    """The counts of `_fill_options` with the highest per-device goodput (the first of near-ties)."""
    best: tuple[int, int, float] | None = None
    for n, m, score in _fill_options(g_p, dev_p, g_d, dev_d, total):
        if best is None or score > best[2] * (1 + 1e-9):
            best = (n, m, score)
    return best


def _placeable(p_inst: InstanceSpec, n: int, d_inst: InstanceSpec, m: int, cluster: ClusterSpec) -> bool:
    try:
        assign_nodes(DeploymentPlan(tuple([p_inst] * n + [d_inst] * m)), cluster)
    except PlanError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Algorithm 2
# ---------------------------------------------------------------------------------------------
def _algorithm2_pairs(ctx: SearchContext) -> list[DeploymentPlan]:
    """Every node-local pair of prefill and decode segments (tp_p + tp_d within a node) for each pp."""
    cluster = ctx.cluster
    m_per_node = cluster.devices_per_node
    pairs = []
    for pp in range(1, min(cluster.num_nodes, ctx.cfg.num_layers, ctx.max_pp or cluster.num_nodes) + 1):
        segments = [  # (tp, precision), precision-major (the checkpoint's alone: as before)
            (tp, q)
            for q in ctx.precisions
            for tp in tp_degrees(ctx.cfg, m_per_node)
            if ctx.latency.supports("disagg", tp) and fits(ctx.cfg, cluster.device, tp, pp, quantization=q)
        ]
        for tp_p, q_p in segments:
            for tp_d, q_d in segments:
                if tp_p + tp_d > m_per_node:
                    continue
                nodes = tuple(range(pp))  # stage s of both instances on node s
                pairs.append(
                    DeploymentPlan(
                        (
                            InstanceSpec("prefill", tp_p, pp, nodes=nodes, quantization=q_p),
                            InstanceSpec("decode", tp_d, pp, nodes=nodes, quantization=q_d),
                        ),
                        model=ctx.cfg.name,
                    )
                )
    if not pairs:
        raise PlanError(f"no prefill + decode segment pair of {ctx.cfg.name} fits on one {cluster.device.name} node")
    return pairs


def algorithm2_phase_jobs(ctx: SearchContext) -> list[Job]:
    """Each segment shape of Algorithm 2's pairs judged as one phase alone (the jobs Algorithm 1 runs for
    those shapes): the lesser of a pair's two phase goodputs is where its joint search starts."""
    order = {q: n for n, q in enumerate(ctx.precisions)}
    shapes = {(i.tp, i.pp, i.quantization) for pair in _algorithm2_pairs(ctx) for i in pair.instances}
    return _phase_jobs(ctx, sorted(shapes, key=lambda s: (order[s[2]], s[0], s[1])))


def algorithm2_jobs(ctx: SearchContext, phases: Evaluated) -> list[Job]:
    """Every pair of `_algorithm2_pairs`, judged jointly; its search starts at the lesser of its phases'
    goodputs alone (`phases`: the results of `algorithm2_phase_jobs`; a pair is rarely more than ~10 %
    below it, so about four probes instead of seven). No hint when a phase alone meets nothing."""
    jobs = []
    for pair in _algorithm2_pairs(ctx):
        p, d = pair.instances
        alone = [
            phases[("prefill", _phase_plan(ctx, p.tp, p.pp, p.quantization).instances)],
            phases[("decode", _phase_plan(ctx, d.tp, d.pp, d.quantization).instances)],
        ]
        hint = min(c.goodput_rps for c in alone)
        jobs.append(make_job(ctx, "disagg", pair, hint if hint > 0 else None))
    return jobs


def algorithm2(
    ctx: SearchContext,
    rate: float | None = None,
    workers: int = 2,
    progress: Callable[[int, int], None] | None = None,
    evaluated: Evaluated | None = None,
) -> SearchResult:
    cluster = ctx.cluster
    m_per_node = cluster.devices_per_node
    phase_jobs = algorithm2_phase_jobs(ctx)
    phases = evaluated if evaluated is not None else {}
    if any(job_key(j) not in phases for j in phase_jobs):
        phases = evaluate_all(phase_jobs, workers, progress)
    cands = _evaluate(algorithm2_jobs(ctx, phases), workers, progress, evaluated)
    best = best_candidate(cands)
    if best is None:
        raise PlanError("no configuration meets the SLOs even at the lowest rate; relax --ttft/--tpot or --attainment")
    pp = best.plan.instances[0].pp
    p_tp, d_tp = best.plan.instances[0].tp, best.plan.instances[1].tp
    replicas_fit = (cluster.num_nodes // pp) * (m_per_node // (p_tp + d_tp))  # pairs per node x node groups
    if rate is not None:
        replicas = math.ceil(rate / best.goodput_rps)
        why = f"rate {rate:g} rps needs ceil({rate:g}/{best.goodput_rps:.3g}) = {replicas} replicas of the pair"
    else:
        replicas = max(1, replicas_fit)
        why = f"{replicas} replica(s) of the pair fit on {cluster.num_nodes} node(s) of {m_per_node} devices"
    p_inst, d_inst = (dataclasses.replace(i, nodes=None) for i in best.plan.instances)
    plan = DeploymentPlan(tuple([p_inst, d_inst] * replicas), model=ctx.cfg.name)
    reason = (
        f"best node-local pair prefill {shape(p_inst)} + decode {shape(d_inst)} (per stage on one node): "
        f"{best.per_device:.3g} rps/device jointly; {why}"
    )
    return SearchResult(plan, best.goodput_rps * replicas, cands, reason)


# ---------------------------------------------------------------------------------------------
# Colocated ("vLLM++") and the xPyD ratio
# ---------------------------------------------------------------------------------------------
def colocated_jobs(ctx: SearchContext, max_devices: int | None = None, chunk_size: int | None = None) -> list[Job]:
    """Every feasible colocated (tp, pp) within `max_devices` (default: one node)."""
    limit = max_devices or ctx.cluster.devices_per_node
    jobs = [
        make_job(
            ctx,
            "colocated",
            DeploymentPlan(
                (InstanceSpec("colocated", tp, pp, chunk_size=chunk_size, quantization=q),), model=ctx.cfg.name
            ),
        )
        for tp, pp, q in precision_shapes(ctx, "colocated", limit)
    ]
    if not jobs:
        raise PlanError(f"{ctx.cfg.name} fits no colocated tp x pp within {limit} devices")
    return jobs


def colocated_search(
    ctx: SearchContext,
    max_devices: int | None = None,
    chunk_size: int | None = None,
    workers: int = 2,
    progress: Callable[[int, int], None] | None = None,
    evaluated: Evaluated | None = None,
) -> SearchResult:
    cands = _evaluate(colocated_jobs(ctx, max_devices, chunk_size), workers, progress, evaluated)
    best = best_candidate(cands)
    if best is None:
        raise PlanError("no colocated configuration meets the SLOs even at the lowest rate")
    return SearchResult(
        best.plan, best.goodput_rps, cands, f"best colocated shape {best.label}: {best.per_device:.3g} rps/device"
    )


def replicate_colocated(ctx: SearchContext, best: SearchResult, rate: float | None = None) -> SearchResult:
    """The colocated shape of `colocated_search`, replicated for `rate` or to fill the cluster."""
    inst = best.plan.instances[0]
    g = best.goodput_rps
    if rate is not None:
        n = max(1, math.ceil(rate / g))
        why = f"rate {rate:g} rps needs ceil({rate:g}/{g:.3g}) = {n} colocated {shape(inst)} instance(s)"
    else:
        # Each stage's tp group stays inside one node (`assign_nodes`): count the tp groups the nodes hold.
        groups = ctx.cluster.num_nodes * (ctx.cluster.devices_per_node // inst.tp)
        n = groups // inst.pp
        why = f"{n} colocated {shape(inst)} instance(s) fit on {ctx.cluster.num_nodes} x {ctx.cluster.devices_per_node} devices"
    if n < 1:
        raise PlanError(
            f"colocated {inst.shape} needs {inst.num_devices} devices; the cluster has {ctx.cluster.num_devices}"
        )
    plan = DeploymentPlan(tuple([inst] * n), model=ctx.cfg.name)
    return SearchResult(
        plan, g * n, best.candidates, f"best colocated {shape(inst)} ({g / inst.num_devices:.3g} rps/device); {why}"
    )


def choose_deployment(
    disagg: SearchResult | None, disagg_per_device: float, colocated: SearchResult | None
) -> tuple[str, str]:
    """("disagg" | "colocated", why): the kind whose best plan serves more goodput per device.

    `disagg_per_device` is the disaggregated plan's per-device goodput as the caller best knows it
    (the joint simulation of the chosen plan when there is one: Algorithm 1 judges phases alone).
    A tie goes to the colocated plan: fewer moving parts for the same goodput.
    """
    if colocated is None and disagg is None:
        raise PlanError("nothing to choose from")
    if colocated is None:
        return "disagg", "no colocated plan to compare with"
    coloc = colocated.goodput_per_device
    if disagg is None:
        return "colocated", "no disaggregated plan to compare with"
    if coloc >= disagg_per_device:
        return "colocated", (
            f"colocated {coloc:.3g} rps/device >= disaggregated {disagg_per_device:.3g} rps/device: "
            "on these devices splitting the phases does not pay for the devices it takes"
        )
    return "disagg", (
        f"disaggregated {disagg_per_device:.3g} rps/device > colocated {coloc:.3g} rps/device "
        f"({disagg_per_device / coloc if coloc > 0 else float('inf'):.2f}x)"
    )


def ratio_search(
    ctx: SearchContext,
    prefill: InstanceSpec,
    decode: InstanceSpec,
    max_devices: int,
    workers: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> SearchResult:
    """Joint goodput of x prefill + y decode instances for every x, y with x·|P| + y·|D| ≤ max_devices."""
    jobs = []
    for x in range(1, max_devices // prefill.num_devices + 1):
        for y in range(1, (max_devices - x * prefill.num_devices) // decode.num_devices + 1):
            plan = DeploymentPlan(tuple([prefill] * x + [decode] * y), model=ctx.cfg.name)
            jobs.append(make_job(ctx, "disagg", plan))
    if not jobs:
        raise PlanError(f"{prefill.shape} + {decode.shape} need more than {max_devices} devices")
    cands = tuple(pool_map(evaluate_job, jobs, workers, progress))
    best = best_candidate(cands)
    if best is None:
        raise PlanError("no prefill:decode ratio meets the SLOs even at the lowest rate")
    x = len(best.plan.of_role("prefill"))
    y = len(best.plan.of_role("decode"))
    return SearchResult(
        best.plan, best.goodput_rps, cands, f"{x}P{y}D is the best ratio: {best.per_device:.3g} rps/device"
    )


# ---------------------------------------------------------------------------------------------
# Device placement
# ---------------------------------------------------------------------------------------------
def assign_nodes(plan: DeploymentPlan, cluster: ClusterSpec, pair_stages: bool = False) -> DeploymentPlan:
    """Give every instance devices and per-stage nodes on the cluster.

    Each stage's tp group stays inside one node. With `pair_stages` (Algorithm 2) the plan is a list
    of (prefill, decode) pairs of equal pp and stage s of both goes on the same node.
    """
    free = {
        n: list(range(n * cluster.devices_per_node, (n + 1) * cluster.devices_per_node))
        for n in range(cluster.num_nodes)
    }

    def take(num: int, prefer: int | None = None) -> tuple[int, list[int]]:
        order = ([prefer] if prefer is not None else []) + [n for n in free if n != prefer]
        for node in order:
            if len(free[node]) >= num:
                got, free[node] = free[node][:num], free[node][num:]
                return node, got
        raise PlanError(
            f"plan {plan.describe()} does not fit on {cluster.num_nodes} x {cluster.devices_per_node} {cluster.device.name}"
        )

    placed: list[InstanceSpec] = []
    if pair_stages:
        insts = list(plan.instances)
        for a in range(0, len(insts), 2):
            p, d = insts[a], insts[a + 1]
            p_dev: list[int] = []
            d_dev: list[int] = []
            nodes: list[int] = []
            for _ in range(p.pp):
                node = next((n for n in free if len(free[n]) >= p.tp + d.tp and n not in nodes), None)
                if node is None:
                    raise PlanError(f"plan {plan.describe()} does not fit node-locally on {cluster.num_nodes} node(s)")
                p_dev += take(p.tp, node)[1]
                d_dev += take(d.tp, node)[1]
                nodes.append(node)
            placed += [
                dataclasses.replace(p, devices=tuple(p_dev), nodes=tuple(nodes)),
                dataclasses.replace(d, devices=tuple(d_dev), nodes=tuple(nodes)),
            ]
    else:
        for inst in plan.instances:
            devs: list[int] = []
            nodes = []
            prev: int | None = None
            for _ in range(inst.pp):
                node, got = take(inst.tp, prev)
                devs += got
                nodes.append(node)
                prev = node
            placed.append(dataclasses.replace(inst, devices=tuple(devs), nodes=tuple(nodes)))
    return dataclasses.replace(plan, instances=tuple(placed))
