"""Wall-time benchmark of the planner (pure CPU).

    .venv/bin/python scripts/bench_planner.py [--workers 2] [--num-requests 400] [--plan-reps 5]
        [--baseline DIR] [--only-plan]

0. The whole command a user runs, `jaxserve plan --model opt-175b --device a100-80gb --nodes 4
   --devices-per-node 8 --workload sharegpt --ttft 4 --tpot 0.2` (roofline coefficients, its default
   --seeds 2 ranges, start-up included), timed as a subprocess --plan-reps times with the load average
   before each run. Target (issue 28): <= 5 s on this 2-core machine. With `--baseline DIR` (a checkout
   of another revision, e.g. `git archive BASE | tar -x -C DIR`) the same command from DIR runs
   interleaved with this tree's (A B A B ...), and the two chosen plans are checked to be the same.
1. Algorithm 1 (high affinity) for OPT-175B over 4 nodes x 8 A100-80GB, roofline coefficients,
   ShareGPT at the OPT-175B chatbot SLOs (TTFT 4 s, TPOT 0.2 s, 90 %). Target: <= 10 s on 2 cores.
2. Algorithm 2 (low affinity) for the same. Target: <= 30 s.
3. One simulation of 10,000 ShareGPT requests through OPT-13B 2 prefill (tp1) + 1 decode (tp1) on the
   A100 profile, at 5 rps, run to completion (no early stop). Target: <= 2 s.

With `--scale` (issue 43) instead: the same `jaxserve plan` command at 4, 8, 16, 64 and 256 nodes of 8
(`--scale-nodes` to change them), each a subprocess timed for wall time and peak memory (the largest
resident set of the command and its worker processes), by units (the default) and, up to
`--whole-up-to` nodes, searching the whole cluster at once (`--unit-nodes 0`, the planner before units);
then one replan decision (`placement.replan_decision.replan`) on the 64 x 8 plan. Targets: 64 x 8 <= 5 s,
256 x 8 <= 10 s, memory <= 1 GB at 256 x 8, per-device goodput within 5 % of the 4 x 8 plan's, a replan
decision at 64 x 8 <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.core.plan import parse_deployment
from models.config import get_config
from placement.goodput import base_workload
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, load_profile
from placement.search import SearchContext, algorithm1, algorithm2
from placement.simulator import SimOptions, simulate
from placement.slo import SloSpec
from placement.workload import generate

ROOT = Path(__file__).resolve().parent.parent
PLAN_ARGS = "--model opt-175b --device a100-80gb --nodes 4 --devices-per-node 8 --workload sharegpt --ttft 4 --tpot 0.2"


def main() -> None:
    parser = argparse.ArgumentParser(description="planner wall-time benchmark")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=400, help="requests per goodput probe in the searches")
    parser.add_argument("--plan-reps", type=int, default=5, help="times to run the whole `jaxserve plan` (0: skip)")
    parser.add_argument("--baseline", default=None, help="a checkout of another revision to time against (A B A B)")
    parser.add_argument("--only-plan", action="store_true", help="only the whole `jaxserve plan` command (0.)")
    parser.add_argument("--scale", action="store_true", help="plan time and memory against cluster size (issue 43)")
    parser.add_argument("--scale-nodes", default="4,8,16,64,256", help="with --scale: node counts, comma-separated")
    parser.add_argument("--whole-up-to", type=int, default=16, help="with --scale: also --unit-nodes 0 up to N nodes")
    args = parser.parse_args()
    if args.scale:
        scale(args)
        return

    if args.plan_reps:
        trees = {"this tree": ROOT} if not args.baseline else {"baseline": Path(args.baseline), "this tree": ROOT}
        walls: dict[str, list[float]] = {name: [] for name in trees}
        cpus: dict[str, list[float]] = {name: [] for name in trees}  # the command and its workers, all processes
        plans: dict[str, set[str]] = {name: set() for name in trees}
        plan_path = os.path.join(tempfile.mkdtemp(), "plan.json")
        for rep in range(args.plan_reps):
            for name, tree in trees.items():  # interleaved: A B A B ...
                load = os.getloadavg()[0]
                cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                # the table as a user gets it (with --json the plan skips the ranges over seeds); -o: the plan
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "jaxserve.cli",
                        "plan",
                        *PLAN_ARGS.split(),
                        "--no-progress",
                        "-o",
                        plan_path,
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    cwd=tree,
                    env={**os.environ, "PYTHONPATH": str(tree)},
                )
                wall = time.perf_counter() - start
                cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
                walls[name].append(wall)
                cpus[name].append(cpu)
                plans[name].add(_chosen(Path(plan_path).read_text()))
                print(
                    f"  rep {rep + 1} {name:<9} {wall:6.2f} s wall, {cpu:6.2f} s CPU  (load average {load:.2f} before)"
                )
        print(f"jaxserve plan {PLAN_ARGS} (target <= 5 s):")
        for name, w in walls.items():
            print(
                f"  {name:<9} wall min {min(w):.2f} s, median {statistics.median(w):.2f} s, max {max(w):.2f} s; "
                f"CPU median {statistics.median(cpus[name]):.2f} s; {len(w)} runs; chosen {' | '.join(sorted(plans[name]))}"
            )
        if args.baseline and plans["baseline"] != plans["this tree"]:
            print("  the chosen plans DIFFER")
        print(f"  load average now {os.getloadavg()[0]:.2f}")
        if args.only_plan:
            return

    a100 = get_device("a100-80gb")
    latency = LatencyProvider(get_config("opt-175b", "float16"), a100)  # roofline
    ctx = SearchContext(
        latency, ClusterSpec(a100, 4, 8), base_workload("sharegpt", args.num_requests, 0), SloSpec(4.0, 0.2)
    )

    start = time.perf_counter()
    r1 = algorithm1(ctx, workers=args.workers)
    t1 = time.perf_counter() - start
    print(f"Algorithm 1, OPT-175B, 4 x 8 A100: {t1:6.2f} s (target 10 s), {len(r1.candidates)} phase searches")
    print(f"  chosen {r1.plan.describe()}: {r1.goodput_per_device:.3f} rps/GPU; {r1.reason}")

    start = time.perf_counter()
    r2 = algorithm2(ctx, workers=args.workers)
    t2 = time.perf_counter() - start
    print(f"Algorithm 2, OPT-175B, 4 x 8 A100: {t2:6.2f} s (target 30 s), {len(r2.candidates)} joint searches")
    print(f"  chosen {r2.plan.describe()}: {r2.goodput_per_device:.3f} rps/GPU; {r2.reason}")

    lp13 = LatencyProvider(get_config("opt-13b", "float16"), a100, load_profile("a100-80gb-distserve"))
    workload = generate("sharegpt", 5.0, 10_000, np.random.default_rng(0))
    plan = parse_deployment("disagg:prefill=2xtp1,decode=tp1")
    start = time.perf_counter()
    result = simulate(plan, lp13, ClusterSpec(a100, 1, 8), workload, None, SimOptions(stop_early=False))
    t3 = time.perf_counter() - start
    s = result.summary(SloSpec(0.25, 0.1))
    print(
        f"Simulate 10,000 ShareGPT requests, OPT-13B 2P1D at 5 rps: {t3:6.2f} s (target 2 s), {result.num_events} events, "
        f"attainment {s['attainment']:.1%}"
    )


def _timed_plan(nodes: int, extra: list[str], workers: int) -> tuple[float, float, dict[str, object]]:
    """(wall s, peak MiB, plan JSON) of one `jaxserve plan` at `nodes` x 8, as a user runs it."""
    plan_path = os.path.join(tempfile.mkdtemp(), "plan.json")
    argv = PLAN_ARGS.replace("--nodes 4", f"--nodes {nodes}").split()
    cmd = [sys.executable, "-m", "jaxserve.cli", "plan", *argv, "--no-progress", "--workers", str(workers)]
    # the command measures its own peak: the larger of its process's and its (waited-for) workers'
    probe = (
        "import resource, sys\n"
        "from jaxserve.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "usage = [resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]\n"
        "print('MAXRSS', max(usage), file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", probe, *cmd[3:], *extra, "-o", plan_path],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wall = time.perf_counter() - start
    rss_kib = int(next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("MAXRSS")))
    return wall, rss_kib / 1024, json.loads(Path(plan_path).read_text())


def scale(args: argparse.Namespace) -> None:
    """Plan time and memory against cluster size, by units and (small clusters) whole; a replan at 64 x 8."""
    nodes_list = [int(n) for n in args.scale_nodes.split(",")]
    command = PLAN_ARGS.replace("--nodes 4", "--nodes N")
    print(f"jaxserve plan {command} --workers {args.workers}; load average {os.getloadavg()[0]:.2f}")
    print("rps/device: the plan's prediction (a replicated plan: two units simulated together); units alone: the")
    print("unit search's goodput times the copies (no pooling across units)")
    print(f"{'nodes x 8':>9} {'search':>7} {'wall s':>7} {'peak MiB':>9} {'rps/device':>11} {'units alone':>12}  plan")
    per_device: dict[int, float] = {}
    plans: dict[int, dict[str, object]] = {}
    for nodes in nodes_list:
        modes: list[tuple[str, list[str]]] = [("units", [])] + (
            [("whole", ["--unit-nodes", "0"])] if nodes <= args.whole_up_to else []
        )
        for name, extra in modes:
            wall, mib, plan = _timed_plan(nodes, extra, args.workers)
            expected = plan["expected"]
            assert isinstance(expected, dict)
            pd = float(expected["goodput_rps_per_device"])
            devices = float(expected["goodput_rps"]) / pd
            alone = (
                float(expected["search_goodput_rps"] if "search_goodput_rps" in expected else pd * devices) / devices
            )
            if name == "units":
                per_device[nodes], plans[nodes] = alone, plan
            described = _chosen(json.dumps(plan)).split(" ")[0]
            counts: dict[str, int] = {}
            for inst in described.split(","):
                counts[inst] = counts.get(inst, 0) + 1
            short = ", ".join(f"{n} x {k}" for k, n in counts.items())
            print(f"{nodes:>9} {name:>7} {wall:>7.2f} {mib:>9.0f} {pd:>11.4f} {alone:>12.4f}  {short}", flush=True)
    if nodes_list and 4 in per_device:
        base = per_device[4]
        print("units alone, per device, against the 4 x 8 plan's: " + ", ".join(
            f"{n} x 8 {100 * (pd / base - 1):+.1f} %" for n, pd in per_device.items()
        ))  # fmt: skip
    if 64 in plans:
        took = _timed_replan(plans[64], args.workers)
        print(f"replan decision on the 64 x 8 plan (--workers {args.workers}): {took:.2f} s")
    print(f"load average now {os.getloadavg()[0]:.2f}")


def _timed_replan(plan_json: dict[str, object], workers: int) -> float:
    """Seconds of one replan round (search a candidate, estimate the current plan, decide) on the 64 x 8 plan,
    the window a minute of ShareGPT at 60 % of the plan's goodput."""
    from jaxserve.core.plan import DeploymentPlan
    from jaxserve.core.workload_monitor import MonitorConfig, WorkloadMonitor
    from placement.replan_decision import ReplanConfig, ReplanJob, replan
    from placement.workload import get_length_distribution

    current = DeploymentPlan.from_json(json.dumps(plan_json))
    a100 = get_device("a100-80gb")
    latency = LatencyProvider(get_config("opt-175b", "float16"), a100)
    ctx = SearchContext(latency, ClusterSpec(a100, 64, 8), base_workload("sharegpt", 400, 0), SloSpec(4.0, 0.2))
    rate, seconds = 0.6 * current.expected["goodput_rps"], 60
    w = generate(get_length_distribution("sharegpt"), rate, int(rate * seconds), np.random.default_rng(1))
    monitor = WorkloadMonitor(MonitorConfig(window_s=seconds, slice_s=seconds / 4))
    for at, n_in, n_out in zip(w.arrival_at, w.input_lens, w.output_lens, strict=True):
        monitor.record_arrival(float(at), int(n_in))
        monitor.record_finish(float(at), int(n_out), None, None)
    config = ReplanConfig(workers=workers)
    job = ReplanJob(current, monitor.window(float(seconds)), ctx, config, requested_at=float(seconds))
    start = time.perf_counter()
    out = replan(job)
    took = time.perf_counter() - start
    if out.decision is None:
        raise RuntimeError(f"the replan round failed: {out.error}")
    print(f"  {'; '.join(out.decision.reasons)}")
    return took


def _chosen(plan_json: str) -> str:
    """The chosen deployment and its goodput, from `jaxserve plan --json`."""
    plan = json.loads(plan_json)
    instances = ",".join(f"{i['role']}:tp{i['tp']}pp{i['pp']}" for i in plan["instances"])
    return f"{instances} {plan['expected']['goodput_rps']:.6f} rps"


if __name__ == "__main__":
    main()
