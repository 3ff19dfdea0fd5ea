"""Print our reproductions of DistServe's published numbers beside the paper's (A100-80GB profile).

    .venv/bin/python scripts/reproduce_paper.py [--quick]

Figure 1 (OPT-13B, 512 in / 64 out, P90 TTFT <= 0.4 s, P90 TPOT <= 0.04 s), the quick-start case of
the public simulator, and Table 3's OPT-13B placement (ShareGPT, chatbot SLOs).
"""

from __future__ import annotations

import argparse
import time

from placement.paper import (
    PAPER_FIGURE1,
    PUBLIC_SIMULATOR_FIGURE1,
    PUBLIC_SIMULATOR_QUICKSTART_PER_GPU,
    figure1,
    quickstart,
    table3_opt13b,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per simulation")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    n_fig, n_search = (300, 200) if args.quick else (1000, 400)

    start = time.perf_counter()
    f = figure1(n_fig)
    print("Figure 1: OPT-13B on A100-80GB, 512 in / 64 out, P90 TTFT <= 0.4 s, P90 TPOT <= 0.04 s (max rate, rps)")
    print(f"  {'deployment':<28} {'ours':>8} {'public sim':>10} {'paper':>8}")
    pub = PUBLIC_SIMULATOR_FIGURE1
    rows = [
        ("colocated, 1 GPU", f.colocated, pub["colocated"], PAPER_FIGURE1["colocated"]),
        ("prefill only, 1 GPU", f.prefill_only, pub["prefill_only"], PAPER_FIGURE1["prefill_only"]),
        ("decode only, 1 GPU", f.decode_only, float("nan"), PAPER_FIGURE1["decode_only"]),
        ("2 prefill + 1 decode GPUs", f.two_prefill_one_decode, pub["2p1d"], PAPER_FIGURE1["2p1d"]),
        ("  per GPU", f.two_prefill_one_decode / 3, pub["2p1d"] / 3, PAPER_FIGURE1["2p1d"] / 3),
    ]
    for name, ours, public, paper in rows:
        print(f"  {name:<28} {ours:8.2f} {public:10.2f} {paper:8.2f}")
    print("  (public sim: DistServe's simdistserve measured by us on the same setting, docs/public-simulator.md)")
    print(
        f"  2P1D per GPU / colocated:    {f.disagg_per_device_gain:8.2f}x {3.3 / 1.6:7.2f}x   ({time.perf_counter() - start:.1f} s)"
    )

    start = time.perf_counter()
    q = quickstart(n_search, args.workers)
    print(
        "\nQuick start of the public simulator: OPT-13B, ShareGPT, P90 TTFT <= 0.2 s, P90 TPOT <= 0.1 s, 1 node x 4 A100"
    )
    p, d = q.plan.of_role("prefill")[0], q.plan.of_role("decode")[0]
    print(f"  ours:  prefill {p.shape}, decode {d.shape}, {q.goodput_per_device:.2f} rps per GPU ({q.plan.describe()})")
    print(
        f"  public simulator (measured, docs/public-simulator.md): prefill tp2, decode tp1, "
        f"{PUBLIC_SIMULATOR_QUICKSTART_PER_GPU:.2f} rps per GPU"
    )
    print(f"  paper: prefill tp2, decode tp1, about 1.56 rps per GPU   ({time.perf_counter() - start:.1f} s)")

    for max_pp, label in ((1, "tp only (pp = 1)"), (None, "tp x pp")):
        start = time.perf_counter()
        t = table3_opt13b(max_pp=max_pp, num_requests=n_search, workers=args.workers)
        p, d = t.plan.of_role("prefill")[0], t.plan.of_role("decode")[0]
        print(f"\nTable 3, OPT-13B, ShareGPT, TTFT <= 0.25 s, TPOT <= 0.1 s, 90 % joint, 4 x 8 A100, {label}")
        best = sorted(t.candidates, key=lambda c: -c.per_device)
        for kind in ("prefill", "decode"):
            top = [c for c in best if c.kind == kind][:3]
            print(f"  top {kind}: " + ", ".join(f"{c.instance.shape} {c.per_device:.2f}" for c in top) + " rps/GPU")
        print(
            f"  ours:  prefill {p.shape}, decode {d.shape}  ({t.plan.describe()}, {t.goodput_per_device:.2f} rps per GPU)"
        )
        print(f"  paper: prefill tp2 pp1, decode tp1 pp1   ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
