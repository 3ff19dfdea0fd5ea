"""Replanning: search a plan for the workload the monitor sees, and decide whether switching to it pays.

Three parts, one role each:

* Inputs of a search, from a monitor window (`jaxserve/core/workload_monitor.py`): `empirical_workload`
  draws prompt and output lengths from the window's histograms (independently: the histograms do not
  keep the pairing), and `CorrectedLatency` multiplies the latency model's prefill and decode step
  times by the factors the window observed (Σ observed / Σ predicted step time per role, the
  prediction of each recorded step from `predicted_step_s`). The sample holds
  `ReplanConfig.sample_size(required rate)` requests: at least `probe_s` seconds of traffic at the
  rate the plan must carry, since a shorter probe overrates goodput near saturation.
* `plan_for_rate`, the one adapter to the planner: `placement.planner.choose_plan` for a target
  rate, the call `jaxserve plan --rate R --kind K` makes, so the replanner and `jaxserve plan` choose
  the same deployment for the same workload; its goodput is the planner's (the joint simulation of a
  verified Algorithm-1 plan). A live switch keeps the deployment's kind, so a round plans for the
  current plan's kind.
* `decide(current, candidate, required_rps, config)`, pure: compare the two plans by the goodput per
  device they would *deliver* on the required rate, min(goodput, rate) / devices, and switch only when
  the candidate's gain exceeds `min_gain` plus the switch cost spread over the horizon the new plan is
  expected to serve: (devices of added instances × weights-load time + devices of retired instances ×
  drain time) / (current devices × horizon); instances of the same role and shape in both plans are
  kept (`plan_delta`). A current plan that no longer covers the rate is replaced by a candidate that does
  whatever the cost; a candidate that does not cover it while the current one does is never taken.
  Every decision carries its reasons.

`replan(job)` runs a whole round (search, both estimates, decision) as one picklable function, and
`BackgroundReplanner` runs it in a worker process so the search never stalls a serving loop. The
goodput of the plan a round leaves serving (`ReplanDecision.serving_goodput_rps`) goes back to the
shift detector (`ShiftDetector.set_capacity`): a load that eats its headroom (the rate weighed by
how much heavier the window's requests are than the round's: `ShiftDetector.load_factor`) fires the
next round through the cool-down. The runtime loop (`jaxserve/tools/replan_loop.py`) and the simulated one
(`placement/replan_experiment.py`) both do exactly this.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import sys
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from jaxserve.core.plan import DeploymentPlan, PlanError
from jaxserve.core.workload_monitor import WindowStats
from placement.cluster_plan import (
    DEFAULT_CHECK_UNITS,
    DEFAULT_UNIT_NODES,
    plan_cluster,
    plan_unit,
    replicated_workload,
)
from placement.goodput import GoodputSearch, max_rate
from placement.latency import NO_OVERHEAD, DeploymentKind, LatencyProvider, StageLatency, StepOverhead
from placement.planner import PlanKind
from placement.precision import describe
from placement.search import SearchContext
from placement.step_time import decode_step_s, prefill_step_s
from placement.workload import Workload, arrival_times


# ---------------------------------------------------------------------------------------------
# Search inputs from a window
# ---------------------------------------------------------------------------------------------
def empirical_workload(window: WindowStats, num_requests: int, seed: int, max_positions: int = 2048) -> Workload:
    """Requests at rate 1 with lengths drawn from the window's histograms (outputs cut to fit the context)."""
    if window.input_lengths.total == 0 or window.output_lengths.total == 0:
        raise ValueError("the window has no prompt or no output lengths yet")
    rng = np.random.default_rng(seed)
    inputs = np.clip(window.input_lengths.sample(rng, num_requests), 1, max_positions - 1)
    outputs = np.clip(window.output_lengths.sample(rng, num_requests), 1, max_positions - inputs)
    return Workload(arrival_times(rng, 1.0, num_requests), inputs, outputs, 1.0)


def predicted_step_s(
    model: StageLatency,
    kind: str,
    prompt_lengths: tuple[int, ...] = (),
    batch: int = 0,
    ctx_sum: int = 0,
    overhead: StepOverhead = NO_OVERHEAD,
) -> float:
    """What the latency model predicts for one recorded engine step (the monitor's `predicted_s`).

    `kind` is a runtime `StepRecord`'s: "prefill" (a batch of `prompt_lengths`) or "decode" (`batch`
    rows over `ctx_sum` context tokens); a whole-pipe time, as the runtime measures it, by the formula the
    simulator and the timed engine share (`placement/step_time.py`), the profile's per-step `overhead`
    included (a measured profile keeps its per-step constants there).
    """
    if kind == "prefill":
        return prefill_step_s(model, overhead, prompt_lengths)
    if kind == "decode":
        return decode_step_s(model, overhead, batch, float(ctx_sum))
    raise ValueError(f"no prediction for a {kind!r} step")


@dataclasses.dataclass(frozen=True)
class ScaledStage:
    """A stage latency model with prefill (and chunked) steps × `prefill`, decode steps × `decode`."""

    base: StageLatency
    prefill: float
    decode: float

    @property
    def pp(self) -> int:
        return self.base.pp

    def prefill_stage_s(self, num_tokens: float, sum_sq: float, batch: int) -> float:
        return self.prefill * self.base.prefill_stage_s(num_tokens, sum_sq, batch)

    def decode_stage_s(self, batch: int, ctx_sum: float) -> float:
        return self.decode * self.base.decode_stage_s(batch, ctx_sum)

    def chunk_stage_s(
        self, num_tokens: float, sum_sq: float, batch: int, decode_batch: int, decode_ctx_sum: float
    ) -> float:
        return self.prefill * self.base.chunk_stage_s(num_tokens, sum_sq, batch, decode_batch, decode_ctx_sum)

    def send_s(self, num_tokens: int) -> float:
        return self.base.send_s(num_tokens)


@dataclasses.dataclass(frozen=True)
class CorrectedLatency(LatencyProvider):
    """A latency provider whose instance models are scaled by observed / predicted step-time factors."""

    prefill_factor: float = 1.0
    decode_factor: float = 1.0

    def instance(
        self,
        engine: DeploymentKind,
        tp: int,
        pp: int,
        stage_link_bandwidth: float | None = None,
        quantization: str | None = None,
    ) -> StageLatency:
        base = super().instance(engine, tp, pp, stage_link_bandwidth, quantization)
        if self.prefill_factor == 1.0 and self.decode_factor == 1.0:
            return base
        return ScaledStage(base, self.prefill_factor, self.decode_factor)

    @classmethod
    def from_window(cls, latency: LatencyProvider, window: WindowStats) -> CorrectedLatency:
        """`latency` corrected by the window's per-role factors (a colocated step counts for both)."""
        fields = {f.name: getattr(latency, f.name) for f in dataclasses.fields(LatencyProvider)}
        coloc = window.role_factor("colocated")
        return cls(
            **fields,
            prefill_factor=window.role_factor("prefill") * coloc,
            decode_factor=window.role_factor("decode") * coloc,
        )


# ---------------------------------------------------------------------------------------------
# The planner adapter
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlanEstimate:
    """A plan and the goodput (rps at the attainment target) predicted for it on one workload."""

    plan: DeploymentPlan
    goodput_rps: float

    @property
    def num_devices(self) -> int:
        return self.plan.num_devices

    def delivered_per_device(self, required_rps: float) -> float:
        """min(goodput, required rate) per device: what the plan would really serve, per device."""
        return min(self.goodput_rps, required_rps) / self.num_devices

    def to_dict(self) -> dict[str, object]:
        return {"plan": self.plan.describe(), "num_devices": self.num_devices, "goodput_rps": self.goodput_rps}


def estimate(ctx: SearchContext, plan: DeploymentPlan, check_units: int = DEFAULT_CHECK_UNITS) -> PlanEstimate:
    """The plan's joint goodput on the context's workload (both SLOs, transfers included).

    On a cluster of more than one unit, a plan made of k > 1 copies of one set of instances (`plan_unit`; what
    the planner builds at cluster scale) is judged as the planner judged its candidate: the copies that
    `check_units` planner units hold simulated together, each unit with the workload's requests
    (`replicated_workload`), their goodput per device times the plan's devices. The cost of a decision then
    stays that of a unit or two, whatever the deployment's size."""
    k = plan_unit(plan)[1]
    if k <= 1 or check_units <= 0 or ctx.cluster.num_nodes <= DEFAULT_UNIT_NODES:  # one unit: as the planner
        search = GoodputSearch(plan, ctx.latency, ctx.cluster, ctx.workload, ctx.slo, ctx.options)
        return PlanEstimate(plan, max_rate(search, ctx.rel_tol))
    # as many copies as `check_units` planner units hold (a unit: DEFAULT_UNIT_NODES of the nodes the plan uses)
    nodes_used = len({n for i in plan.instances for n in (i.nodes or ())}) or ctx.cluster.num_nodes
    units = min(check_units, max(1, nodes_used // DEFAULT_UNIT_NODES))
    copies = min(k, max(1, round(k * units * DEFAULT_UNIT_NODES / nodes_used)))
    part = plan_unit(plan, copies)[0]
    workload = replicated_workload(ctx.workload, units, seed=1)
    search = GoodputSearch(part, ctx.latency, ctx.cluster, workload, ctx.slo, ctx.options)
    return PlanEstimate(plan, max_rate(search, ctx.rel_tol) / part.num_devices * plan.num_devices)


def plan_for_rate(ctx: SearchContext, rate: float, kind: PlanKind = "disagg", workers: int = 1) -> PlanEstimate:
    """The deployment `jaxserve plan --rate rate --kind kind` chooses for the context's workload.

    The planner's own entry point with its defaults (high node affinity, joint verification, a cluster of
    more than one unit planned by units: `placement.cluster_plan.plan_cluster`), so the
    replanner never plans with another search than the `plan` command. The goodput is the one the
    planner reports for its choice. It may fall short of `rate` (Algorithm 1 sizes each phase alone
    and the joint simulation can find less); `decide` then refuses a candidate that does not cover the
    rate while the current plan does.
    """
    report = plan_cluster(ctx, kind=kind, rate=rate, workers=workers)
    return PlanEstimate(report.plan, report.goodput_rps)


# ---------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReplanConfig:
    headroom: float = 1.2  # plan for the window's rate × this
    min_gain: float = 0.05  # the delivered-per-device gain a switch needs beyond its cost
    weights_load_s: float = 120.0  # new instances: load weights and warm up (measured on the deployment)
    drain_s: float = 60.0  # old instances: finish what they hold
    horizon_s: float = 3600.0  # how long a new plan is expected to serve (at least the detector's cool-down)
    num_requests: int = 600  # requests sampled from the window for each goodput probe, at least ...
    probe_s: float = 60.0  # ... this many seconds of traffic at the required rate (see `sample_size`)
    rate_z: float = 1.64  # plan for the rate's one-sided upper confidence bound at this z (`required_rate`)
    seed: int = 0
    workers: int = 1  # processes evaluating a round's candidates (`choose_plan`'s pool)

    def __post_init__(self) -> None:
        if self.headroom < 1 or self.min_gain < 0 or self.horizon_s <= 0 or self.num_requests < 10:
            raise ValueError("headroom >= 1, min_gain >= 0, horizon_s > 0 and num_requests >= 10 required")
        if self.weights_load_s < 0 or self.drain_s < 0 or self.probe_s < 0 or self.rate_z < 0:
            raise ValueError("weights_load_s, drain_s, probe_s and rate_z must be >= 0")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")

    def required_rate(self, num_arrivals: int, span_s: float) -> float:
        """The rate a plan must serve, from `num_arrivals` seen in `span_s` seconds: the Poisson count's
        upper confidence bound `(n + z·√n) / span`, times `headroom`.

        A window's count is a sample: a 5-minute window at 40 rps (12,000 arrivals) pins the rate to
        ±1.5 % at z = 1.64, a compressed day's 5-second window (~60 arrivals) only to ±21 %, and a
        plan sized for a low draw misses the hour. The bound shrinks with the evidence, so a long
        window plans for about its rate × headroom and a thin one asks for more.
        """
        if span_s <= 0:
            return 0.0
        n = float(num_arrivals)
        return (n + self.rate_z * math.sqrt(n)) / span_s * self.headroom

    def sample_size(self, required_rps: float) -> int:
        """Requests per goodput probe: `num_requests`, or `probe_s` seconds of traffic at `required_rps`
        if that is more.

        A probe replays its sample at rates around the required one. A sample shorter than a few
        request lifetimes ends before the decode batches and the queues of a slightly overloaded
        deployment reach their steady state, so it overrates goodput near saturation: OPT-13B on
        `prefill=4xtp4,decode=9xtp1` in the diurnal day, 600-request samples of the 07:40 window
        (13 s at 46 rps) predict 41-47 rps; on hour 08's requests 600 predict 42 rps and 9,600 36 rps
        (what that hour really got). A duration, not a count, is what bounds that error at every rate.
        """
        return max(self.num_requests, math.ceil(required_rps * self.probe_s))

    def switch_cost(self, current_devices: int, added_devices: int, removed_devices: int) -> float:
        """The switch's idle device-seconds (added instances loading, removed ones draining) as a share
        of the current plan's device-seconds over the horizon."""
        spent = added_devices * self.weights_load_s + removed_devices * self.drain_s
        return spent / (current_devices * self.horizon_s)


def plan_delta(current: DeploymentPlan, candidate: DeploymentPlan) -> tuple[int, int]:
    """(devices of instances to add, devices of instances to retire) to go from `current` to `candidate`.

    Instances of the same role, shape and precision in both plans are kept as they are (no reload, no drain); one
    whose weights change precision is reloaded.
    """
    keep = Counter((i.role, i.tp, i.pp, i.chunk_size, i.quantization) for i in current.instances)
    want = Counter((i.role, i.tp, i.pp, i.chunk_size, i.quantization) for i in candidate.instances)
    added = sum(n * tp * pp for (_, tp, pp, _, _), n in (want - keep).items())
    removed = sum(n * tp * pp for (_, tp, pp, _, _), n in (keep - want).items())
    return added, removed


@dataclasses.dataclass(frozen=True)
class ReplanDecision:
    switch: bool
    reasons: tuple[str, ...]
    current: PlanEstimate
    candidate: PlanEstimate
    required_rps: float
    gain: float  # candidate / current delivered per device − 1
    threshold: float  # min_gain + switch cost

    @property
    def chosen(self) -> PlanEstimate:
        return self.candidate if self.switch else self.current

    def serving_goodput_rps(self, applied: bool) -> float:
        """The predicted goodput of the plan serving after this decision: the candidate's when the
        switch was `applied`, else the current plan's (kept, only advised, or a failed switch)."""
        return self.candidate.goodput_rps if self.switch and applied else self.current.goodput_rps

    def to_dict(self) -> dict[str, object]:
        return {
            "switch": self.switch,
            "reasons": list(self.reasons),
            "current": self.current.to_dict(),
            "candidate": self.candidate.to_dict(),
            "required_rps": self.required_rps,
            "gain": self.gain,
            "threshold": self.threshold,
        }


def decide(current: PlanEstimate, candidate: PlanEstimate, required_rps: float, config: ReplanConfig) -> ReplanDecision:
    """Switch to `candidate` or keep `current` for `required_rps`; pure, with the reasons either way."""
    cur = current.delivered_per_device(required_rps)
    new = candidate.delivered_per_device(required_rps)
    gain = new / cur - 1 if cur > 0 else (math.inf if new > 0 else 0.0)
    added, removed = plan_delta(current.plan, candidate.plan)
    cost = config.switch_cost(current.num_devices, added, removed)
    threshold = config.min_gain + cost
    cur_ok = current.goodput_rps >= required_rps
    new_ok = candidate.goodput_rps >= required_rps
    reasons = [
        f"required {required_rps:.3g} rps; current {describe(current.plan)} on {current.num_devices} devices "
        f"serves {current.goodput_rps:.3g} rps, candidate {describe(candidate.plan)} on "
        f"{candidate.num_devices} devices serves {candidate.goodput_rps:.3g} rps",
        f"delivered per device {cur:.4g} -> {new:.4g} (gain {gain:+.1%}); threshold {threshold:.1%} = "
        f"min gain {config.min_gain:.1%} + switch cost {cost:.1%} ({added} devices to load, {removed} to drain)",
    ]
    if describe(current.plan) == describe(candidate.plan):  # the same shapes at the same precisions
        switch = False
        reasons.append("keep: the candidate is the current plan")
    elif not cur_ok and new_ok:
        switch = True
        reasons.append("switch: the current plan no longer covers the required rate and the candidate does")
    elif cur_ok and not new_ok:
        switch = False
        reasons.append("keep: the candidate would not cover the required rate")
    elif not cur_ok:  # neither covers it: take the one serving more, if by more than the threshold
        more = candidate.goodput_rps / current.goodput_rps - 1 if current.goodput_rps > 0 else math.inf
        switch = more > threshold
        reasons.append(
            f"{'switch' if switch else 'keep'}: neither covers the rate; the candidate serves {more:+.1%} "
            f"{'>' if switch else '<='} threshold"
        )
    else:
        switch = gain > threshold
        reasons.append(f"{'switch' if switch else 'keep'}: gain {gain:+.1%} {'>' if switch else '<='} threshold")
    return ReplanDecision(switch, tuple(reasons), current, candidate, required_rps, gain, threshold)


# ---------------------------------------------------------------------------------------------
# A whole round, and running it in the background
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReplanJob:
    """Everything a replan round needs (picklable: it crosses into the worker process)."""

    current: DeploymentPlan
    window: WindowStats
    context: SearchContext  # its workload and latency are replaced from the window
    config: ReplanConfig = dataclasses.field(default_factory=ReplanConfig)
    requested_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class ReplanOutcome:
    job: ReplanJob
    decision: ReplanDecision | None
    error: str | None = None
    num_requests: int = 0  # requests per goodput probe (`ReplanConfig.sample_size`)

    def to_dict(self) -> dict[str, object]:
        return {
            "requested_at": self.job.requested_at,
            "num_requests": self.num_requests,
            "decision": self.decision.to_dict() if self.decision else None,
            "error": self.error,
        }


def replan(job: ReplanJob) -> ReplanOutcome:
    """Search a plan for the window's workload and decide whether to switch to it."""
    cfg, window = job.config, job.window
    required = cfg.required_rate(window.num_arrivals, window.span_s)
    # a cluster of several units is planned (and judged) unit by unit: a probe needs a unit's share of traffic
    units = max(1, job.context.cluster.num_nodes // DEFAULT_UNIT_NODES)
    n = cfg.sample_size(required / units)
    try:
        workload = empirical_workload(window, n, cfg.seed, job.context.cfg.max_position_embeddings)
        ctx = dataclasses.replace(
            job.context, workload=workload, latency=CorrectedLatency.from_window(job.context.latency, window)
        )
        candidate = plan_for_rate(ctx, required, kind=job.current.kind, workers=cfg.workers)
        current = estimate(ctx, job.current)
    except (PlanError, ValueError) as e:
        return ReplanOutcome(job, None, f"{type(e).__name__}: {e}", n)
    return ReplanOutcome(job, decide(current, candidate, required, cfg), None, n)


class BackgroundReplanner:
    """Runs `replan` rounds in one worker process, one at a time; the caller polls without blocking.

    Spawned (not forked) when JAX is loaded in this process: forking a process running XLA threads
    can deadlock the child.
    """

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn") if "jax" in sys.modules else None
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=context)
        self._future: Future[ReplanOutcome] | None = None

    @property
    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def submit(self, job: ReplanJob) -> bool:
        """Start a round; False (and nothing started) while the previous one runs or is uncollected."""
        if self._future is not None:
            return False
        self._future = self._pool.submit(replan, job)
        return True

    def poll(self) -> ReplanOutcome | None:
        """The finished round's outcome (once), else None."""
        if self._future is None or not self._future.done():
            return None
        future, self._future = self._future, None
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> BackgroundReplanner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
