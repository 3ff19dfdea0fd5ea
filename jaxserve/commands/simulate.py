"""`jaxserve simulate`: run the discrete-event simulator for one deployment over a workload.

With `--rate R` it reports SLO attainment (when SLOs are given), TTFT/TPOT percentiles and the mean
per-phase breakdown; with `--goodput` it searches the highest rate meeting the attainment target and
reports it in total and per device. With `--timevarying diurnal|trace.jsonl` it replays a day (or a
trace) under a static plan for the peak, one for the average and the replanning loop, and reports
attainment, goodput and devices per hour (see placement/replan_experiment.py).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxserve.commands.planner_args import add_common_arguments

    add_common_arguments(parser)
    parser.add_argument(
        "--deployment",
        help="colocated:tp1[,chunk=N] | disagg:prefill=GROUP,decode=GROUP | plan.json (required unless --timevarying)",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="arrival rate, requests/s")
    mode.add_argument(
        "--goodput", action="store_true", help="search the max rate meeting --ttft/--tpot at --attainment"
    )
    mode.add_argument(
        "--timevarying",
        metavar="diurnal|TRACE.jsonl",
        help="replay a generated day (or a trace) under static-for-peak, static-for-average and replanning",
    )
    parser.add_argument("--hour-s", type=float, default=3600.0, help="--timevarying: seconds per hour of the cycle")
    parser.add_argument("--peak-rps", type=float, default=64.0, help="--timevarying diurnal: rate at 14:00")
    parser.add_argument("--trough-rps", type=float, default=12.0, help="--timevarying diurnal: rate at 02:00")
    parser.add_argument("--trace-out", default=None, help="write the simulated workload as JSONL")


def run(args: argparse.Namespace) -> int:
    from jaxserve.commands.planner_args import inputs_from_args
    from jaxserve.core.plan import PlanError, parse_deployment
    from models.config import tp_problems
    from placement.context import UsageError
    from placement.goodput import GoodputSearch, max_rate
    from placement.latency import DeploymentKind, ProfileError
    from placement.precision import PrecisionError, check_supported
    from placement.simulator import PHASES, simulate

    if args.timevarying:
        return _run_timevarying(args)
    try:
        if not args.deployment:
            raise UsageError("--deployment is required (unless --timevarying)")
        latency, cluster, slo, options, workload = inputs_from_args(
            args, 2000 if args.goodput else 1000, slo_required=bool(args.goodput)
        )
        if args.rate is not None and args.rate <= 0:
            raise UsageError("--rate must be positive")
        try:
            plan = parse_deployment(args.deployment)
            plan = plan if plan.instances[0].devices is not None else plan.assign_devices(cluster.num_devices)
        except PlanError as e:
            raise UsageError(str(e)) from None
        engine: DeploymentKind = "colocated" if plan.kind == "colocated" else "disagg"
        for inst in plan.instances:
            problems = tp_problems(latency.cfg, inst.tp)
            if problems:
                raise UsageError(f"{latency.cfg.name} cannot be sharded tp{inst.tp}: " + "; ".join(problems))
            if not latency.supports(engine, inst.tp):
                raise UsageError(
                    f"profile {args.profile} has no {engine} coefficients for {latency.cfg.name} tp{inst.tp}"
                )
            try:  # a plan file's precision the device cannot run (fp8 on an A100)
                check_supported(inst.quantization, latency.device)
            except PrecisionError as e:
                raise UsageError(f"{inst.role} instance: {e}") from None
    except UsageError as e:
        print(f"jaxserve simulate: error: {e}", file=sys.stderr)
        return 2

    try:
        if args.goodput:
            assert slo is not None
            rate = max_rate(GoodputSearch(plan, latency, cluster, workload, slo, options))
            out = {
                "deployment": plan.describe(),
                "num_devices": plan.num_devices,
                "goodput_rps": rate,
                "goodput_rps_per_device": rate / plan.num_devices,
                "ttft_slo_s": slo.ttft_s,
                "tpot_slo_s": slo.tpot_s,
                "attainment_target": slo.attainment,
                "slo_mode": slo.mode,
                "num_requests": len(workload),
            }
            if args.json:
                print(json.dumps(out, indent=2))
            else:
                print(
                    f"{plan.describe()} on {plan.num_devices} device(s): goodput {rate:.3f} rps = "
                    f"{rate / plan.num_devices:.3f} rps/device (TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s, "
                    f"{slo.mode}, {slo.attainment:.0%})"
                )
            return 0
        trace = workload.with_rate(args.rate)
        if args.trace_out:
            trace.to_jsonl(args.trace_out)
        result = simulate(plan, latency, cluster, trace, None, options)
    except (ProfileError, PlanError) as e:
        print(f"jaxserve simulate: error: {e}", file=sys.stderr)
        return 1
    summary = result.summary(slo)
    summary["rate"] = args.rate
    if args.json:
        print(json.dumps({"deployment": plan.describe(), "num_devices": plan.num_devices, **summary}, indent=2))
        return 0
    print(f"{plan.describe()} on {plan.num_devices} device(s), {len(trace)} requests at {args.rate:g} rps")
    if slo is not None:
        print(
            f"SLO attainment ({slo.mode}, TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s): {summary['attainment']:.1%}"
        )
    if result.num_finished:
        for metric in ("ttft_s", "tpot_s"):
            p = [summary[f"{metric}_p{q}"] for q in (50, 90, 99)]
            print(
                f"{metric[:4].upper()}  p50 {p[0] * 1000:8.1f} ms   p90 {p[1] * 1000:8.1f} ms   p99 {p[2] * 1000:8.1f} ms"
            )
        print("mean time per phase: " + ", ".join(f"{ph} {summary[f'{ph}_mean_s'] * 1000:.1f} ms" for ph in PHASES))
    return 0


def _run_timevarying(args: argparse.Namespace) -> int:
    import math

    import numpy as np

    from jaxserve.commands.planner_args import inputs_from_args
    from placement.context import UsageError
    from placement.replan_experiment import Experiment, loop_warnings, run_experiment
    from placement.timevarying import DiurnalSpec, generate_diurnal
    from placement.workload import Workload

    try:
        latency, cluster, slo, options, _ = inputs_from_args(args, 1000, slo_required=True)
        assert slo is not None
        if args.hour_s <= 0:
            raise UsageError("--hour-s must be positive")
        if args.timevarying == "diurnal":
            spec = DiurnalSpec(peak_rps=args.peak_rps, trough_rps=args.trough_rps)
            trace = generate_diurnal(spec, args.hour_s, np.random.default_rng(args.seed))
        elif args.timevarying.endswith(".jsonl"):
            trace = Workload.from_jsonl(args.timevarying)  # arrival_at: seconds from the trace's start
        else:
            raise UsageError(f"--timevarying takes diurnal or a .jsonl trace, not {args.timevarying!r}")
    except (UsageError, ValueError, OSError) as e:
        print(f"jaxserve simulate: error: {e}", file=sys.stderr)
        return 2
    hours = max(1, math.ceil(float(trace.arrival_at[-1]) / args.hour_s + 1e-9))
    exp = Experiment(
        latency, cluster, slo, hour_s=args.hour_s, num_hours=hours,
        options=options, seed=args.seed,
    )  # fmt: skip
    for warning in loop_warnings(exp, trace):
        print(f"warning: {warning}", file=sys.stderr)
    result = run_experiment(exp, trace)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=float))
    else:
        print(result.table())
    return 0
