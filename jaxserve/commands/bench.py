"""`jaxserve bench`: open-loop load against running servers; latency summary, SLO attainment, goodput.

    jaxserve bench --target 127.0.0.1:50051 --workload fixed:128:32 --rate 4 --num-requests 200 \\
        --ttft 0.25 --tpot 0.05 --json run.json
    jaxserve bench --target A:50051 --target B:50051 --workload sharegpt --rate 2 --ttft 1 --tpot 0.1 \\
        --sweep-rates --sweep-slo-scale --plot attainment.png
    jaxserve bench --http --target 127.0.0.1:8000 --workload trace.jsonl --rate 3 --ttft 1 --tpot 0.1

Requests come from the planner's workload module (`sharegpt`, `humaneval`, `longbench`,
`fixed:IN:OUT`, or a JSONL trace, rescaled to `--rate`), Poisson arrivals (Gamma with `--cv`). Every
request asks for exactly its output length (ignore_eos). Per request: client-side TTFT, TPOT, ITLs,
E2E (vLLM `bench serve` definitions, see `jaxserve/tools/bench/records.py`).

* `--rate R` (or `--rates R1,R2,…`): one run per rate per target; summary table per run.
* `--sweep-rates`: DistServe goodput per target — the highest rate with attainment ≥ `--attainment`,
  bisected from `--rate` (`--max-probes`, `--rel-tol`).
* `--sweep-slo-scale`: the tightest SLO scale each run still meets (exact, from its requests), and
  the attainment-vs-scale curve for `--plot`.
* `--conversations N`: a multi-turn workload instead (`placement.conversations`): N conversations
  over `--system-prompts` shared system prompts, each turn's prompt = the previous prompt + the
  answer the server gave + `--user-tokens` new tokens, closed loop per conversation (the next turn
  leaves `--think-time` seconds, exponential mean, after the last token; conversations start so
  that requests arrive at about `--rate`). gRPC only; the summary adds the prefix-cache hit rate
  (the server's `usage.cached_tokens`) and the KV bytes the server moved
  (`jaxserve/tools/bench/multiturn.py`).
* `--json FILE`: every run with every request's numbers; `--plot FILE.png`: attainment vs rate (and
  vs SLO scale), one line per target/deployment.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from placement.conversations import ConversationSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", action="append", required=True, help="HOST:PORT of a server (repeat for several deployments)"
    )
    parser.add_argument("--http", action="store_true", help="use the OpenAI /v1/completions stream instead of gRPC")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model", default=None, help="HTTP: the `model` field to send")
    parser.add_argument(
        "--workload", default="fixed:128:32", help="sharegpt | humaneval | longbench | fixed:IN:OUT | trace.jsonl"
    )
    parser.add_argument("--rate", type=float, default=None, help="arrival rate, requests/s (start of a sweep)")
    parser.add_argument("--rates", default=None, help="comma-separated rates: one run at each")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--cv", type=float, default=1.0, help="inter-arrival coefficient of variation (1 = Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft", type=float, default=None, help="TTFT SLO, seconds")
    parser.add_argument("--tpot", type=float, default=None, help="TPOT SLO, seconds")
    parser.add_argument("--attainment", type=float, default=0.9, help="target share meeting both SLOs")
    parser.add_argument("--sweep-rates", action="store_true", help="bisect the goodput (max rate meeting the target)")
    parser.add_argument("--sweep-slo-scale", action="store_true", help="report the tightest SLO scale of each run")
    parser.add_argument("--max-probes", type=int, default=8, help="runs per --sweep-rates search")
    parser.add_argument("--rel-tol", type=float, default=0.1, help="--sweep-rates stops when hi/lo <= 1 + this")
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt token ids below this (HTTP default 512)")
    parser.add_argument("--max-positions", type=int, default=None, help="cap on input + output (HTTP default 2048)")
    parser.add_argument("--timeout", type=float, default=None, help="per-request deadline, seconds")
    parser.add_argument("--json", dest="json_out", default=None, help="write every run and request here")
    parser.add_argument("--plot", default=None, help="PNG: attainment vs rate (and vs SLO scale)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    conv = parser.add_argument_group("multi-turn workload (--conversations)")
    conv.add_argument("--conversations", type=int, default=None, help="run N closed-loop conversations instead")
    conv.add_argument("--system-prompts", type=int, default=8, help="distinct shared system prompts")
    conv.add_argument("--system-tokens", type=int, default=256, help="tokens per system prompt")
    conv.add_argument("--user-tokens", type=int, default=64, help="new user tokens per turn")
    conv.add_argument("--answer-tokens", type=int, default=32, help="output tokens per turn")
    conv.add_argument("--min-turns", type=int, default=2)
    conv.add_argument("--max-turns", type=int, default=6)
    conv.add_argument("--think-time", type=float, default=1.0, help="mean seconds between an answer and the next turn")


def _fail(message: str) -> int:
    print(f"jaxserve bench: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from jaxserve.tools.bench import loadgen
    from jaxserve.tools.bench.sweep import sweep_rates
    from placement.slo import SloSpec
    from placement.workload import Workload, load_workload

    rates: list[float] = []
    if args.rates:
        try:
            rates = [float(x) for x in args.rates.split(",") if x.strip()]
        except ValueError:
            return _fail(f"--rates must be numbers, got {args.rates!r}")
    elif args.rate is not None:
        rates = [args.rate]
    if any(r <= 0 for r in rates):
        return _fail("rates must be positive")
    if args.num_requests < 1 or args.cv <= 0:
        return _fail("--num-requests must be >= 1 and --cv positive")
    needs_slo = args.sweep_rates or args.sweep_slo_scale or args.plot
    if (args.ttft is None) != (args.tpot is None) or (needs_slo and args.ttft is None):
        return _fail("--ttft and --tpot go together (and are required by --sweep-*/--plot)")
    slo = SloSpec(args.ttft, args.tpot, args.attainment) if args.ttft is not None else None
    if args.conversations is not None:
        return _run_conversations(args, rates, slo)
    is_trace = args.workload.endswith(".jsonl")
    if not rates and not is_trace:
        return _fail("--rate or --rates is required (a .jsonl trace alone replays at its own times)")
    if args.sweep_rates and len(rates) != 1:
        return _fail("--sweep-rates starts from one --rate")

    output: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "targets": []}
    by_rate: dict[str, list[tuple[float, float]]] = {}
    by_scale: dict[str, list[tuple[float, float]]] = {}
    scales = list(np.round(np.geomspace(0.25, 4.0, 17), 4))
    for address in args.target:
        target = loadgen.Target(address, args.http, args.api_key, args.served_model, args.timeout)
        try:
            info = loadgen.probe(target)
        except Exception as e:
            return _fail(f"cannot reach {address}: {e}")
        label = info.deployment or address
        max_positions = args.max_positions or info.max_positions or 2048
        try:
            if is_trace:
                base = Workload.from_jsonl(args.workload).head(args.num_requests)
            else:
                rng = np.random.default_rng(args.seed)
                base = load_workload(args.workload, 1.0, args.num_requests, rng, args.cv, max_positions)
        except (ValueError, OSError) as e:
            return _fail(str(e))
        if int((base.input_lens + base.output_lens).max()) > max_positions:
            return _fail(f"the workload has requests longer than the model's {max_positions} positions")
        entry: dict[str, Any] = {"target": address, "deployment": info.deployment, "runs": []}

        measure = functools.partial(_measure, args, base, target, info, label, slo, scales, entry)
        if args.sweep_rates:
            assert slo is not None
            result = sweep_rates(measure, rates[0], slo.attainment, rel_tol=args.rel_tol, max_probes=args.max_probes)
            entry["sweep"] = result.to_dict()
            if info.num_devices:
                entry["sweep"]["goodput_rps_per_device"] = result.goodput / info.num_devices
            per_dev = f" = {result.goodput / info.num_devices:.3f} rps/device" if info.num_devices else ""
            print(
                f"goodput of {label}: {result.goodput:.3f} rps{per_dev} "
                f"(attainment >= {slo.attainment:.0%}; probes: "
                + ", ".join(f"{p.rate:.3g}->{p.attainment:.0%}" for p in result.probes)
                + ")"
            )
        else:
            for rate in rates or [base.rate]:
                measure(rate)
        by_rate[label] = [(r["rate"], r["summary"].get("attainment", 0.0)) for r in entry["runs"]]
        if args.sweep_slo_scale and slo is not None:
            best = entry["runs"][-1] if not args.sweep_rates else _closest_run(entry["runs"], rates[0])
            by_scale[f"{label} @ {best['rate']:.3g} rps"] = best["attainment_vs_slo_scale"]
            for r in entry["runs"]:
                print(f"tightest SLO scale of {label} @ {r['rate']:.3g} rps: {r['summary']['tightest_slo_scale']:.3f}")
        output["targets"].append(entry)

    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(output, fh, indent=1, default=_json_default)
    if args.plot:
        from jaxserve.tools.bench.plot import plot_attainment

        plot_attainment(
            args.plot,
            by_rate,
            by_scale or None,
            target=slo.attainment if slo else None,
            title=f"{args.workload}, TTFT<={args.ttft:g}s TPOT<={args.tpot:g}s",
        )
    return 0


def _measure(
    args: argparse.Namespace,
    base: Any,
    target: Any,
    info: Any,
    label: str,
    slo: Any,
    scales: list[float],
    entry: dict[str, Any],
    rate: float,
) -> float:
    """One run of the base workload at `rate`; appended to `entry`; returns its attainment."""
    from jaxserve.tools.bench import loadgen
    from jaxserve.tools.bench.records import attainment, attainment_vs_scale, format_summary, summarize

    workload = base.with_rate(rate)
    bench = loadgen.run(
        workload,
        target,
        info=info,
        vocab_size=args.vocab_size,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        show_progress=not args.quiet,
        label=f"{label} @ {workload.rate:.3g} rps",
    )
    summary = summarize(bench.records, slo)
    run_out: dict[str, Any] = {
        "rate": workload.rate,
        "summary": summary,
        "requests": [r.to_dict() for r in bench.records],
    }
    if args.sweep_slo_scale and slo is not None:
        run_out["attainment_vs_slo_scale"] = list(
            zip(scales, attainment_vs_scale(bench.records, slo, scales), strict=True)
        )
    entry["runs"].append(run_out)
    if not args.quiet:
        print(format_summary(summary, f"{label} @ {workload.rate:.3g} req/s"))
    else:
        att = f", attainment {summary['attainment']:.1%}" if "attainment" in summary else ""
        print(
            f"{label} @ {workload.rate:.3g} req/s: {summary['completed']}/{summary['num_requests']} ok, "
            f"P90 TTFT {summary['ttft_s']['p90'] * 1e3:.1f} ms, P90 TPOT {summary['tpot_s']['p90'] * 1e3:.1f} ms{att}"
        )
    return attainment(bench.records, slo) if slo is not None else 1.0


def conversation_spec(args: argparse.Namespace, *, max_positions: int, vocab_size: int) -> ConversationSpec:
    """The multi-turn trace's shape from the conversation options (`--system-prompts`, `--system-tokens`,
    `--min-turns`, `--max-turns`, `--user-tokens`, `--answer-tokens`, `--think-time`); also used by
    `scripts/bench_prefix_cache.py`, whose options bear the same names."""
    from placement.conversations import ConversationSpec

    return ConversationSpec(
        num_system_prompts=args.system_prompts,
        system_prompt_tokens=args.system_tokens,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens,
        think_time_s=args.think_time,
        max_positions=max_positions,
        vocab_size=vocab_size,
    )


def _run_conversations(args: argparse.Namespace, rates: list[float], slo: Any) -> int:
    """`--conversations`: one closed-loop multi-turn run per target and rate."""
    import asyncio

    import numpy as np

    from jaxserve.client import AsyncClient
    from jaxserve.tools.bench import loadgen
    from jaxserve.tools.bench.multiturn import grpc_sender, run_conversations
    from jaxserve.tools.bench.records import format_summary, summarize
    from placement.conversations import generate_conversations

    if args.http:
        return _fail("--conversations runs over gRPC (it reads usage.cached_tokens); drop --http")
    if args.conversations < 1 or not rates:
        return _fail("--conversations needs N >= 1 and --rate (or --rates)")
    if args.sweep_rates or args.sweep_slo_scale or args.plot:
        return _fail("--conversations does not sweep or plot yet; give --rate/--rates")
    output: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "targets": []}
    for address in args.target:
        target = loadgen.Target(address, False, args.api_key, None, args.timeout)
        try:
            info = loadgen.probe(target)
        except Exception as e:
            return _fail(f"cannot reach {address}: {e}")
        try:
            spec = conversation_spec(
                args,
                max_positions=args.max_positions or info.max_positions or 2048,
                vocab_size=args.vocab_size or info.vocab_size or 512,
            )
        except ValueError as e:
            return _fail(str(e))
        convs = generate_conversations(spec, args.conversations, np.random.default_rng(args.seed))
        label = info.deployment or address
        entry: dict[str, Any] = {"target": address, "deployment": info.deployment, "runs": []}
        for rate in rates:
            trace = convs.at_rate(rate)

            async def main(trace: Any = trace, address: str = address) -> list[Any]:
                async with AsyncClient(address, api_key=args.api_key, timeout_s=args.timeout) as client:
                    return await run_conversations(trace, grpc_sender(client))

            records = asyncio.run(main())
            summary = summarize(records, slo)
            entry["runs"].append({"rate": rate, "summary": summary, "requests": [r.to_dict() for r in records]})
            title = f"{label} @ {rate:.3g} req/s, {args.conversations} conversations"
            print(format_summary(summary, title))
        output["targets"].append(entry)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(output, fh, indent=1, default=_json_default)
    return 0


def _closest_run(runs: list[dict[str, Any]], rate: float) -> dict[str, Any]:
    return min(runs, key=lambda r: abs(r["rate"] - rate))


def _json_default(x: object) -> object:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
