"""`serve --replan`: the replanning loop the flags describe (`jaxserve/tools/replan_loop.py` is the loop)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.runtime.instances import EngineFactory
    from jaxserve.tools.replan_loop import ReplanLoop


def build_replan_loop(
    args: argparse.Namespace, controller: object, builder: object, weights_load_s: float
) -> ReplanLoop:
    """The replanning loop for `--replan` (monitor always; planner context for advise/auto). `builder`: where a
    live switch's new instances come from (`InstanceBuilder`, or the embedded backend's engine factory)."""
    import jax

    from jaxserve.core.workload_monitor import DetectorConfig, MonitorConfig
    from jaxserve.runtime.controller import Controller
    from jaxserve.runtime.switch import InstanceBuilder, PlanSwitcher
    from jaxserve.tools.replan_loop import ReplanLoop, ReplanLoopConfig, planning_context, served_precisions

    assert isinstance(controller, Controller)
    monitor = MonitorConfig(window_s=args.window, slice_s=args.slice, ttft_slo_s=args.ttft, tpot_slo_s=args.tpot)
    detector = DetectorConfig(sustain_s=args.sustain, cooldown_s=args.cooldown)
    config = ReplanLoopConfig(mode=args.replan, monitor=monitor, detector=detector)
    switcher = None
    if builder is not None:
        how: InstanceBuilder | EngineFactory = builder  # type: ignore[assignment]
        switcher = PlanSwitcher(controller, how, drain_timeout_s=args.drain_timeout)
    context = None
    if args.replan != "off" or args.profile:  # off with a profile: the correction factors are still measured
        context = planning_context(controller.model_config, args.device, args.profile, len(jax.devices()),
                                   args.ttft, args.tpot, served_precisions(controller.plan))  # fmt: skip
    if args.replan == "off":
        latency = context.latency if context is not None else None
        return ReplanLoop(controller, config, switcher=switcher, latency=latency, weights_load_s=weights_load_s)
    return ReplanLoop(controller, config, switcher=switcher, context=context, weights_load_s=weights_load_s)
