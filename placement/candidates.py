"""What a search judges and how: the search's inputs (`SearchContext`), one evaluation (`Job`), its outcome
(`Candidate`) and a search's answer (`SearchResult`).

A job is a deployment judged by its goodput (`placement.goodput.max_rate`): a phase alone under its own SLO
and simulator mode (Algorithm 1's probes), or a whole deployment under both SLOs. Jobs are plain picklable
tuples, so `placement.worker_pool` can run them in other processes; `evaluate_job` is that function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Literal

from jaxserve.core.plan import DeploymentPlan, InstanceSpec
from models.config import ModelConfig
from placement.goodput import GoodputSearch, max_rate
from placement.hardware import ClusterSpec
from placement.latency import LatencyProvider
from placement.precision import describe as describe_precisions
from placement.simulator import SimOptions
from placement.slo import SloSpec
from placement.worker_pool import pool_map
from placement.workload import Workload


@dataclasses.dataclass(frozen=True)
class SearchContext:
    """The fixed inputs of a search (picklable)."""

    latency: LatencyProvider
    cluster: ClusterSpec
    workload: Workload
    slo: SloSpec
    options: SimOptions = dataclasses.field(default_factory=SimOptions)
    rel_tol: float = 0.03
    max_pp: int | None = None  # limit pipeline stages per instance (None: as many as devices allow)
    # The weight precisions a search may give an instance (`InstanceSpec.quantization`; None: the checkpoint's
    # own): an operator's choice of what is allowed, so by default plans serve the checkpoint as it is.
    precisions: tuple[str | None, ...] = (None,)

    @property
    def cfg(self) -> ModelConfig:
        return self.latency.cfg


# One evaluation: the context, the candidate's kind, its plan, the SLO and simulator options it is judged
# under, and a rate its goodput is expected near (None: search from the throughput bound).
Job = tuple[SearchContext, str, DeploymentPlan, SloSpec, SimOptions, float | None]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One evaluated configuration."""

    kind: str  # prefill | decode (one phase alone) | disagg | colocated
    plan: DeploymentPlan
    goodput_rps: float
    num_devices: int
    # The SLOs still held at the deployment's throughput bound: a finite trace cannot show the queue
    # that builds there, so the true goodput is at most this (and candidates at the bound tie).
    at_bound: bool = False
    # Not simulated (`evaluate_all` with `prunable`): its throughput bound, which its goodput cannot exceed,
    # was already below what the search needs to beat. `goodput_rps` is then 0 (it is no search's pick).
    pruned_bound_rps: float | None = None

    @property
    def pruned(self) -> bool:
        return self.pruned_bound_rps is not None

    @property
    def per_device(self) -> float:
        return self.goodput_rps / self.num_devices

    @property
    def instance(self) -> InstanceSpec:
        """The instance a phase probe measured (prefill or decode kinds)."""
        return next(i for i in self.plan.instances if i.role == self.kind)

    @property
    def label(self) -> str:
        if self.kind in ("prefill", "decode"):
            q = self.instance.quantization
            return f"{self.kind} {self.instance.shape}" + (f" {q}" if q is not None else "")
        return describe_precisions(self.plan)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The chosen plan, what it is expected to deliver, and every candidate considered."""

    plan: DeploymentPlan
    goodput_rps: float
    candidates: tuple[Candidate, ...]
    reason: str

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.plan.num_devices


# Candidates by (kind, the plan's instances): what `evaluate_all` returns and the searches look up.
Key = tuple[str, tuple[InstanceSpec, ...]]
Evaluated = dict[Key, Candidate]


def job_bound_per_device(job: Job) -> float:
    """The throughput bound of a job's deployment per device (its goodput per device cannot exceed it)."""
    ctx, kind, plan, slo, options, _ = job
    search = GoodputSearch(plan, ctx.latency, ctx.cluster, ctx.workload, slo, options)
    return search.throughput_bound() / job_devices(kind, plan)


def job_devices(kind: str, plan: DeploymentPlan) -> int:
    if kind in ("prefill", "decode"):
        return next(i for i in plan.instances if i.role == kind).num_devices
    return plan.num_devices


def job_key(job: Job) -> Key:
    """What `Evaluated` files a job's candidate under: its kind and its plan's instances."""
    return job[1], job[2].instances


def evaluate_job(job: Job) -> Candidate:
    ctx, kind, plan, slo, options, hint = job
    search = GoodputSearch(plan, ctx.latency, ctx.cluster, ctx.workload, slo, options)
    devices = job_devices(kind, plan)
    rate = max_rate(search, ctx.rel_tol, hint=hint)
    return Candidate(kind, plan, rate, devices, at_bound=rate > 0 and rate >= search.throughput_bound() * (1 - 1e-9))


def make_job(ctx: SearchContext, kind: str, plan: DeploymentPlan, hint: float | None = None) -> Job:
    """How a candidate of `kind` is judged: a phase alone under its own SLO and simulator mode, a whole
    deployment under both SLOs; `hint` starts its goodput search near a rate it is expected at."""
    if kind == "prefill":
        return ctx, kind, plan, dataclasses.replace(ctx.slo, tpot_s=math.inf), _mode(ctx, "prefill"), hint
    if kind == "decode":
        return ctx, kind, plan, dataclasses.replace(ctx.slo, ttft_s=math.inf), _mode(ctx, "decode"), hint
    return ctx, kind, plan, ctx.slo, ctx.options, hint


def plan_job(ctx: SearchContext, plan: DeploymentPlan, hint: float | None = None) -> Job:
    """A whole deployment judged under both SLOs (what `evaluate_all` keys as ("disagg" | "colocated", instances))."""
    return make_job(ctx, plan.kind, plan, hint)


def candidate_job(ctx: SearchContext, cand: Candidate, workload: Workload | None = None) -> Job:
    """The evaluation that produced `cand` (the same SLO and simulator mode), on `workload` if given:
    then its goodput search starts at `cand`'s goodput (another sample lands near it)."""
    if workload is None:
        return make_job(ctx, cand.kind, cand.plan)
    hint = cand.goodput_rps if cand.goodput_rps > 0 else None
    return make_job(dataclasses.replace(ctx, workload=workload), cand.kind, cand.plan, hint)


def _mode(ctx: SearchContext, mode: Literal["prefill", "decode"]) -> SimOptions:
    return dataclasses.replace(ctx.options, mode=mode)


def candidate_samples(
    ctx: SearchContext,
    cands: Sequence[Candidate],
    workloads: Sequence[Workload],
    workers: int = 1,
    plans: Sequence[tuple[DeploymentPlan, float | None]] = (),
) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """Each candidate's goodput per device on each of `workloads` (common random numbers: every
    candidate sees the same samples), evaluated as the search evaluated it (its goodput search starting
    at the candidate's goodput); and each whole deployment of `plans` (under both SLOs, its search
    starting at the rate given with it) on the search's workload and then each of `workloads`.
    One parallel map runs them all."""
    # the whole deployments (the longest jobs) first, as `evaluate_all` orders them
    jobs = [
        plan_job(dataclasses.replace(ctx, workload=w), p, hint) for p, hint in plans for w in (ctx.workload, *workloads)
    ]
    jobs += [candidate_job(ctx, c, w) for c in cands for w in workloads]
    rates = [r.per_device for r in pool_map(evaluate_job, jobs, workers, None)]
    n, m = len(workloads), len(workloads) + 1
    split = len(plans) * m
    by_plan = [tuple(rates[k * m : (k + 1) * m]) for k in range(len(plans))]
    by_cand = [tuple(rates[split + k * n : split + (k + 1) * n]) for k in range(len(cands))]
    return by_cand, by_plan


def best_candidate(cands: Iterable[Candidate]) -> Candidate | None:
    best = None
    for c in cands:  # strict > keeps the first in enumeration order on ties
        if c.goodput_rps > 0 and (best is None or c.per_device > best.per_device * (1 + 1e-9)):
            best = c
    return best
