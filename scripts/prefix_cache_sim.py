#!/usr/bin/env python
"""Predicted goodput with and without prefix caching on a multi-turn chat workload (simulator only).

Defaults: OPT-13B on A100-80GB, latency from the `a100-80gb-distserve` profile, chatbot SLOs (TTFT
0.25 s, TPOT 0.1 s, 90 % joint), `placement.conversations.ConversationSpec()` conversations (8 shared
256-token system prompts, 2–8 turns, user text ~120 and answers ~200 tokens, 10 s mean think time
after each answer, closed loop), two 3-GPU deployments: the paper's chatbot placement (prefill tp2,
decode tp1) and one with a smaller prefill side (prefill tp1, decode 2 × tp1). Arms:

* `no cache` — every prompt prefilled and transferred in full (the plain simulator, exactly);
* `cache + routing` — prefix caches on all instances, cache-aware prefill/decode routing, partial
  pulls;
* `cache + routing + local<N>` — and conditional disaggregation: the decode instance prefills a
  prompt itself when it lacks fewer than N of its tokens.

Goodput is `placement.goodput.max_rate` over the same conversations replayed at each probed rate, the
verdict over the steady-state window (see `placement/prefix_sim.py`); hit rate, KV bytes moved and
TTFT are then measured for every arm of a deployment at one common rate (the first non-zero goodput
in arm order), so they compare identical traffic. `window rps` is the rate that really arrived in the
measurement window at that common rate (≈ the nominal rate when the set holds enough conversations).

    PYTHONPATH=. .venv/bin/python scripts/prefix_cache_sim.py [--conversations 1000] [--jobs 4] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jaxserve.core.plan import parse_deployment  # noqa: E402
from jaxserve.core.scheduling import PrefixPolicy  # noqa: E402
from models.config import get_config  # noqa: E402
from placement.conversations import ConversationSpec, generate_conversations  # noqa: E402
from placement.hardware import ClusterSpec, get_device  # noqa: E402
from placement.latency import LatencyProvider, load_profile  # noqa: E402
from placement.prefix_sim import compare_caching  # noqa: E402
from placement.simulator import SimOptions  # noqa: E402
from placement.slo import SloSpec  # noqa: E402

DEPLOYMENTS = "disagg:prefill=tp2,decode=tp1;disagg:prefill=tp1,decode=2xtp1"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="opt-13b")
    ap.add_argument("--device", default="a100-80gb")
    ap.add_argument("--profile", default="a100-80gb-distserve")
    ap.add_argument("--deployments", default=DEPLOYMENTS, help="';'-separated disagg deployments")
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--think-time", type=float, default=10.0, help="mean seconds from an answer to the next turn")
    ap.add_argument("--local", default="256", help="conditional-disaggregation thresholds (tokens), comma list")
    ap.add_argument("--ttft", type=float, default=0.25)
    ap.add_argument("--tpot", type=float, default=0.1)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="processes for the goodput searches of one deployment")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    device = get_device(args.device)
    latency = LatencyProvider(get_config(args.model, "float16"), device, load_profile(args.profile))
    cluster = ClusterSpec(device, 1, 8)
    spec = ConversationSpec(think_time_s=args.think_time)
    conversations = generate_conversations(spec, args.conversations, np.random.default_rng(args.seed))
    slo = SloSpec(args.ttft, args.tpot, args.attainment)
    arms = [("no cache", PrefixPolicy(enabled=False)), ("cache + routing", PrefixPolicy())]
    arms += [
        (f"cache + routing + local<{n}", PrefixPolicy(local_prefill_tokens=int(n))) for n in args.local.split(",") if n
    ]
    shared = conversations.at_rate(1.0)
    ideal = shared.ideal_hit_tokens(16) / int(shared.workload.input_lens.sum())
    start = time.perf_counter()
    results = []
    for spec_text in args.deployments.split(";"):
        plan = parse_deployment(spec_text).assign_devices(cluster.num_devices)
        rows = compare_caching(plan, latency, cluster, conversations, slo, arms, SimOptions(), jobs=args.jobs)
        results.append((plan, rows))
    elapsed = time.perf_counter() - start
    if args.json:
        out = [
            {"deployment": plan.describe(), "num_devices": plan.num_devices, "arm": r.name}
            | {k: v for k, v in dataclasses.asdict(r).items() if k not in ("name", "policy", "stats")}
            | dataclasses.asdict(r.stats)
            | {"hit_rate": r.stats.hit_rate, "transfer_share": r.stats.transfer_share}
            for plan, rows in results
            for r in rows
        ]
        print(json.dumps({"ideal_hit_rate": ideal, "rows": out}, indent=2))
        return 0
    print(
        f"{args.model} on {args.device} ({args.profile}); {len(shared)} requests in {conversations.num_conversations} "
        f"conversations (mean prompt {shared.workload.input_lens.mean():.0f} tokens, output "
        f"{shared.workload.output_lens.mean():.0f}; unbounded-cache hit rate {ideal:.1%}); "
        f"SLO TTFT <= {args.ttft:g} s, TPOT <= {args.tpot:g} s, {args.attainment:.0%} joint\n"
    )
    head = (
        f"| {'deployment':<34} | {'arm':<26} | goodput rps | rps/device | at rps | window rps | hit rate | "
        "KV GB moved | moved share | local | evictions | TTFT p50 ms | TTFT p90 ms | TPOT p90 ms |"
    )
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for plan, rows in results:
        for r in rows:
            s = r.stats
            print(
                f"| {plan.describe():<34} | {r.name:<26} | {r.goodput_rps:11.2f} | {r.goodput_rps_per_device:10.3f} | "
                f"{r.rate:6.2f} | {r.window_rate:10.2f} | {s.hit_rate:8.1%} | {s.kv_bytes_moved / 1e9:11.1f} | "
                f"{s.transfer_share:11.1%} | {s.num_local_prefills:5d} | "
                f"{s.num_prefill_evictions + s.num_decode_evictions:9d} | {r.ttft_p50_s * 1e3:11.1f} | "
                f"{r.ttft_p90_s * 1e3:11.1f} | {r.tpot_p90_s * 1e3:11.1f} |"
            )
    print(f"\n({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
