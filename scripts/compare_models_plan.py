"""Plan two models on the same cluster and compare what the planner chooses: GQA (Llama-3.1-70B) against MHA (OPT-66B).

    .venv/bin/python scripts/compare_models_plan.py [--models llama-3.1-70b,opt-66b] [--nodes 4]
        [--ttft 0.4] [--tpot 0.1] [--num-requests 400] [--seeds 2] [--workers 2] [--json]

Both models on `--nodes` x 8 A100-80GB, latency from the A100 roofline (the Appendix-A form with
`AppendixCoefficients.roofline`: the A100 artifact profile has folded coefficients for OPT models only, so
both are judged by the same model-agnostic coefficients here), the paper's chatbot workload (ShareGPT lengths
capped at 2048 positions, the same 400 requests for both) at the chatbot SLOs of OPT-66B (TTFT 0.4 s,
TPOT 0.1 s, 90 %). For each model it prints the model's KV bytes per token, the tp degrees its K/V heads
allow, the KV pool per decode instance, the plan `jaxserve plan` would choose (with the best disaggregated
and colocated deployments and their goodput per device), and for the best disaggregated deployment, run at
its goodput to completion: the KV transfer's share of a request's latency and its P95.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from models.config import get_model_config, kv_heads_split, supports_tp
from placement.goodput import base_workload
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, kv_capacity_tokens
from placement.planner import choose_plan
from placement.search import SearchContext
from placement.simulator import SimOptions, simulate
from placement.slo import SloSpec

MAX_POSITIONS = 2048  # the paper's ShareGPT workload, capped at OPT's positions: the same requests for both


def compare(model: str, args: argparse.Namespace) -> dict[str, Any]:
    device = get_device("a100-80gb")
    cfg = get_model_config(model, "float16")
    latency = LatencyProvider(cfg, device)  # roofline
    cluster = ClusterSpec(device, args.nodes, 8)
    slo = SloSpec(args.ttft, args.tpot, 0.9)
    options = SimOptions()

    def workload(seed: int):
        return base_workload("sharegpt", args.num_requests, seed, max_positions=MAX_POSITIONS)

    ctx = SearchContext(latency, cluster, workload(args.seed), slo, options)
    start = time.perf_counter()
    report = choose_plan(ctx, workers=args.workers, reseed=lambda s: workload(args.seed + s), seeds=args.seeds)
    plan_s = time.perf_counter() - start
    plan = report.plan
    disagg_plan = plan if plan.kind == "disagg" else report.runner_up
    out: dict[str, Any] = {
        "model": cfg.name,
        "kv_heads": cfg.kv_heads,
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
        "tp_allowed": {
            tp: "split" if kv_heads_split(cfg, tp) else "replicated" for tp in range(1, 9) if supports_tp(cfg, tp)
        },
        "kv_pool_tokens": {tp: kv_capacity_tokens(cfg, device, tp, 1) for tp in range(1, 9) if supports_tp(cfg, tp)},
        "chosen": plan.describe(),
        "chosen_rps_per_device": report.goodput_per_device,
        "chosen_rps": report.goodput_rps,
        "disagg_best": disagg_plan.describe() if disagg_plan is not None else None,
        "disagg_rps_per_device": report.disagg_per_device,
        "colocated_best": report.colocated.plan.describe() if report.colocated else None,
        "colocated_rps_per_device": report.colocated.goodput_per_device if report.colocated else 0.0,
        "why": report.why,
        "sure": report.lead(),
        "plan_s": plan_s,
    }
    if disagg_plan is not None and report.disagg_per_device > 0:
        rate = report.disagg_per_device * disagg_plan.num_devices
        result = simulate(disagg_plan, latency, cluster, ctx.workload.with_rate(rate), None, options)
        moved = result.finished & ~np.isnan(result.transfer_end_at)  # one-token replies finish at prefill
        transfer = (result.transfer_end_at - result.transfer_start_at)[moved]
        e2e = (result.finish_at - result.arrival_at)[moved]
        out.update(
            transfer_rate_rps=rate,
            transfer_share=float(transfer.sum() / e2e.sum()),
            transfer_p95_ms=float(np.percentile(transfer, 95) * 1000),
            transfer_mean_ms=float(transfer.mean() * 1000),
            kv_bytes_per_request_mb=float(ctx.workload.input_lens.mean() * cfg.kv_bytes_per_token / 1e6),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-3.1-70b,opt-66b")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ttft", type=float, default=0.4)
    parser.add_argument("--tpot", type=float, default=0.1)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", type=int, default=2, help="workload samples the chosen plan and runner-up are re-run on"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [compare(m.strip(), args) for m in args.models.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{args.nodes} x 8 A100-80GB (roofline), ShareGPT ({args.num_requests} requests, <= {MAX_POSITIONS} positions), "
        f"TTFT <= {args.ttft:g} s, TPOT <= {args.tpot:g} s at 90 %; load average {os.getloadavg()[0]:.2f}\n"
    )
    print("| | " + " | ".join(r["model"] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    table = [
        ("K/V heads", lambda r: str(r["kv_heads"])),
        ("KV bytes per token", lambda r: f"{r['kv_bytes_per_token'] / 1024:.0f} KiB"),
        ("KV of a mean ShareGPT prompt", lambda r: f"{r.get('kv_bytes_per_request_mb', float('nan')):.0f} MB"),
        ("tp allowed (K/V heads)", lambda r: ", ".join(f"{tp} ({how})" for tp, how in r["tp_allowed"].items())),
        (
            "KV pool per instance, tokens",
            lambda r: ", ".join(f"tp{tp} {n:,}" for tp, n in r["kv_pool_tokens"].items() if n),
        ),
        ("chosen deployment", lambda r: f"`{r['chosen']}`"),
        ("predicted goodput per device", lambda r: f"{r['chosen_rps_per_device']:.3f} rps ({r['chosen_rps']:.2f} rps)"),
        ("best disaggregated", lambda r: f"`{r['disagg_best']}` {r['disagg_rps_per_device']:.3f} rps/device"),
        ("best colocated", lambda r: f"`{r['colocated_best']}` {r['colocated_rps_per_device']:.3f} rps/device"),
        (
            "KV transfer, share of latency (disagg. at its goodput)",
            lambda r: (
                f"{100 * r['transfer_share']:.2f} % (mean {r['transfer_mean_ms']:.1f} ms, P95 {r['transfer_p95_ms']:.1f} ms)"
                if "transfer_share" in r
                else "-"
            ),
        ),
        ("planning time", lambda r: f"{r['plan_s']:.1f} s"),
    ]
    for name, cell in table:
        print(f"| {name} | " + " | ".join(cell(r) for r in rows) + " |")
    for r in rows:
        print(f"\n{r['model']}: {r['why']}")
        if r["sure"]:
            print(f"  sure of it? {r['sure']}")


if __name__ == "__main__":
    main()
