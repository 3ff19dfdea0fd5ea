"""Our simulator beside DistServe's public one (simdistserve) on a grid of deployments and workloads.

    git --git-dir=<LLMServe/DistServe clone> archive HEAD simdistserve | tar x -C /tmp/distserve
    python3 -m venv /tmp/simds-venv && /tmp/simds-venv/bin/pip install simpy numpy pandas tqdm
    PYTHONPATH=$PWD .venv/bin/python scripts/compare_simdistserve.py /tmp/distserve \\
        --python /tmp/simds-venv/bin/python --json out.json

The public simulator is not a dependency of jaxserve: it runs in its own interpreter
(`scripts/simdistserve_driver.py`, given the checkout's path). Both simulate the *same* requests: the
lengths and the arrival times (drawn once at rate 1 by `placement.goodput.base_workload`, scaled to each
probed rate) are handed to the public simulator, so the arrival trace's seed is no difference between them.
A request of `output_len` tokens here (the first from the prefill) is `output_len - 1` decode steps there
(its `output_lens` counts the steps after the prefill's token, and its TPOT divides by them), so both run
the same steps and both TPOTs are the time per decode step. Ours runs the shipped `a100-80gb-distserve`
profile with its engines' limits (token caps 8192 / 16384, decode batch 1024); the public simulator its own
profile files (`profiler-a100-80g.{distserve,vllm}.json`) with the same caps. Each side's highest rate
meeting P90 TTFT and P90 TPOT (each metric at 90 %, its `p90` mode) is found by the same search
(`simdistserve_driver.bracket_max_rate`, to 0.5 %), ours started from our goodput search's answer and
theirs from ours. docs/simulator-fidelity.md holds a run's table and what the differences are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simdistserve_driver import bracket_max_rate  # the search both sides share

from jaxserve.core.plan import parse_deployment
from models.config import get_config
from placement.goodput import GoodputSearch, base_workload, max_rate
from placement.hardware import ClusterSpec, get_device
from placement.latency import DeploymentKind, LatencyProvider, load_profile
from placement.simulator import SimOptions, simulate
from placement.slo import SloSpec

PROFILE = "a100-80gb-distserve"
MODEL = "opt-13b"
# (name, lengths, P90 TTFT s, P90 TPOT s): Figure 1's setting, and ShareGPT-like lengths at the chatbot SLOs of
# Table 3 and at a tight TPOT with a loose TTFT (so that the decode side binds)
WORKLOADS = (
    ("fixed-512-64", "fixed:512:64", 0.4, 0.04),
    ("fixed-128-256", "fixed:128:256", 0.25, 0.05),
    ("sharegpt-chatbot", "sharegpt", 0.25, 0.1),
    ("sharegpt-tight-tpot", "sharegpt", 1.5, 0.045),
)
DEPLOYMENTS = (
    "colocated:tp1",
    "colocated:tp2",
    "colocated:tp4",
    "disagg:prefill=tp1,decode=tp1",
    "disagg:prefill=2xtp1,decode=tp1",
    "disagg:prefill=tp2,decode=tp1",
    "disagg:prefill=tp1,decode=tp2",
    "disagg:prefill=tp2,decode=tp2",
    "disagg:prefill=tp4,decode=tp2",
)


@dataclasses.dataclass(frozen=True)
class Case:
    workload: str
    deployment: str
    ours_rps: float
    public_rps: float
    num_devices: int
    # P50 / P90 TTFT and TPOT (s) of both simulators at the public simulator's max rate (empty where it is 0)
    ours_at: dict[str, float]
    public_at: dict[str, float]

    @property
    def worst_percentile_error(self) -> float:
        """The largest |ours / public - 1| over the four percentiles at the public simulator's max rate."""
        return max((abs(self.ours_at[k] / v - 1.0) for k, v in self.public_at.items() if v > 0), default=0.0)

    @property
    def error(self) -> float:
        """Ours over the public simulator's, less one (0.0 where both are 0)."""
        if self.public_rps == 0.0:
            return 0.0 if self.ours_rps == 0.0 else float("inf")
        return self.ours_rps / self.public_rps - 1.0


def our_options() -> SimOptions:
    """The planner's engine with the profile's decode batch cap (what `jaxserve plan` assumes on this profile)."""
    return dataclasses.replace(SimOptions.planning(), profile_decode_batch=True)


def our_search(
    spec: str, lengths: str, ttft_s: float, tpot_s: float, num_requests: int, seed: int, unlimited_memory: bool = False
) -> GoodputSearch:
    """Our goodput search on the case. `unlimited_memory`: decode KV and the prefill buffer unbounded, the public
    simulator's model of memory (none, but for its per-round context cap), to measure what memory accounts for."""
    options = our_options()
    if unlimited_memory:
        limits = dataclasses.replace(options.limits, num_kv_blocks=10**7)
        options = dataclasses.replace(options, limits=limits, bounded_prefill_buffer=False)
    latency = LatencyProvider(get_config(MODEL, "float16"), get_device("a100-80gb"), load_profile(PROFILE))
    return GoodputSearch(
        parse_deployment(spec),
        latency,
        ClusterSpec(latency.device, 1, 8),
        base_workload(lengths, num_requests, seed),
        SloSpec(ttft_s, tpot_s, 0.9, "p90"),
        options,
    )


def public_case(
    spec: str,
    search: GoodputSearch,
    hint: float,
    nominal_outputs: bool = False,
    decode_context_cap: int | None = None,
    route_by_tokens: bool = False,
) -> dict:
    """The driver's description of the same deployment, requests and SLO. `nominal_outputs`: hand it our output
    lengths as its `output_lens` (one decode step more per request than ours runs), to measure what the two
    countings differ by. `decode_context_cap`: replace its hard-coded 50 000 context tokens a decode round.
    `route_by_tokens`: route prompts as our runtime does (fewest queued tokens), not by fewest requests."""
    plan = search.plan
    w = search.workload
    prefill = plan.of_role("prefill")
    decode = plan.of_role("decode")
    colocated = plan.kind == "colocated"
    engine: DeploymentKind = "colocated" if colocated else "disagg"
    first = plan.instances[0] if colocated else prefill[0]
    # the engine caps our simulation charges, read from our profile: the public simulator gets the same
    decode_cap = search.latency.profile_decode_batch(engine)
    assert decode_cap is not None, f"profile {PROFILE} names no decode batch cap"
    return {
        "backend": "vllm" if colocated else "distserve",
        "model": MODEL.replace("-", "_"),
        "tp_prefill": first.tp,
        "tp_decode": first.tp if colocated else decode[0].tp,
        "n_prefill": 1 if colocated else len(prefill),
        "n_decode": 1 if colocated else len(decode),
        "requests": [
            [int(i), int(o) - (0 if nominal_outputs else 1)] for i, o in zip(w.input_lens, w.output_lens, strict=True)
        ],
        "arrival_s": [float(t) for t in w.arrival_at],
        "ttft_s": search.slo.ttft_s,
        "tpot_s": search.slo.tpot_s,
        "prefill_cap": search.latency.engine_token_cap(engine, first.tp),
        "decode_batch": decode_cap,
        "hint": hint,
        "decode_context_cap": decode_context_cap,
        "prefill_routing": "tokens" if route_by_tokens else "requests",
    }


def our_percentiles(search: GoodputSearch, rate: float) -> dict[str, float]:
    """P50 / P90 TTFT and TPOT of one whole run of our simulator at `rate` (no early stop)."""
    if rate <= 0:
        return {}
    options = dataclasses.replace(search.options, stop_early=False)
    result = simulate(search.plan, search.latency, search.cluster, search.workload.with_rate(rate), None, options)
    ttft, tpot = result.ttft_s, result.tpot_s
    return {
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "tpot_p50_s": float(np.percentile(tpot, 50)),
        "tpot_p90_s": float(np.percentile(tpot, 90)),
    }


def run_public(checkout: str, python: str, cases: dict[str, dict]) -> dict[str, dict]:
    driver = Path(__file__).resolve().parent / "simdistserve_driver.py"
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out_path = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        cases_path.write_text(json.dumps(cases))
        subprocess.run([python, str(driver), checkout, str(cases_path), str(out_path)], check=True)
        return dict(json.loads(out_path.read_text()))


def summarize(cases: list[Case]) -> dict[str, object]:
    errors = [abs(c.error) for c in cases]
    pct_errors = [c.worst_percentile_error for c in cases]
    best: dict[str, dict[str, str]] = {}
    for workload in dict.fromkeys(c.workload for c in cases):
        rows = [c for c in cases if c.workload == workload]
        best[workload] = {
            "ours": max(rows, key=lambda c: c.ours_rps / c.num_devices).deployment,
            "public": max(rows, key=lambda c: c.public_rps / c.num_devices).deployment,
        }
    return {
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "median_worst_percentile_error": statistics.median(pct_errors),
        "max_worst_percentile_error": max(pct_errors),
        "best_per_device": best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", help="a directory holding the simdistserve package (LLMServe/DistServe)")
    parser.add_argument("--python", default=sys.executable, help="an interpreter with simpy, numpy, pandas")
    parser.add_argument("--commit", default="", help="the LLMServe/DistServe commit of the checkout (recorded)")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", nargs="*", default=[w[0] for w in WORKLOADS])
    parser.add_argument("--deployments", nargs="*", default=list(DEPLOYMENTS))
    parser.add_argument("--json", help="write the cases and the summary here")
    parser.add_argument(
        "--nominal-outputs",
        action="store_true",
        help="give the public simulator our output lengths as its decode steps (one more than ours runs)",
    )
    parser.add_argument(
        "--public-decode-context-cap",
        type=int,
        help="replace the public simulator's hard-coded 50 000 context tokens per decode round (its 'TODO: Hack')",
    )
    parser.add_argument(
        "--public-route-by-tokens",
        action="store_true",
        help="route prompts in the public simulator by queued tokens (our runtime's policy), not by queued requests",
    )
    parser.add_argument(
        "--our-unlimited-memory",
        action="store_true",
        help="run ours with unbounded decode KV and prefill buffer (the public simulator has no memory model)",
    )
    args = parser.parse_args()

    start = time.perf_counter()
    ours: dict[str, tuple[str, str, float, GoodputSearch]] = {}
    public_cases: dict[str, dict] = {}
    for name, lengths, ttft_s, tpot_s in WORKLOADS:
        if name not in args.workloads:
            continue
        for spec in args.deployments:
            search = our_search(spec, lengths, ttft_s, tpot_s, args.num_requests, args.seed, args.our_unlimited_memory)
            hint = max_rate(search, 0.01)
            rate = bracket_max_rate(search.meets, hint) if hint > 0 else 0.0
            key = f"{name} {spec}"
            ours[key] = (name, spec, rate, search)
            public_cases[key] = public_case(
                spec,
                search,
                rate or 0.1,
                args.nominal_outputs,
                args.public_decode_context_cap,
                args.public_route_by_tokens,
            )
            print(f"ours  {key}: {rate:.4f} rps", flush=True)
    ours_s = time.perf_counter() - start
    public = run_public(args.checkout, args.python, public_cases)
    cases = [
        Case(
            w,
            spec,
            rate,
            public[key]["max_rate"],
            search.plan.num_devices,
            our_percentiles(search, public[key]["max_rate"]),
            public[key]["at_max_rate"],
        )
        for key, (w, spec, rate, search) in ours.items()
    ]

    print(f"\n{'workload':<20} {'deployment':<34} {'ours':>8} {'public':>8} {'error':>7}  percentiles at public rate")
    for c in cases:
        pct = " ".join(f"{c.ours_at[k] * 1e3:.1f}/{c.public_at[k] * 1e3:.1f}" for k in c.public_at)
        print(f"{c.workload:<20} {c.deployment:<34} {c.ours_rps:8.3f} {c.public_rps:8.3f} {c.error:+7.1%}  {pct}")
    summary = summarize(cases)
    print(f"\nmax rate: median |error| {summary['median_abs_error']:.1%}, max {summary['max_abs_error']:.1%}")
    print(
        f"TTFT/TPOT P50/P90 at the public max rate, worst of four per case: median "
        f"{summary['median_worst_percentile_error']:.1%}, max {summary['max_worst_percentile_error']:.1%}"
    )
    best_per_device: dict[str, dict[str, str]] = summary["best_per_device"]  # type: ignore[assignment]
    for workload, best in best_per_device.items():
        same = "same" if best["ours"] == best["public"] else "DIFFERENT"
        print(f"best per device, {workload}: ours {best['ours']}, public {best['public']} ({same})")
    print(f"({time.perf_counter() - start:.0f} s, ours {ours_s:.0f} s)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "public_commit": args.commit,
                    "num_requests": args.num_requests,
                    "seed": args.seed,
                    "cases": [
                        dataclasses.asdict(c) | {"error": c.error, "worst_percentile_error": c.worst_percentile_error}
                        for c in cases
                    ],
                    "summary": summary,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
