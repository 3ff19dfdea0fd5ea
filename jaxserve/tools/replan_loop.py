"""Online replanning of a running deployment: the monitor fed by the controller, the loop, the switch.

This module sits in the tools wing, *above* the runtime and the planner (docs/architecture.md: the runtime
never imports `placement/`): it feeds the controller's events into a `WorkloadMonitor`, asks the planner
(`placement/replan_decision.py`, imported only when the loop can plan) for a better deployment, and applies
one through the runtime's generic switch (`jaxserve/runtime/switch.py`).

`ReplanLoop` (one per deployment):

* inputs: the controller's `workload_hook` (this object): `on_arrival` at admission, `on_finish`
  with TTFT/TPOT (aborted requests count for nothing); every tick it sweeps the instances' step
  logs (`controller.step_records(since)`) and records each step's observed time against the latency
  model's prediction for that instance's shape (`predicted_step_s`; chunked "mixed" steps skipped),
  which gives the per-role correction factors. Everything goes to the monitor under one lock
  (worker threads and the event loop call in).
* a daemon thread ticks every `slice_s`: the detector checks the window; when it fires (mode
  advise or auto) a replan round (`ReplanJob`) runs in a background process (`BackgroundReplanner`:
  the search never stalls serving) and the detector starts its cool-down; a finished round's
  decision is logged with its reasons either way and kept for `GET /debug/workload`; the goodput it
  predicts for the plan left serving goes to the detector (`set_capacity`), whose overload trigger
  then fires through the cool-down once the load eats that plan's headroom. In `advise`
  mode the better plan is only exposed; in `auto` a decision to switch is applied at once.
  `weights_load_s` of the switch cost is the measured start-up (engine build) time, or the last
  switch's build + warm-up; `drain_s` is the p90 of recent request durations.
* `apply_deployment(plan)`: the manual switch (`POST /admin/deployment`, behind the admin key), the same
  path `auto` takes; `max_plan_devices()` bounds what the server parses of a posted plan.
* `off`: no detector, no planner (nothing from `placement/` is imported); the monitor's gauges and
  the manual switch still work.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import numpy as np

from jaxserve.core.plan import MAX_PLAN_DEVICES, QUANTIZATIONS, DeploymentPlan
from jaxserve.core.request import FinishReason, RequestTimings
from jaxserve.core.workload_monitor import (
    DetectorConfig,
    MonitorConfig,
    Role,
    ShiftDetector,
    WindowStats,
    WorkloadMonitor,
)
from jaxserve.runtime.controller import Controller
from jaxserve.runtime.switch import LocalDevices, PlanSwitcher, SwitchReport, SwitchUnsupportedError
from jaxserve.serving.admin import WorkloadGauges

if TYPE_CHECKING:
    from placement.latency import LatencyProvider, StageLatency, StepOverhead
    from placement.replan_decision import BackgroundReplanner, ReplanConfig, ReplanJob, ReplanOutcome
    from placement.search import SearchContext

log = logging.getLogger(__name__)

ReplanMode = Literal["off", "advise", "auto"]
REPLAN_MODES: tuple[ReplanMode, ...] = ("off", "advise", "auto")


@dataclasses.dataclass(frozen=True)
class ReplanLoopConfig:
    mode: ReplanMode = "off"
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
    detector: DetectorConfig = dataclasses.field(default_factory=DetectorConfig)
    apply_corrections: bool = True  # scale the latency model by the observed step-time factors
    headroom: float = 1.2
    min_gain: float = 0.05
    horizon_s: float | None = None  # default: the detector's cool-down (at least 60 s)
    num_requests: int = 600  # requests sampled from the window per goodput probe, at least ...
    probe_s: float = 60.0  # ... this many seconds of traffic at the required rate (ReplanConfig.sample_size)
    rate_z: float = 1.64  # plan for the window rate's upper confidence bound (ReplanConfig.required_rate)
    default_drain_s: float = 10.0  # before any request finished

    def __post_init__(self) -> None:
        if self.mode not in REPLAN_MODES:
            raise ValueError(f"replan mode must be one of {REPLAN_MODES}, not {self.mode!r}")


def plan_id(plan: DeploymentPlan) -> str:
    """A short stable id of a plan's shape (its spec string, devices left out)."""
    return hashlib.sha1(plan.describe().encode()).hexdigest()[:12]


class ReplanLoop:
    """Monitor + detector + background replanner + switch for one controller (see the module docstring)."""

    def __init__(
        self,
        controller: Controller,
        config: ReplanLoopConfig | None = None,
        *,
        switcher: PlanSwitcher | None = None,
        context: SearchContext | None = None,
        latency: LatencyProvider | None = None,
        weights_load_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`context`: the planning inputs (cluster, SLOs, latency profile; its workload is replaced by
        the window's); required for advise/auto. `latency`: the model the step corrections compare
        against (default: the context's). `switcher`: None when the backend cannot switch live."""
        self.controller = controller
        self.config = config or ReplanLoopConfig()
        if self.config.mode != "off" and context is None:
            raise ValueError("replanning (advise/auto) needs a planning context (cluster, SLOs, latency profile)")
        if self.config.mode == "auto" and switcher is None:
            raise SwitchUnsupportedError("--replan auto needs a switcher (a way to build new instances)")
        self.switcher = switcher
        self.context = context
        self.latency = latency if latency is not None else (context.latency if context is not None else None)
        self.weights_load_s = weights_load_s
        self.clock = clock
        self._lock = threading.Lock()
        self.monitor = WorkloadMonitor(self.config.monitor, start_at=clock())
        self.detector = ShiftDetector(self.config.detector)
        self._durations_s: collections.deque[float] = collections.deque(maxlen=1000)
        self._steps_since = clock()
        self._models: dict[tuple[str, int, int], StageLatency | None] = {}
        self._replanner: BackgroundReplanner | None = None
        self.last_decision: dict[str, object] | None = None
        self.advised_plan: DeploymentPlan | None = None
        self.last_replan_at: float | None = None  # wall-clock (unix) time of the last round or switch
        self.last_switch: dict[str, object] | None = None
        self.num_rounds = 0
        self.num_switches = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- controller hook (WorkloadHook) ------------------------------------------------
    def on_arrival(self, arrival_at: float, num_prompt_tokens: int) -> None:
        with self._lock:
            self.monitor.record_arrival(arrival_at, num_prompt_tokens)

    def on_finish(self, timings: RequestTimings, num_output_tokens: int, finish_reason: FinishReason) -> None:
        if finish_reason == "abort" or timings.finished_at is None:
            return
        ttft = tpot = None
        if timings.first_token_at is not None:
            ttft = timings.first_token_at - timings.arrival_at
            if num_output_tokens > 1 and timings.token_times:
                tpot = (timings.token_times[-1] - timings.first_token_at) / (num_output_tokens - 1)
        with self._lock:
            self.monitor.record_finish(timings.finished_at, num_output_tokens, ttft, tpot)
            self._durations_s.append(timings.finished_at - timings.arrival_at)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> ReplanLoop:
        self.controller.workload_hook = self
        if self.config.mode != "off":
            from placement.replan_decision import BackgroundReplanner

            self._replanner = BackgroundReplanner()
        self._thread = threading.Thread(target=self._run, name="jaxserve-replan", daemon=True)
        self._thread.start()
        log.info(
            "replanning %s: window %g s in %g s slices%s",
            self.config.mode, self.config.monitor.window_s, self.config.monitor.slice_s,
            "" if self.latency is None or self.latency.profile is not None
            else "; no --profile: step corrections and plans use the shipped roofline, good for advice only",
        )  # fmt: skip
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self.controller.workload_hook is self:
            self.controller.workload_hook = None
        if self._replanner is not None:
            self._replanner.close()
            self._replanner = None

    def __enter__(self) -> ReplanLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        period = self.config.monitor.slice_s
        while not self._stop.wait(period):
            try:
                self.tick()
            except Exception:  # the loop must never take serving down
                log.exception("replanning tick failed")

    # ---- one tick ---------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        self._sweep_steps()
        if self._replanner is None:
            return
        outcome = self._replanner.poll()
        if outcome is not None:
            self._on_outcome(outcome)
        with self._lock:
            window = self.monitor.window(now)
            check = self.detector.check(window)
        if not check.fire:
            return
        if self._replanner.busy:
            return
        job = self._job(window, now)
        if self._replanner.submit(job):
            with self._lock:
                self.detector.mark_replanned(now, window)
            self.num_rounds += 1
            self.last_replan_at = time.time()
            log.info("workload shifted (%s): replanning in the background", "; ".join(check.reasons))

    def _job(self, window: WindowStats, now: float) -> ReplanJob:
        from placement.replan_decision import ReplanJob

        assert self.context is not None
        return ReplanJob(self.controller.plan, window, self.context, self._replan_config(), requested_at=now)

    def _replan_config(self) -> ReplanConfig:
        from placement.replan_decision import ReplanConfig

        cfg = self.config
        horizon = cfg.horizon_s if cfg.horizon_s is not None else max(cfg.detector.cooldown_s, 60.0)
        with self._lock:
            durations = list(self._durations_s)
        drain = float(np.percentile(durations, 90)) if durations else cfg.default_drain_s
        weights = self.weights_load_s
        last = self.switcher.last_report if self.switcher is not None else None
        if last is not None and last.added:
            weights = last.build_s + last.warmup_s
        return ReplanConfig(
            headroom=cfg.headroom, min_gain=cfg.min_gain, weights_load_s=weights, drain_s=drain,
            horizon_s=horizon, num_requests=cfg.num_requests, probe_s=cfg.probe_s, rate_z=cfg.rate_z,
        )  # fmt: skip

    def _on_outcome(self, outcome: ReplanOutcome) -> None:
        record = outcome.to_dict()
        decision = outcome.decision
        applied = False
        if decision is None:
            log.warning("replan round failed: %s", outcome.error)
            record["action"] = "none"
        elif not decision.switch:
            log.info("replan: keep %s: %s", self.controller.plan.describe(), " | ".join(decision.reasons))
            record["action"] = "keep"
        elif self.config.mode == "advise":
            self.advised_plan = decision.candidate.plan
            log.info(
                "replan (advise): %s would serve better than %s: %s",
                decision.candidate.plan.describe(), self.controller.plan.describe(), " | ".join(decision.reasons),
            )  # fmt: skip
            record["action"] = "advised"
        else:
            log.info("replan: switching to %s: %s", decision.candidate.plan.describe(), " | ".join(decision.reasons))
            try:
                report = self.apply_deployment(decision.candidate.plan)
                applied = True
                record["action"] = "switched"
                record["switch"] = report
            except Exception as e:
                log.exception("replan: the switch to %s failed", decision.candidate.plan.describe())
                record["action"] = "switch_failed"
                record["error"] = f"{type(e).__name__}: {e}"
        if decision is not None:  # the serving plan's predicted goodput: the detector's overload trigger
            with self._lock:
                self.detector.set_capacity(decision.serving_goodput_rps(applied))
        self.last_decision = record

    # ---- step corrections -------------------------------------------------------------------
    def _model(self, role: str, tp: int, pp: int) -> StageLatency | None:
        key = (role, tp, pp)
        if key not in self._models:
            model = None
            if self.latency is not None and self.config.apply_corrections:
                try:
                    model = self.latency.instance("colocated" if role == "colocated" else "disagg", tp, pp)
                except Exception as e:  # e.g. a profile without this model or tp: no corrections for it
                    log.warning("no latency model for %s tp%d pp%d (%s): no step corrections", role, tp, pp, e)
            self._models[key] = model
        return self._models[key]

    def _overhead(self, role: str, tp: int) -> StepOverhead:
        assert self.latency is not None
        return self.latency.step_overhead("colocated" if role == "colocated" else "disagg", tp)

    def _sweep_steps(self) -> None:
        if self.latency is None or not self.config.apply_corrections:
            return
        from placement.replan_decision import predicted_step_s

        records = self.controller.step_records(self._steps_since)
        latest = self._steps_since
        rows: list[tuple[float, str, Role, float, float]] = []
        for entry in records:
            name, role = str(entry["name"]), entry["role"]
            placed = self.controller.placed_of.get(name)
            steps = entry["steps"]
            assert isinstance(steps, list)
            if placed is None or not steps:
                continue
            model = self._model(str(role), placed.spec.tp, placed.spec.pp)
            for step in steps:
                at = float(step["at"])
                latest = max(latest, at)
                if model is None or step["kind"] == "mixed":
                    continue
                predicted = predicted_step_s(
                    model, str(step["kind"]), tuple(step["prompt_lengths"]), int(step["batch"]), int(step["ctx_sum"]),
                    self._overhead(str(role), placed.spec.tp),
                )  # fmt: skip
                rows.append((at, name, role, float(step["seconds"]), predicted))  # type: ignore[arg-type]
        self._steps_since = latest
        with self._lock:
            for at, name, role, observed, predicted in rows:
                self.monitor.record_step(at, name, role, observed, predicted)

    # ---- what the server exposes (jaxserve.serving.admin.DeploymentAdmin) --------------------
    def apply_deployment(self, plan: DeploymentPlan) -> dict[str, object]:
        """Switch to `plan` now (blocking). Raises SwitchInProgressError, SwitchError, PlanError."""
        if self.switcher is None:
            raise SwitchUnsupportedError(
                "this server cannot switch deployments live (it runs without a switcher): restart it with the new plan"
            )
        report: SwitchReport = self.switcher.switch(plan)
        self.num_switches += 1
        self.last_replan_at = time.time()
        self.advised_plan = None
        out = report.to_dict()
        out["plan_id"] = plan_id(self.controller.plan)
        self.last_switch = out
        return out

    def can_switch(self) -> bool:
        return self.switcher is not None

    def max_plan_devices(self) -> int:
        """The bound on a posted plan: the embedded backend's devices; the parsers' cap elsewhere (Ray: the
        cluster's devices are its scheduler's to count, and a switch too big for them fails with a SwitchError)."""
        if self.switcher is not None and isinstance(self.switcher.builder, LocalDevices):
            return len(self.switcher.builder.devices)
        return MAX_PLAN_DEVICES

    def switch_busy(self) -> bool:
        return self.switcher is not None and self.switcher.busy

    def workload_snapshot(self) -> dict[str, object]:
        now = self.clock()
        with self._lock:
            monitor = self.monitor.snapshot(now)
            detector = self.detector.snapshot()
        return {
            "mode": self.config.mode,
            "plan": self.controller.plan.describe(),
            "plan_id": plan_id(self.controller.plan),
            "monitor": monitor,
            "detector": detector,
            "replan_busy": self._replanner is not None and self._replanner.busy,
            "num_rounds": self.num_rounds,
            "num_switches": self.num_switches,
            "last_decision": self.last_decision,
            "advised_plan": self.advised_plan.to_dict() if self.advised_plan is not None else None,
            "last_switch": self.last_switch,
        }

    def gauges(self) -> WorkloadGauges:
        now = self.clock()
        with self._lock:
            w = self.monitor.window(now)
        roles: tuple[Role, ...] = ("prefill", "decode", "colocated")
        return WorkloadGauges(
            window_rate_rps=w.rate,
            mean_prompt_tokens=w.input_lengths.mean(),
            mean_output_tokens=w.output_lengths.mean(),
            correction_factors={r: w.role_factor(r) for r in roles},
            last_replan_at=self.last_replan_at,
            plan_id=plan_id(self.controller.plan),
            plan=self.controller.plan.describe(),
        )


def planning_context(
    model_config: object,
    device: str,
    profile: str | None,
    num_devices: int,
    ttft_s: float,
    tpot_s: float,
    precisions: tuple[str | None, ...] = (None,),
) -> SearchContext:
    """The planner's fixed inputs for replanning this deployment (its workload comes from the window).

    `precisions`: the weight precisions a new plan may give an instance; `served_precisions(plan)` for a
    deployment (what it serves now, so a quantized deployment is not replanned at the checkpoint's precision)."""
    import numpy as np

    from placement.hardware import ClusterSpec, get_device
    from placement.latency import LatencyProvider, load_profile
    from placement.search import SearchContext
    from placement.slo import SloSpec
    from placement.workload import Workload

    spec = get_device(device)
    latency = LatencyProvider(model_config, spec, load_profile(profile) if profile else None)  # type: ignore[arg-type]
    cluster = ClusterSpec(spec, 1, num_devices)
    one = np.ones(1, dtype=np.int64)
    placeholder = Workload(np.zeros(1), one, one, 1.0)  # replaced by the window's in every round
    return SearchContext(latency, cluster, placeholder, SloSpec(ttft_s, tpot_s), max_pp=1, precisions=precisions)


def served_precisions(plan: DeploymentPlan) -> tuple[str | None, ...]:
    """The precisions `plan`'s instances serve at (None: the checkpoint's own), in `QUANTIZATIONS` order after
    None: the set a replan may choose from without changing what the operator chose to serve."""
    served = {inst.quantization for inst in plan.instances}
    return tuple(q for q in (None, *QUANTIZATIONS) if q in served)
