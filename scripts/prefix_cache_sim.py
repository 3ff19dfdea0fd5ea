#!/usr/bin/env python
"""Predicted goodput with and without prefix caching on a multi-turn chat workload (simulator only).

Defaults: OPT-13B on one node of eight A100-80GB with the paper's chatbot placement scaled to the
node (prefill 2 × tp2, decode 4 × tp1), latency from the `a100-80gb-distserve` profile, chatbot SLOs
(TTFT 0.25 s, TPOT 0.1 s, 90 % joint), `placement.conversations.ConversationSpec()` conversations
(8 shared 256-token system prompts, 2–8 turns, user text ~120 and answers ~200 tokens, 20 s mean
think time). Arms:

* `no cache` — every prompt prefilled and transferred in full (the plain simulator, exactly);
* `cache + routing` — prefix caches on all instances, cache-aware prefill/decode routing, partial
  pulls;
* `cache + routing + local<N>` — and conditional disaggregation: the decode instance prefills a
  prompt itself when it lacks fewer than N of its tokens.

Goodput is `placement.goodput.max_rate` over the same conversations replayed at each probed rate;
hit rate, KV bytes moved and TTFT are then measured for every arm at one common rate (the no-cache
goodput), so they compare identical traffic.

    PYTHONPATH=. .venv/bin/python scripts/prefix_cache_sim.py [--conversations 400] [--local 128,512] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jaxserve.plan import parse_deployment  # noqa: E402
from jaxserve.scheduling import PrefixPolicy  # noqa: E402
from models.config import get_config  # noqa: E402
from placement.conversations import ConversationSpec, generate_conversations  # noqa: E402
from placement.hardware import ClusterSpec, get_device  # noqa: E402
from placement.latency import LatencyProvider, load_profile  # noqa: E402
from placement.prefix_sim import compare_caching  # noqa: E402
from placement.simulator import SimOptions  # noqa: E402
from placement.slo import SloSpec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opt-13b")
    ap.add_argument("--device", default="a100-80gb")
    ap.add_argument("--profile", default="a100-80gb-distserve")
    ap.add_argument("--deployment", default="disagg:prefill=2xtp2,decode=4xtp1")
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--think-time", type=float, default=20.0, help="mean seconds between a conversation's turns")
    ap.add_argument("--local", default="128,512", help="conditional-disaggregation thresholds (tokens), comma list")
    ap.add_argument("--ttft", type=float, default=0.25)
    ap.add_argument("--tpot", type=float, default=0.1)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    device = get_device(args.device)
    latency = LatencyProvider(get_config(args.model, "float16"), device, load_profile(args.profile))
    cluster = ClusterSpec(device, 1, 8)
    plan = parse_deployment(args.deployment).assign_devices(cluster.num_devices)
    spec = ConversationSpec(think_time_s=args.think_time)
    conversations = generate_conversations(spec, args.conversations, np.random.default_rng(args.seed))
    slo = SloSpec(args.ttft, args.tpot, args.attainment)
    arms = [("no cache", PrefixPolicy(enabled=False)), ("cache + routing", PrefixPolicy())]
    arms += [
        (f"cache + routing + local<{n}", PrefixPolicy(local_prefill_tokens=int(n))) for n in args.local.split(",") if n
    ]
    start = time.perf_counter()
    rows = compare_caching(plan, latency, cluster, conversations, slo, arms, SimOptions())
    elapsed = time.perf_counter() - start
    shared = conversations.at_rate(1.0)
    ideal = shared.ideal_hit_tokens(16) / int(shared.workload.input_lens.sum())
    if args.json:
        out = [
            {
                "arm": r.name,
                "goodput_rps": r.goodput_rps,
                "goodput_rps_per_device": r.goodput_rps_per_device,
                "rate": r.rate,
                "hit_rate": r.stats.hit_rate,
                "kv_bytes_moved": r.stats.kv_bytes_moved,
                "transfer_share": r.stats.transfer_share,
                "local_prefills": r.stats.num_local_prefills,
                "evictions": r.stats.num_prefill_evictions + r.stats.num_decode_evictions,
                "ttft_p50_s": r.ttft_p50_s,
                "ttft_p90_s": r.ttft_p90_s,
                "tpot_p90_s": r.tpot_p90_s,
                "attainment": r.attainment,
            }
            for r in rows
        ]
        print(json.dumps({"ideal_hit_rate": ideal, "rows": out}, indent=2))
        return 0
    print(
        f"{args.model} on {args.device} ({args.profile}), {plan.describe()} on {plan.num_devices} devices; "
        f"{len(shared)} requests in {conversations.num_conversations} conversations "
        f"(mean prompt {shared.workload.input_lens.mean():.0f} tokens, unbounded-cache hit rate {ideal:.1%}); "
        f"SLO TTFT <= {args.ttft:g} s, TPOT <= {args.tpot:g} s, {args.attainment:.0%} joint"
    )
    print(f"stats at a common rate of {rows[0].rate:.2f} rps (the no-cache goodput)\n")
    head = (
        f"| {'arm':<28} | goodput rps | rps/device | hit rate | KV GB moved | moved share | local | "
        f"evictions | TTFT p50 ms | TTFT p90 ms | TPOT p90 ms |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        s = r.stats
        print(
            f"| {r.name:<28} | {r.goodput_rps:11.2f} | {r.goodput_rps_per_device:10.3f} | {s.hit_rate:8.1%} | "
            f"{s.kv_bytes_moved / 1e9:11.1f} | {s.transfer_share:11.1%} | {s.num_local_prefills:5d} | "
            f"{s.num_prefill_evictions + s.num_decode_evictions:9d} | {r.ttft_p50_s * 1e3:11.1f} | "
            f"{r.ttft_p90_s * 1e3:11.1f} | {r.tpot_p90_s * 1e3:11.1f} |"
        )
    print(f"\n({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
