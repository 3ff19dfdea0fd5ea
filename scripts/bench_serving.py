#!/usr/bin/env python
"""The host's share of a served decode step: `jaxserve bench` against a colocated server vs the engine alone.

A colocated opt-125m server (`colocated:tp1`, random weights) runs pinned to one core (`--server-cpu`);
this process drives it with the bench's load generator from another core (`--client-cpu`): closed
loop, `--concurrency` requests in flight (16 by default), so a batch of that many sequences keeps
decoding. Between the runs, a child process pinned to the server's core times the engine alone —
`ModelEngine.decode_step` on the same preset, a batch of `--concurrency` one-token rows at the
per-row context the served steps had — while the server sits idle.

Per repetition (served run and engine timing interleaved, A B A B …):

* **client**: output tokens/s and TPOT (median) as the bench sees them;
* **served step**: the interval between consecutive full-batch decode steps in the server's own
  step log (`GET /debug/steps`), i.e. what a token costs a running sequence when no prefill
  interrupts it — scheduling, sampling hand-off, streaming and gRPC included;
* **engine step**: `decode_step` alone (inputs built, step run, tokens on the host).

`host share = 1 − engine step / served step` (target < 15 %). The engine is timed at the served
steps' mean context; a batch's table width is bucketed by its longest row, so this slightly favours
the engine and the printed share is, if anything, an over-estimate. The share is refused (printed
as `loaded`) when the load average from other processes exceeded `--max-load` (before the run, or
after it less the bench's own two busy cores), unless `--allow-loaded`.

    PYTHONPATH=. .venv/bin/python scripts/bench_serving.py [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.core.limits import DEFAULT_LIMITS

BLOCK_SIZE = DEFAULT_LIMITS.block_size  # the server's KV page size (its default)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-125m", help="preset or checkpoint the server and the engine load")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (the decode batch)")
    ap.add_argument("--requests", type=int, default=48, help="requests per served run")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="served runs, each followed by an engine timing")
    ap.add_argument("--engine-steps", type=int, default=20, help="engine-alone steps timed per repetition")
    ap.add_argument("--decode-steps-per-call", type=int, default=1, help="the server's --decode-steps-per-call")
    ap.add_argument("--server-cpu", type=int, default=0)
    ap.add_argument("--client-cpu", type=int, default=1)
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--allow-loaded", action="store_true", help="report ratios even above --max-load")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--server-log", default=None, help="write the server log here")
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def load_avg() -> float:
    return os.getloadavg()[0]


def pool_blocks(args: argparse.Namespace) -> int:
    """The KV pool, the same size for the server and the engine: twice what the batch can hold."""
    per = -(-(args.input_len + args.output_len + 1) // BLOCK_SIZE)
    return 2 * args.concurrency * per


# ---- the engine alone (child process, pinned before JAX starts) -------------------------------


def engine_child(args: argparse.Namespace) -> int:
    """Read `CTX` lines on stdin; answer each with the JSON list of `--engine-steps` step times."""
    os.sched_setaffinity(0, {args.server_cpu})
    import jax

    from jaxserve.core.request import SamplingParams
    from jaxserve.core.scheduling import blocks_for
    from jaxserve.runtime.engines.contract import StepBatch, StepRow
    from jaxserve.runtime.engines.model import ModelEngine

    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    engine = ModelEngine.load(args.model, jax.devices()[:1], tp=1, pp=1)
    b = args.concurrency
    per = blocks_for(args.input_len + args.output_len + 1, BLOCK_SIZE)
    pages = engine.init_pages(pool_blocks(args), BLOCK_SIZE)
    print("ready", flush=True)
    for line in sys.stdin:
        ctx = int(line)
        rows = tuple(StepRow(f"d{i}", (5,), ctx, tuple(range(i * per, (i + 1) * per)), greedy, i, 1) for i in range(b))
        times = []
        for k in range(args.engine_steps + 2):  # two untimed: the shape's compile and a settle
            start = time.perf_counter()
            tokens, pages = engine.decode_step(StepBatch(rows), pages)
            jax.block_until_ready(tokens)
            if k >= 2:
                times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)
    return 0


class EngineTimer:
    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, __file__, "--engine-child", "--model", args.model]
        cmd += ["--concurrency", str(args.concurrency), "--engine-steps", str(args.engine_steps)]
        cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        cmd += ["--server-cpu", str(args.server_cpu)]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("XLA_FLAGS", None)  # one device; the pin sizes XLA's pool to the one core
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the engine timing process did not start")

    def time(self, ctx: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{ctx}\n")
        self.proc.stdin.flush()
        return [float(x) for x in json.loads(self.proc.stdout.readline())]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


# ---- one served run -------------------------------------------------------------------------


def served_steps(http: str, since: float, batch: int) -> dict[str, float]:
    """From the server's step log: the full-batch decode steps' durations and the gaps between them."""
    with urllib.request.urlopen(f"http://{http}/debug/steps?since={since}", timeout=30) as resp:
        body = json.load(resp)
    steps = [s for inst in body["instances"] for s in inst["steps"]]
    steps.sort(key=lambda s: s["at"])
    full = [s["kind"] == "decode" and s["batch"] == batch for s in steps]
    intervals = [steps[i]["at"] - steps[i - 1]["at"] for i in range(1, len(steps)) if full[i] and full[i - 1]]
    durations = [s["seconds"] for s, f in zip(steps, full, strict=True) if f]
    ctx = [s["ctx_sum"] / s["batch"] for s, f in zip(steps, full, strict=True) if f]
    if not intervals:
        raise RuntimeError(f"no two consecutive decode steps at batch {batch}: raise --requests")
    return {
        "num_full_steps": len(durations),
        "interval_s": statistics.median(intervals),
        "duration_s": statistics.median(durations),
        "mean_ctx": statistics.fmean(ctx),
        "steps_total": len(steps),
    }


def served_run(args: argparse.Namespace, grpc: str, http: str, vocab: int, seed: int) -> dict[str, Any]:
    import numpy as np

    from jaxserve.tools.bench.loadgen import Target, run_workload
    from jaxserve.tools.bench.records import summarize
    from placement.workload import Workload

    n = args.requests
    work = Workload(
        np.zeros(n),
        np.full(n, args.input_len, dtype=np.int64),
        np.full(n, args.output_len, dtype=np.int64),
        1.0,
    )
    since = time.monotonic()
    run = asyncio.run(run_workload(work, Target(grpc), vocab_size=vocab, seed=seed, max_concurrency=args.concurrency))
    errors = [r.error for r in run.records if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    summary = summarize(run.records)
    return {
        "output_tok_s": summary["output_throughput"],
        "tpot_median_s": summary["tpot_s"]["median"],
        **served_steps(http, since, args.concurrency),
    }


def main() -> int:
    args = _parse()
    if args.engine_child:
        return engine_child(args)
    if {args.server_cpu, args.client_cpu} - os.sched_getaffinity(0) or args.server_cpu == args.client_cpu:
        raise SystemExit("--server-cpu and --client-cpu must be two different cores this process may use")
    os.sched_setaffinity(0, {args.client_cpu})

    from jaxserve.tools.bench.launch import ServeProcess, warm_up
    from jaxserve.tools.bench.loadgen import Target, probe

    load_before = load_avg()
    print(
        f"serving bench: {args.model} colocated:tp1 on core {args.server_cpu}, client on core {args.client_cpu}; "
        f"{args.concurrency} in flight, {args.requests} x ({args.input_len} -> {args.output_len}) per run; "
        f"load average {load_before:.2f}"
    )
    # `--no-warmup`: the server would compile every bucket up to the model's length; the bursts of
    # `warm_up` compile exactly the shapes this workload reaches
    extra = ["--max-decode-batch", str(args.concurrency), "--decode-steps-per-call", str(args.decode_steps_per_call)]
    extra += ["--no-warmup", "--num-kv-blocks", str(pool_blocks(args))]
    reps: list[dict[str, Any]] = []
    log = args.server_log
    with ServeProcess(
        "colocated:tp1", args.model, extra_args=extra, cpus=[args.server_cpu], log_path=log, startup_timeout_s=900
    ) as server:
        vocab = probe(Target(server.grpc_address)).vocab_size or 512
        warm_up(server.grpc_address, args.input_len, args.output_len, args.concurrency, vocab)
        timer = EngineTimer(args)
        try:
            for rep in range(args.reps):
                served = served_run(args, server.grpc_address, server.http_address, vocab, seed=rep)
                engine = timer.time(round(served["mean_ctx"]))
                row = {**served, "engine_min_s": min(engine), "engine_median_s": statistics.median(engine)}
                row["host_share"] = 1.0 - row["engine_median_s"] / row["interval_s"]
                reps.append(row)
                print(
                    f"  rep {rep}: {row['output_tok_s']:7.1f} tok/s  TPOT {1e3 * row['tpot_median_s']:6.1f} ms  "
                    f"served step {1e3 * row['interval_s']:6.1f} ms (in-step {1e3 * row['duration_s']:6.1f})  "
                    f"engine {1e3 * row['engine_median_s']:6.1f} ms  host share {100 * row['host_share']:5.1f} %"
                )
        finally:
            timer.close()
    load_after = load_avg()
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    share = 1.0 - med["engine_median_s"] / med["interval_s"]
    # the load after counts this bench's own two busy cores (server and client), as bench_model's gate does
    loaded = max(load_before, load_after - 2.0) > args.max_load and not args.allow_loaded
    print(f"median of {len(reps)} reps (load average {load_before:.2f} before, {load_after:.2f} after):")
    print(f"  client: {med['output_tok_s']:.1f} output tok/s, TPOT median {1e3 * med['tpot_median_s']:.1f} ms")
    print(
        f"  served full-batch step {1e3 * med['interval_s']:.1f} ms, engine alone {1e3 * med['engine_median_s']:.1f} ms "
        f"(min {1e3 * min(r['engine_min_s'] for r in reps):.1f})"
    )
    verdict = "loaded, not a result" if loaded else f"{100 * share:.1f} % (target < 15 %)"
    print(f"  host share of a served step: {verdict}")
    if args.json_out:
        record = {
            "model": args.model,
            "concurrency": args.concurrency,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "decode_steps_per_call": args.decode_steps_per_call,
            "load_before": load_before,
            "load_after": load_after,
            "reps": reps,
            "host_share": None if loaded else share,
        }
        Path(args.json_out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
