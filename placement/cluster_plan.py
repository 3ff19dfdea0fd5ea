"""Planning at cluster scale: search a unit of a few nodes by simulation, then replicate it over the cluster.

DistServe's own structure. The search (`placement.planner.choose_plan`: each phase's parallelism, the
prefill:decode ratio, Algorithm 1 or 2, colocated candidates with `kind="auto"`) runs on a *unit* cluster
of `unit_nodes` nodes, at the rates one unit serves; the unit's plan is then copied onto every whole
unit of nodes the cluster has, copy k on nodes k·unit_nodes … (k+1)·unit_nodes − 1 with the unit's own
placement (Algorithm 2's node-local pairs stay node-local). Nodes left over that do not make a whole unit
get the best plan of the same kind a search on just those nodes finds (sharing every simulation the unit
search already ran: `evaluate_all`'s cache), or stay idle when none fits; the report and the plan's
`expected` say which.

Why a unit, and what it costs: a search over the whole cluster simulates every candidate at the cluster's
total rate (instances × requests) and enumerates instance shapes spanning all its nodes, so its time grows
faster than the cluster (2.3 s at 4 × 8, 23.6 s at 16 × 8, no plan after 400 s at 64 × 8 for OPT-175B).
Instances of a replicated plan share nothing but the dispatcher, so the cluster serves at least the units'
sum, and more by what one dispatcher over more instances absorbs. The plan's goodput is therefore the
bounded check's (`bounded_check`): two units simulated together, their goodput per device times the plan's
devices, a cost that does not grow with the cluster (`tests/test_cluster_plan.py` compares it with a
full-cluster simulation at 16 × 8). Instances never span more nodes than a unit holds.

With a target rate, whole units serve ⌊rate / unit goodput⌋ of it and one more search sizes a plan for
what remains within one unit's nodes (again sharing the unit's simulations; a whole unit when nothing
smaller fits). `plan_unit` and `replicated_workload` let the replanner judge a running plan of repeated
units the same way (`placement.replan_decision.estimate`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TypedDict, Unpack

import numpy as np

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError
from placement.candidates import Evaluated, SearchContext
from placement.goodput import GoodputSearch, max_rate
from placement.planner import Affinity, PlanKind, PlanReport, choose_plan, planned_limits
from placement.precision import describe
from placement.search import precision_shapes
from placement.workload import Workload, arrival_times

DEFAULT_UNIT_NODES = 4  # nodes a unit spans: the 4 × 8 search plans in ~3 s on 2 quiet cores
DEFAULT_CHECK_UNITS = 2  # units the bounded check simulates together (`bounded_check`)


@dataclasses.dataclass(frozen=True)
class ClusterPlanReport:
    """The cluster's plan and how it was built from the unit."""

    plan: DeploymentPlan  # the whole cluster's, placed (devices and nodes)
    unit: PlanReport  # the unit's search: its candidates, choice and reasons
    unit_nodes: int  # nodes of one unit (the whole cluster when it is no larger than a unit)
    num_units: int  # whole copies of the unit's plan
    rest: PlanReport | None  # the plan on the nodes left over (or for the rate left over), when one fits
    idle_devices: int  # devices of the cluster no instance uses
    goodput_rps: float  # predicted for the whole plan (the bounded check's per-device goodput when it ran)
    why: str
    replicated_rps: float = 0.0  # the units' and the rest's search goodputs summed (no pooling across units)
    check_units: int = 0  # units simulated together by the bounded check (0: none ran)

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.plan.num_devices

    @property
    def replicated(self) -> bool:
        return self.num_units > 1 or self.rest is not None


def unit_context(ctx: SearchContext, num_nodes: int) -> SearchContext:
    """The search context of `num_nodes` nodes of the same cluster (same devices, links, workload, SLOs)."""
    return dataclasses.replace(ctx, cluster=dataclasses.replace(ctx.cluster, num_nodes=num_nodes))


def shift_plan(plan: DeploymentPlan, node_offset: int, devices_per_node: int) -> tuple[InstanceSpec, ...]:
    """A placed plan's instances moved `node_offset` nodes on (devices with them)."""
    dev_offset = node_offset * devices_per_node
    return tuple(
        dataclasses.replace(
            i,
            devices=tuple(d + dev_offset for d in i.devices) if i.devices is not None else None,
            nodes=tuple(n + node_offset for n in i.nodes) if i.nodes is not None else None,
        )
        for i in plan.instances
    )


class SearchKnobs(TypedDict, total=False):
    """How each search runs: `choose_plan`'s keywords that `plan_cluster` hands on as they are."""

    workers: int
    verify: bool
    compare_colocated: bool
    ratio_devices: int  # the unit's search only
    progress: Callable[[int, int], None] | None
    reseed: Callable[[int], Workload] | None  # the unit's search only (the ranges over seeds)
    seeds: int
    interval_top: int


def plan_cluster(
    ctx: SearchContext,
    *,
    kind: PlanKind = "auto",
    affinity: Affinity = "high",
    rate: float | None = None,
    unit_nodes: int = DEFAULT_UNIT_NODES,
    check_units: int = DEFAULT_CHECK_UNITS,
    **knobs: Unpack[SearchKnobs],
) -> ClusterPlanReport:
    """The deployment for the whole of `ctx.cluster`: the unit's plan replicated (module doc).

    `unit_nodes` >= the cluster's nodes (or 0) searches the whole cluster at once, as `choose_plan` alone
    does. A unit too small for any plan doubles until one fits (at most the whole cluster). With
    `check_units` > 0 a replicated plan's goodput is predicted by the bounded check (`bounded_check`).
    `knobs` go to every search (`choose_plan`)."""
    if unit_nodes < 0:
        raise ValueError("unit_nodes must be >= 0")
    cluster = ctx.cluster
    cache: Evaluated = {}
    # the leftover nodes' and the rate's rest searches: no ratio search, no ranges over seeds
    rest_knobs: SearchKnobs = {**knobs, "ratio_devices": 0, "reseed": None}

    def search(nodes: int, plan_kind: PlanKind, plan_rate: float | None, samples: bool) -> PlanReport:
        return choose_plan(
            unit_context(ctx, nodes),
            kind=plan_kind,
            affinity=affinity,
            rate=plan_rate,
            cache=cache,
            **(knobs if samples else rest_knobs),
        )

    nodes = cluster.num_nodes if unit_nodes == 0 else min(unit_nodes, cluster.num_nodes)
    while True:
        try:
            unit = search(nodes, kind, None if nodes < cluster.num_nodes else rate, samples=True)
            break
        except PlanError:
            # a larger unit helps only a model that fits no instance on this one; an SLO no shape meets is final
            if nodes >= cluster.num_nodes or _fits_unit(ctx, nodes):
                raise
            nodes = min(2 * nodes, cluster.num_nodes)
    if nodes == cluster.num_nodes:  # the cluster is one unit: the search's own plan
        idle = cluster.num_devices - unit.plan.num_devices
        why = f"the cluster is one unit ({nodes} node(s)): {unit.why}"
        return ClusterPlanReport(unit.plan, unit, nodes, 1, None, idle, unit.goodput_rps, why)

    slots = cluster.num_nodes // nodes  # whole units the cluster holds
    g_unit = unit.goodput_rps
    unit_desc = f"{describe(unit.plan)} ({unit.plan.num_devices} devices, {g_unit:.3g} rps)"
    rest: PlanReport | None = None
    if rate is None:
        copies = slots
        left = cluster.num_nodes - copies * nodes
        why = f"{copies} unit(s) of {nodes} node(s), each {unit_desc}"
        if left:
            try:
                rest = search(left, unit.plan.kind, None, samples=False)
                why += f"; the {left} node(s) left over: {describe(rest.plan)} ({rest.goodput_rps:.3g} rps)"
            except PlanError as e:
                why += f"; the {left} node(s) left over stay idle (no {unit.plan.kind} plan fits them: {e})"
    else:
        copies = min(slots, math.floor(rate / g_unit)) if g_unit > 0 else 0
        remaining = rate - copies * g_unit
        why = f"rate {rate:g} rps: {copies} whole unit(s) of {nodes} node(s), each {unit_desc}"
        if remaining > rate * 1e-9:
            if copies >= slots:
                raise PlanError(
                    f"rate {rate:g} rps needs more than the {slots} unit(s) of {nodes} node(s) the cluster holds "
                    f"({g_unit:.3g} rps each)"
                )
            try:
                rest = search(nodes, unit.plan.kind, remaining, samples=False)
                why += f"; the {remaining:.3g} rps left: {describe(rest.plan)} ({rest.goodput_rps:.3g} rps)"
            except PlanError as e:  # nothing smaller fits one unit's nodes: a whole unit carries the rest
                copies += 1
                why += f"; one more whole unit for the {remaining:.3g} rps left (no smaller plan: {e})"
    instances: list[InstanceSpec] = []
    for k in range(copies):
        instances += shift_plan(unit.plan, k * nodes, cluster.devices_per_node)
    if rest is not None:
        instances += shift_plan(rest.plan, copies * nodes, cluster.devices_per_node)
    if not instances:
        raise PlanError(f"no unit of {nodes} node(s) serves any of the rate {rate:g} rps")
    replicated = copies * g_unit + (rest.goodput_rps if rest is not None else 0.0)
    plan = DeploymentPlan(tuple(instances), model=unit.plan.model)
    idle = cluster.num_devices - plan.num_devices
    goodput, checked = replicated, 0
    if check_units > 0 and copies > 1:
        checked = min(copies, check_units)
        per_device = bounded_check(ctx, unit.plan, nodes, checked)
        goodput = per_device * plan.num_devices
        why += (
            f"; {checked} units simulated together serve {per_device:.3g} rps/device "
            f"(the units alone {replicated / plan.num_devices:.3g}: one dispatcher pools their queues)"
        )
    expected = {
        **unit.plan.expected,
        "goodput_rps": goodput,
        "goodput_rps_per_device": goodput / plan.num_devices,
        "search_goodput_rps": replicated,
        "unit_nodes": float(nodes),
        "num_units": float(copies),
        "unit_goodput_rps": g_unit,
        "check_units": float(checked),
        "rest_devices": float(rest.plan.num_devices if rest is not None else 0),
        "idle_devices": float(idle),
    }
    if rate is not None:
        expected["target_rate_rps"] = rate
    plan = dataclasses.replace(plan, expected=expected, limits=planned_limits(plan, ctx))
    why += f"; {idle} of {cluster.num_devices} devices idle"
    return ClusterPlanReport(plan, unit, nodes, copies, rest, idle, goodput, why, replicated, checked)


def bounded_check(ctx: SearchContext, unit: DeploymentPlan, unit_nodes: int, units: int, seed: int = 1) -> float:
    """Goodput per device of `units` copies of the placed `unit` plan simulated as one deployment, each unit's
    share of the requests with the search's lengths (`replicated_workload`): what the units' independence
    leaves out (a dispatcher over more instances absorbs bursts better) is in it. Its cost is `units` units'
    simulation, whatever the cluster's size; the pooling gain it measures is nearly spent by two units
    (OPT-175B on A100s: one unit 0.120, two 0.126, four 0.126 rps/device), so two stand for the cluster."""
    instances = tuple(i for k in range(units) for i in shift_plan(unit, k * unit_nodes, ctx.cluster.devices_per_node))
    plan = DeploymentPlan(instances, model=unit.model)
    slice_ctx = unit_context(ctx, units * unit_nodes)
    workload = replicated_workload(ctx.workload, units, seed)
    search = GoodputSearch(plan, ctx.latency, slice_ctx.cluster, workload, ctx.slo, ctx.options)
    return max_rate(search, ctx.rel_tol) / plan.num_devices


def _fits_unit(ctx: SearchContext, nodes: int) -> bool:
    """Whether a colocated instance or a prefill + decode pair of the model fits on `nodes` nodes."""
    unit = unit_context(ctx, nodes)
    devices = unit.cluster.num_devices
    smallest = min((tp * pp for tp, pp, _ in precision_shapes(unit, "disagg", devices)), default=devices + 1)
    return 2 * smallest <= devices or bool(precision_shapes(unit, "colocated", ctx.cluster.devices_per_node))


def plan_unit(plan: DeploymentPlan, units: int = 1) -> tuple[DeploymentPlan, int]:
    """(part, k): k is the largest count such that the plan is k copies of one set of instances (the same
    count of every role and shape in each); `part` is `units` of those sets — the first units·count/k
    instances of each role and shape in plan order, their placement kept. k = 1 when the plan has no such
    structure (then `part` is the plan)."""
    shapes: dict[tuple[str, str], list[InstanceSpec]] = {}
    for inst in plan.instances:
        shapes.setdefault((inst.role, inst.shape), []).append(inst)
    k = math.gcd(*(len(v) for v in shapes.values()))
    if k <= 1 or units >= k:
        return plan, k
    keep = [i for group in shapes.values() for i in group[: units * len(group) // k]]
    return DeploymentPlan(tuple(keep), model=plan.model, limits=plan.limits), k


def replicated_workload(workload: Workload, copies: int, seed: int) -> Workload:
    """`copies` streams of the workload's requests merged, one per unit: the same lengths in every stream
    (common random numbers with the unit's search), the first with the workload's own arrivals and each other
    with its own draw at the workload's rate; the merged stream runs at `copies` × the rate."""
    rng = np.random.default_rng(seed)
    n = len(workload)
    arrivals = [workload.arrival_at] + [arrival_times(rng, workload.rate, n) for _ in range(copies - 1)]
    at = np.concatenate(arrivals)
    order = np.argsort(at, kind="stable")
    return Workload(
        at[order],
        np.tile(workload.input_lens, copies)[order],
        np.tile(workload.output_lens, copies)[order],
        workload.rate * copies,
    )


def full_cluster_check(ctx: SearchContext, report: ClusterPlanReport, seed: int = 1) -> tuple[float, float]:
    """(predicted, simulated) goodput per device of a replicated plan: the planner's prediction and the goodput
    of one simulation of the whole cluster serving every unit's stream at once (`replicated_workload`), so
    the check sees what the units' independence leaves out (one dispatcher pools their queues). Costs a
    full-cluster goodput search: for clusters where one still finishes (16 × 8 in seconds)."""
    workload = replicated_workload(ctx.workload, report.num_units, seed)
    search = GoodputSearch(report.plan, ctx.latency, ctx.cluster, workload, ctx.slo, ctx.options)
    simulated = max_rate(search, ctx.rel_tol)
    return report.goodput_per_device, simulated / report.plan.num_devices
