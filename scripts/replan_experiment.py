"""The diurnal replanning experiment (issue 14): static for the peak, static for the average, adaptive.

OPT-13B on the DistServe A100 coefficients, a day whose rate follows a cosine (trough at 02:00, peak
at 14:00) and whose mix moves from chat (ShareGPT-like) by day to long summarisation (LongBench-like)
at night. Writes the Markdown table (stdout, and `--json` for everything), and the figure.

    PYTHONPATH=. python scripts/replan_experiment.py --plot docs/replanning.png

`--seed N` draws another day (and other planning samples); `--replot day.json --plot out.png` redraws
the figure from an earlier run's `--json` without simulating again.

`--hour-s 600` (the default) compresses each hour to 10 simulated minutes (see placement/replan_experiment.py
for what scales with it); `--hour-s 3600` replays real hours (about 6x the run time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.config import get_config
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, load_profile
from placement.replan_experiment import Experiment, loop_warnings, run_experiment
from placement.slo import SloSpec
from placement.timevarying import DiurnalSpec, generate_diurnal
from placement.workload import Workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hour-s", type=float, default=600.0, help="simulated seconds per hour of the cycle")
    p.add_argument("--hours", type=int, default=24)
    p.add_argument("--peak-rps", type=float, default=DiurnalSpec.peak_rps)
    p.add_argument("--trough-rps", type=float, default=DiurnalSpec.trough_rps)
    p.add_argument("--trace", default=None, help="replay this JSONL trace instead of the generated day")
    p.add_argument("--ttft", type=float, default=0.25)
    p.add_argument("--tpot", type=float, default=0.1)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--inter-node-gbps", type=float, default=800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the full result (rows, totals, plans, decisions) here")
    p.add_argument("--plot", default=None, help="write the figure here (PNG)")
    p.add_argument("--replot", default=None, help="only draw --plot from this --json file of an earlier run")
    args = p.parse_args(argv)
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot")
        plot(json.loads(Path(args.replot).read_text()), args.plot)
        return 0

    cfg = get_config("opt-13b", "float16")
    device = get_device("a100-80gb")
    latency = LatencyProvider(cfg, device, load_profile("a100-80gb-distserve"))
    cluster = ClusterSpec(device, args.nodes, 8, inter_node_bandwidth=args.inter_node_gbps * 1e9 / 8)
    exp = Experiment(
        latency, cluster, SloSpec(args.ttft, args.tpot), hour_s=args.hour_s, num_hours=args.hours, seed=args.seed
    )
    if args.trace:
        trace = Workload.from_jsonl(args.trace)
    else:
        spec = DiurnalSpec(peak_rps=args.peak_rps, trough_rps=args.trough_rps, hours=args.hours)
        trace = generate_diurnal(spec, args.hour_s, np.random.default_rng(args.seed))
    for warning in loop_warnings(exp, trace):
        print(f"warning: {warning}", file=sys.stderr)
    started = time.perf_counter()
    result = run_experiment(exp, trace)
    elapsed = time.perf_counter() - started
    print(result.table())
    print(f"\n{len(trace)} requests, {args.hours} hours of {args.hour_s:g} s; {elapsed:.0f} s wall")
    for name, run in result.runs.items():
        print(f"{name}: {run.why}")
        for e in run.epochs:
            print(f"  from hour {e.serve_from / exp.hour_s:5.2f}: {e.plan.describe()} ({e.plan.num_devices} devices)")
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1, default=float) + "\n")
    if args.plot:
        plot(result.to_dict(), args.plot)
    return 0


def plot(result: dict[str, Any], path: str) -> None:
    """The figure, from a result's `to_dict()` (or the `--json` file of an earlier run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["hours"]
    totals = result["totals"]
    policies = list(totals)
    hours = np.array([r["hour"] for r in rows]) + 0.5
    colors = {"peak": "tab:red", "average": "tab:orange", "adaptive": "tab:blue"}
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    ax.plot(hours, [r["rate_rps"] for r in rows], "k-", label="arrival rate (rps)")
    ax.set_ylabel("requests / s")
    ax2 = ax.twinx()
    ax2.plot(hours, [r["input_len_mean"] for r in rows], "k--", label="mean prompt (tokens)")
    ax2.set_ylabel("mean prompt tokens")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{result['model']}, A100 coefficients: a day of chat by day, summarisation at night")
    for name in policies:
        t = totals[name]
        label = f"{name}: {t['device_hours']:.0f} device-h, {t['hours_meeting_target']:.0f}/{len(rows)} h ok"
        edges = np.arange(len(rows) + 1)
        axes[1].stairs([r["devices"][name] for r in rows], edges, color=colors.get(name), label=label, lw=1.5)
        attain = [100 * r["attainment"][name] for r in rows]
        axes[2].plot(hours, attain, "o-", ms=3, color=colors.get(name), label=name)
    axes[1].set_ylabel("devices held (hour mean)")
    axes[1].legend(fontsize=8)
    axes[2].axhline(100 * result["slo"]["attainment"], color="gray", ls=":", label="target")
    axes[2].set_ylabel("SLO attainment (%)")
    axes[2].set_xlabel("hour of day")
    axes[2].set_ylim(0, 102)
    axes[2].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
