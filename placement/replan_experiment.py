"""The replanning experiment: one time-varying workload, three ways of provisioning for it.

* `peak` — a static plan sized for the busiest hour (its rate × headroom, its length mix);
* `average` — a static plan sized for the day's mean rate × headroom and the whole day's mix
  (every policy plans for `ReplanConfig.required_rate`: the count's upper confidence bound × headroom);
* `adaptive` — the replanning loop: the workload monitor (`jaxserve/core/workload_monitor.py`) is fed every
  arrival, its shift detector is checked at each slice end, and when it fires a replan round
  (`placement/replan_decision.py`: search on the window's empirical workload, then the switch decision) runs.
  The detector knows the predicted goodput of the plan serving (the initial plan's, then what each
  round leaves serving), so a load that eats the plan's headroom — more requests, or heavier ones
  (the detector weighs the rate by the mix's load factor) — fires through the cool-down; the runtime
  loop feeds it the same way.
  A switch is charged as unavailable devices: instances of the same role and shape in both plans are
  kept; the instances the new plan adds are held from the end of the search (`search_s`, during which
  the old plan serves alone) through weights loading and warm-up (`weights_load_s`) before they take
  any request, and the instances it retires stay held until the last request routed to the old plan
  has finished (its drain, simulated). The first plan is sized on hour 0,
  as an operator would from yesterday's first hour.

Each stretch of traffic a plan serves ("epoch") is simulated by `placement/simulator.py` from an
empty deployment (new instances start empty; old ones finish their own requests), so per-request
TTFT/TPOT come from the same event loop as every other planner number. (A kept instance is thus
simulated twice for the seconds its old requests take to finish, once draining them and once taking
new ones: the drains last seconds, the epochs hours.) Per hour (by arrival) the
report gives SLO attainment, goodput (requests meeting both SLOs per second) and the mean devices
held; in total device-hours and the share of hours meeting the attainment target.

Simplifications, said once: in the simulation the monitor sees a request's output length at its
arrival (the runtime sees it at the finish, seconds later); the step-time correction factors stay 1
(the simulator *is* the latency model); devices are counted, not tracked by identity, so a switch may
briefly hold more devices than the cluster has (the report gives the peak). With a compressed day
(`hour_s` < 3600) every control-loop duration — windows, slices, sustain, cool-down, search time,
weights load, drain estimate, horizon — is scaled by `hour_s / 3600` too, so the loop's timing
relative to the cycle is that of a real day; request latencies are not scaled, nor is the traffic a
goodput probe replays (`ReplanConfig.probe_s`, a duration of request dynamics).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxserve.core.plan import DeploymentPlan
from jaxserve.core.workload_monitor import DetectorConfig, MonitorConfig, ShiftDetector, WorkloadMonitor
from placement.hardware import ClusterSpec
from placement.latency import LatencyProvider
from placement.planner import PlanKind
from placement.replan_decision import PlanEstimate, ReplanConfig, ReplanJob, plan_delta, plan_for_rate, replan
from placement.search import SearchContext
from placement.simulator import SimOptions, simulate
from placement.slo import SloSpec, attainment
from placement.timevarying import hour_of, select
from placement.workload import Workload, arrival_times

POLICIES = ("peak", "average", "adaptive")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The replanning loop's knobs, in real seconds."""

    monitor: MonitorConfig = dataclasses.field(default_factory=lambda: MonitorConfig(window_s=300, slice_s=30))
    detector: DetectorConfig = dataclasses.field(
        default_factory=lambda: DetectorConfig(rate_change=0.2, min_ks=0.15, sustain_s=120, cooldown_s=2700)
    )
    replan: ReplanConfig = dataclasses.field(
        default_factory=lambda: ReplanConfig(headroom=1.3, weights_load_s=120, drain_s=60, horizon_s=3600)
    )
    search_s: float = 30.0  # wall time of one replan round (it runs beside serving)

    def scaled(self, factor: float) -> LoopConfig:
        """Every duration × factor (a compressed day)."""
        m, d, r = self.monitor, self.detector, self.replan
        return LoopConfig(
            dataclasses.replace(m, window_s=m.window_s * factor, slice_s=m.slice_s * factor),
            dataclasses.replace(d, sustain_s=d.sustain_s * factor, cooldown_s=d.cooldown_s * factor),
            dataclasses.replace(
                r,
                weights_load_s=r.weights_load_s * factor,
                drain_s=r.drain_s * factor,
                horizon_s=r.horizon_s * factor,
            ),
            self.search_s * factor,
        )


@dataclasses.dataclass(frozen=True)
class Experiment:
    latency: LatencyProvider
    cluster: ClusterSpec
    slo: SloSpec
    hour_s: float = 3600.0
    num_hours: int = 24
    loop: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    options: SimOptions = dataclasses.field(default_factory=SimOptions)
    max_pp: int | None = 1
    kind: PlanKind = "disagg"  # what every plan is searched as (`jaxserve plan --kind`; a live switch keeps it)
    seed: int = 0

    @property
    def day_s(self) -> float:
        return self.hour_s * self.num_hours

    def context(self, workload: Workload) -> SearchContext:
        return SearchContext(self.latency, self.cluster, workload, self.slo, self.options, max_pp=self.max_pp)

    def sample_size(self, required_rps: float) -> int:
        """Requests per goodput probe when planning for `required_rps`, static plans included: the
        replan rounds' rule (`ReplanConfig.sample_size`; its `probe_s` is a request-latency
        duration, never compressed with the day)."""
        return self.loop.replan.sample_size(required_rps)


@dataclasses.dataclass(frozen=True)
class Epoch:
    """A plan and the stretch of traffic it serves: arrivals in [serve_from, serve_until).

    Devices: the plan's over [serve_from, serve_until); the instances it adds to the previous plan's
    (`loading_devices`) also over [held_from, serve_from) while their weights load; the instances the
    next plan retires (`draining_devices`) also over [serve_until, held_until) while they drain.
    """

    plan: DeploymentPlan
    held_from: float
    serve_from: float
    serve_until: float
    loading_devices: int = 0
    draining_devices: int = 0
    held_until: float = math.nan  # its last request finished (filled in by the simulation)

    def intervals(self, day_s: float) -> list[tuple[float, float, int]]:
        """(from, until, devices) held, clipped to the day."""
        out = [
            (self.held_from, self.serve_from, self.loading_devices),
            (self.serve_from, min(self.serve_until, day_s), self.plan.num_devices),
            (min(self.serve_until, day_s), min(self.held_until, day_s), self.draining_devices),
        ]
        return [(a, b, n) for a, b, n in out if b > a and n > 0]


@dataclasses.dataclass
class PolicyRun:
    name: str
    epochs: list[Epoch]
    ttft_s: np.ndarray  # [N] per request of the trace (inf: never finished)
    tpot_s: np.ndarray  # [N]
    decisions: list[dict[str, object]] = dataclasses.field(default_factory=list)
    why: str = ""


@dataclasses.dataclass(frozen=True)
class HourRow:
    hour: int
    num_requests: int
    rate_rps: float
    input_len_mean: float
    attainment: dict[str, float]  # policy -> share meeting both SLOs
    goodput_rps: dict[str, float]  # policy -> requests meeting both SLOs per second
    devices: dict[str, float]  # policy -> mean devices held over the hour


def planning_sample(workload: Workload, n: int, seed: int) -> Workload:
    """Up to n of the requests (drawn without replacement), re-timed as a Poisson stream at rate 1."""
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(len(workload), size=min(n, len(workload)), replace=False))
    return Workload(arrival_times(rng, 1.0, len(idx)), workload.input_lens[idx], workload.output_lens[idx], 1.0)


def static_plan(exp: Experiment, trace: Workload, which: str) -> tuple[PlanEstimate, str]:
    """The `peak` (busiest hour) or `average` (whole day) plan, sized for its rate × headroom."""
    cfg = exp.loop.replan
    if which == "peak":
        counts = np.bincount(hour_of(trace, exp.hour_s), minlength=exp.num_hours)[: exp.num_hours]
        hour = int(np.argmax(counts))
        required = cfg.required_rate(int(counts[hour]), exp.hour_s)
        source = select(trace, hour_of(trace, exp.hour_s) == hour)
        why = f"busiest hour {hour}: {counts[hour] / exp.hour_s:.3g} rps, planned for {required:.3g}"
    elif which == "average":
        required = cfg.required_rate(len(trace), exp.day_s)
        source = trace
        why = f"day mean {len(trace) / exp.day_s:.3g} rps, planned for {required:.3g}, whole-day length mix"
    else:
        raise ValueError(f"unknown static plan {which!r}")
    sample = planning_sample(source, exp.sample_size(required), exp.seed)
    return plan_for_rate(exp.context(sample), required, kind=exp.kind), why


def _simulate_epochs(
    exp: Experiment, trace: Workload, epochs: list[Epoch]
) -> tuple[list[Epoch], np.ndarray, np.ndarray]:
    ttft = np.full(len(trace), math.inf)
    tpot = np.full(len(trace), math.inf)
    done = []
    for e in epochs:
        mask = (trace.arrival_at >= e.serve_from) & (trace.arrival_at < e.serve_until)
        held_until = min(e.serve_until, exp.day_s)
        if mask.any():
            result = simulate(e.plan, exp.latency, exp.cluster, select(trace, mask), None, exp.options)
            ttft[mask] = np.nan_to_num(result.ttft_s, nan=math.inf)
            tpot[mask] = np.nan_to_num(result.tpot_s, nan=math.inf)
            if np.isfinite(result.finish_at).any():
                held_until = max(held_until, float(np.nanmax(result.finish_at)))
        done.append(dataclasses.replace(e, held_until=min(held_until, exp.day_s)))
    return done, ttft, tpot


def run_static(exp: Experiment, trace: Workload, name: str, plan: DeploymentPlan, why: str = "") -> PolicyRun:
    epochs, ttft, tpot = _simulate_epochs(exp, trace, [Epoch(plan, 0.0, 0.0, math.inf)])
    return PolicyRun(name, epochs, ttft, tpot, why=why)


def run_adaptive(exp: Experiment, trace: Workload) -> PolicyRun:
    """The monitor + detector + replan loop over the trace (see the module docstring)."""
    loop = exp.loop.scaled(exp.hour_s / 3600.0)
    first = select(trace, hour_of(trace, exp.hour_s) == 0)
    rate0 = len(first) / exp.hour_s
    required0 = loop.replan.required_rate(len(first), exp.hour_s)
    initial = plan_for_rate(
        exp.context(planning_sample(first, exp.sample_size(required0), exp.seed)), required0, kind=exp.kind
    )
    monitor = WorkloadMonitor(loop.monitor)
    detector = ShiftDetector(loop.detector)
    detector.set_capacity(initial.goodput_rps)
    epochs = [Epoch(initial.plan, 0.0, 0.0, math.inf)]
    decisions: list[dict[str, object]] = []
    ctx = exp.context(planning_sample(first, 16, exp.seed))  # its workload is replaced per round
    busy_until = -math.inf  # a switch in flight: no new round before it completes
    arrivals, inputs, outputs = trace.arrival_at, trace.input_lens, trace.output_lens
    i, n = 0, len(trace)
    slice_s = loop.monitor.slice_s
    for k in range(1, math.floor(exp.day_s / slice_s + 1e-9) + 1):
        now = k * slice_s
        j = int(np.searchsorted(arrivals, now, side="left"))
        for a, p, o in zip(arrivals[i:j].tolist(), inputs[i:j].tolist(), outputs[i:j].tolist(), strict=True):
            monitor.record_arrival(a, p)
            monitor.record_finish(a, o, None, None)  # see the module docstring: lengths only
        i = j
        window = monitor.window(now)
        check = detector.check(window)
        if not check.fire or now < busy_until:
            continue
        job = ReplanJob(epochs[-1].plan, window, ctx, dataclasses.replace(loop.replan, seed=exp.seed + k), now)
        outcome = replan(job)
        detector.mark_replanned(now, window)
        if outcome.decision is not None:
            detector.set_capacity(outcome.decision.serving_goodput_rps(applied=True))
        entry: dict[str, object] = {"at_hour": now / exp.hour_s, "trigger": list(check.reasons), **outcome.to_dict()}
        decisions.append(entry)
        if outcome.decision is not None and outcome.decision.switch:
            new_plan = outcome.decision.candidate.plan
            added, removed = plan_delta(epochs[-1].plan, new_plan)
            held_from = now + loop.search_s
            serve_from = held_from + loop.replan.weights_load_s
            epochs[-1] = dataclasses.replace(epochs[-1], serve_until=serve_from, draining_devices=removed)
            epochs.append(Epoch(new_plan, held_from, serve_from, math.inf, loading_devices=added))
            busy_until = serve_from
    assert i <= n
    done, ttft, tpot = _simulate_epochs(exp, trace, epochs)
    why = f"initial plan for hour 0 ({rate0:.3g} rps, planned for {required0:.3g}); {len(decisions)} replan rounds"
    return PolicyRun("adaptive", done, ttft, tpot, decisions, why)


def loop_warnings(exp: Experiment, trace: Workload) -> list[str]:
    """Why the replanning loop may be blind on this trace (a window too short to judge shifts)."""
    loop = exp.loop.scaled(exp.hour_s / 3600.0)
    counts = np.bincount(hour_of(trace, exp.hour_s), minlength=exp.num_hours)[: exp.num_hours]
    quietest = float(counts.min()) / exp.hour_s * loop.monitor.window_s
    if quietest < loop.detector.min_requests:
        return [
            f"the monitor window ({loop.monitor.window_s:g} s after compression) holds ~{quietest:.0f} requests in the "
            f"quietest hour, fewer than the detector needs ({loop.detector.min_requests}): shifts there go unseen; "
            "use a longer --hour-s"
        ]
    return []


def devices_per_hour(exp: Experiment, run: PolicyRun) -> np.ndarray:
    """Mean devices held in each hour (a device loading weights or draining counts as held)."""
    out = np.zeros(exp.num_hours)
    for e in run.epochs:
        for start, end, devices in e.intervals(exp.day_s):
            for h in range(exp.num_hours):
                overlap = min((h + 1) * exp.hour_s, end) - max(h * exp.hour_s, start)
                if overlap > 0:
                    out[h] += devices * overlap / exp.hour_s
    return out


def peak_devices(exp: Experiment, run: PolicyRun) -> int:
    """The most devices held at once (during a switch: kept + loading + draining instances)."""
    spans = [iv for e in run.epochs for iv in e.intervals(exp.day_s)]
    return max(sum(n for a, b, n in spans if a <= t < b) for t in {a for a, _, _ in spans})


@dataclasses.dataclass
class ExperimentResult:
    exp: Experiment
    trace: Workload
    runs: dict[str, PolicyRun]
    rows: list[HourRow]

    def totals(self) -> dict[str, dict[str, float]]:
        target = self.exp.slo.attainment
        out = {}
        for name, run in self.runs.items():
            meets = sum(r.attainment[name] >= target - 1e-12 for r in self.rows)
            out[name] = {
                "device_hours": sum(r.devices[name] for r in self.rows),
                "hours_meeting_target": meets,
                "share_hours_meeting_target": meets / len(self.rows),
                "attainment": attainment(run.ttft_s, run.tpot_s, self.exp.slo),
                "peak_devices": peak_devices(self.exp, run),
                "num_switches": len(run.epochs) - 1,
            }
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.exp.latency.cfg.name,
            "profile": self.exp.latency.profile.name if self.exp.latency.profile else None,
            "slo": dataclasses.asdict(self.exp.slo),
            "hour_s": self.exp.hour_s,
            "num_requests": len(self.trace),
            "hours": [dataclasses.asdict(r) for r in self.rows],
            "totals": self.totals(),
            "plans": {
                name: {
                    "why": run.why,
                    "epochs": [
                        {
                            "plan": e.plan.describe(),
                            "num_devices": e.plan.num_devices,
                            "held_from_hour": e.held_from / self.exp.hour_s,
                            "serve_from_hour": e.serve_from / self.exp.hour_s,
                            "held_until_hour": e.held_until / self.exp.hour_s,
                        }
                        for e in run.epochs
                    ],
                    "decisions": run.decisions,
                }
                for name, run in self.runs.items()
            },
        }

    def table(self) -> str:
        """The per-hour table and the totals, as Markdown."""
        target = self.exp.slo.attainment
        head = "| hour | rps | mean prompt | " + " | ".join(
            f"{p} attain | {p} goodput | {p} devices" for p in self.runs
        )
        lines = [head + " |", "|" + "---:|" * (3 + 3 * len(self.runs))]
        for r in self.rows:
            cells = [f"{r.hour:02d}", f"{r.rate_rps:.1f}", f"{r.input_len_mean:.0f}"]
            for p in self.runs:
                mark = "" if r.attainment[p] >= target - 1e-12 else " ✗"
                cells += [f"{r.attainment[p]:.1%}{mark}", f"{r.goodput_rps[p]:.1f}", f"{r.devices[p]:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "| policy | device-hours | hours meeting target | attainment (all requests) | peak devices | switches |",
        ]
        lines.append("|---|---:|---:|---:|---:|---:|")
        for p, t in self.totals().items():
            lines.append(
                f"| {p} | {t['device_hours']:.1f} | {t['hours_meeting_target']:.0f}/{len(self.rows)} "
                f"({t['share_hours_meeting_target']:.0%}) | {t['attainment']:.1%} | {t['peak_devices']:.0f} | "
                f"{t['num_switches']:.0f} |"
            )
        return "\n".join(lines)


def hourly_rows(exp: Experiment, trace: Workload, runs: dict[str, PolicyRun]) -> list[HourRow]:
    hours = hour_of(trace, exp.hour_s)
    devices = {name: devices_per_hour(exp, run) for name, run in runs.items()}
    rows = []
    for h in range(exp.num_hours):
        mask = hours == h
        count = int(mask.sum())
        att, good = {}, {}
        for name, run in runs.items():
            ok = (run.ttft_s[mask] <= exp.slo.ttft_s) & (run.tpot_s[mask] <= exp.slo.tpot_s)
            att[name] = attainment(run.ttft_s[mask], run.tpot_s[mask], exp.slo) if count else 1.0
            good[name] = float(ok.sum()) / exp.hour_s
        rows.append(
            HourRow(
                h,
                count,
                count / exp.hour_s,
                float(trace.input_lens[mask].mean()) if count else 0.0,
                att,
                good,
                {name: float(d[h]) for name, d in devices.items()},
            )
        )
    return rows


def run_experiment(exp: Experiment, trace: Workload, policies: tuple[str, ...] = POLICIES) -> ExperimentResult:
    """Plan and replay `trace` under each policy; rows per hour and totals."""
    runs: dict[str, PolicyRun] = {}
    for name in policies:
        if name == "adaptive":
            runs[name] = run_adaptive(exp, trace)
        else:
            est, why = static_plan(exp, trace, name)
            runs[name] = run_static(
                exp, trace, name, est.plan, f"{why}: {est.plan.describe()} ({est.goodput_rps:.3g} rps predicted)"
            )
    return ExperimentResult(exp, trace, runs, hourly_rows(exp, trace, runs))
