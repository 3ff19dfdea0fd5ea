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
    args = parser.parse_args()

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


def _chosen(plan_json: str) -> str:
    """The chosen deployment and its goodput, from `jaxserve plan --json`."""
    plan = json.loads(plan_json)
    instances = ",".join(f"{i['role']}:tp{i['tp']}pp{i['pp']}" for i in plan["instances"])
    return f"{instances} {plan['expected']['goodput_rps']:.6f} rps"


if __name__ == "__main__":
    main()
