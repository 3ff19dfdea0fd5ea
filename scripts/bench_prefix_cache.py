"""Prefix caching on the real runtime: a closed-loop multi-turn benchmark, caching on vs off, and the
simulator's prediction on the same trace.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. .venv/bin/python scripts/bench_prefix_cache.py

Two embedded controllers of the same disaggregated deployment live side by side on the 8 virtual
CPU devices (arm "off" on devices 0..k-1, arm "on" on k..2k-1; random-weight `opt-mini` by
default), so each compiles once. Each repetition draws a fresh trace of conversations over shared
system prompts (`placement.conversations`, new token ids: a repetition cannot hit the previous
one's blocks), warms both arms up on a separate trace, then runs the arms interleaved (off, on,
off, on, ...) and reports per arm: the prompt-token hit rate (1 − computed / prompt tokens), the
KV positions and bytes pulled, TTFT P50/P90 (client side, in this process; medians over
repetitions), then the simulator (`placement.prefix_sim.PrefixSimulator`, the runtime's pool sizes
and policies) on each measured trace: its hit rate and bytes against the runtime's.

`--overhead`: what caching costs where it saves little, to decide whether it can be on by default. For a
colocated and a disaggregated deployment (`--overhead-deployments`), two arms each (caching off / on, on
separate devices, both warmed first), run interleaved off, on, off, on, ... (`--reps`, >= 5) on two workloads:
"0 % hit" (`--overhead-requests` prompts of unique random tokens, all submitted at once) and "multi-turn" (the
conversation trace above, closed loop). Per repetition: the load average, throughput (prompt + output tokens
per second of the run's wall time), TTFT P50 and this process's CPU time per 1,000 tokens; then on / off of
the medians, the median of each repetition's on / off (the two arms of a repetition run back to back) and
on / off of the CPU time per token, which other processes' load moves far less than wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from jaxserve.commands import bench as bench_cli
from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.scheduling import NO_PREFIX_CACHING, PrefixPolicy
from jaxserve.runtime.controller import AdmissionConfig, Controller, ControllerConfig
from jaxserve.tools.bench.multiturn import controller_sender, run_conversations
from models.config import get_config
from placement.conversations import ConversationSpec, SharedPrefixWorkload, generate_conversations
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider
from placement.prefix_sim import PrefixSimulator
from placement.simulator import SimOptions


def conversation_spec(args: argparse.Namespace, cfg: Any) -> ConversationSpec:
    """The multi-turn trace's shape from the command line (both modes of this script), within the KV pool."""
    return bench_cli.conversation_spec(
        args,
        max_positions=min(cfg.max_position_embeddings, args.num_kv_blocks * args.block_size),
        vocab_size=cfg.vocab_size,
    )


@dataclasses.dataclass
class ArmRun:
    prompt_tokens: int
    computed_tokens: int
    transfer_tokens: int
    transfer_bytes: int  # as moved (dense copies padded to a power-of-two bucket >= 16 positions)
    local_prefills: int
    evictions: int  # cached blocks evicted (LRU) on all instances during the run
    ttft_p50: float
    ttft_p90: float
    failed: int
    sent_at: list[float]  # when each request of the trace was really sent (seconds from the run's start)

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.computed_tokens / self.prompt_tokens


def _counters(c: Controller) -> tuple[int, int, int, int, int]:
    stats = c.stats()
    computed = sum(p.num_computed_tokens for p in c.prefill_instances)
    computed += sum(d.num_local_prefill_tokens for d in c.decode_instances)
    return (
        computed,
        stats.kv_transfer_tokens,
        stats.kv_transfer_bytes,
        sum(d.num_local_prefills for d in c.decode_instances),
        sum(p.cache.stats.num_evictions for p in c.prefill_instances)
        + sum(d.cache.stats.num_evictions for d in c.decode_instances),
    )


def clear_caches(c: Controller) -> None:
    """Evict every unpinned cached block (between runs, all idle): a run starts cold, as the simulator does.

    Blocks of an earlier trace can never hit (fresh token ids), but they fill the LRU and their
    evictions would be counted against this run's.
    """
    for inst in c.instances:
        with inst.cond:
            inst.cache.clear()


def run_arm(c: Controller, trace: SharedPrefixWorkload) -> ArmRun:
    clear_caches(c)
    before = _counters(c)
    records = asyncio.run(run_conversations(trace, controller_sender(c)))
    after = _counters(c)
    done = [r for r in records if r.ok]
    ttft = np.asarray([r.ttft_s for r in done])
    return ArmRun(
        prompt_tokens=int(trace.workload.input_lens.sum()),
        computed_tokens=after[0] - before[0],
        transfer_tokens=after[1] - before[1],
        transfer_bytes=after[2] - before[2],
        local_prefills=after[3] - before[3],
        evictions=after[4] - before[4],
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p90=float(np.percentile(ttft, 90)),
        failed=len(records) - len(done),
        sent_at=[r.sent_at for r in records],
    )


def simulate(
    args: argparse.Namespace, trace: SharedPrefixWorkload, policy: PrefixPolicy, sent_at: list[float] | None = None
) -> tuple[float, float, int]:
    """The simulator's (hit rate, KV bytes moved, evictions) on `trace` with the runtime's pools and policies.

    `sent_at`: replay the runtime's send times (else closed loop: each turn `think_s` after the
    simulated end of the previous one).
    """
    cfg = get_config(args.model)
    device = get_device("cpu")
    sim = PrefixSimulator(
        parse_deployment(args.deployment),
        LatencyProvider(cfg, device),
        ClusterSpec(device, 1, 8),
        trace,
        options=SimOptions.planning(block_size=args.block_size, max_decode_batch=args.max_decode_batch),
        policy=policy,
        prefill_pool_blocks=args.num_kv_blocks,
        decode_pool_blocks=args.num_kv_blocks,
        sent_at=None if sent_at is None else np.asarray(sent_at),
    )
    sim.run()
    stats = sim.stats()
    return stats.hit_rate, stats.kv_bytes_moved, stats.num_prefill_evictions + stats.num_decode_evictions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-mini")
    ap.add_argument("--deployment", default="disagg:prefill=2xtp1,decode=2xtp1")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s the conversation starts aim at")
    ap.add_argument("--think-time", type=float, default=0.5, help="mean seconds from an answer to the next turn")
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--min-turns", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=DEFAULT_LIMITS.block_size)
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=DEFAULT_LIMITS.num_kv_blocks,
        help="every instance's pool (prefill and decode)",
    )
    ap.add_argument("--max-decode-batch", type=int, default=DEFAULT_LIMITS.max_decode_batch)
    ap.add_argument("--local", type=int, default=0, help="local-prefill threshold (tokens) for the 'on' arm")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions (fresh trace each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every run here")
    ap.add_argument(
        "--engine",
        choices=("model", "timed"),
        default="model",
        help="model: the real model; timed: `TimedEngine`, every step sleeping the simulator's own step time "
        "(the runtime's mechanism with the simulator's timing)",
    )
    ap.add_argument("--overhead", action="store_true", help="caching on vs off at 0 %% hit and multi-turn (above)")
    ap.add_argument(
        "--overhead-deployments", default="colocated:2xtp1;disagg:prefill=tp1,decode=tp1", help="';'-separated"
    )
    ap.add_argument("--overhead-requests", type=int, default=48, help="0 %% hit: requests per run")
    ap.add_argument("--overhead-prompt-tokens", type=int, default=96, help="0 %% hit: prompt tokens")
    args = ap.parse_args()
    if args.overhead:
        return overhead(args)

    plan = parse_deployment(args.deployment)
    k = plan.num_devices
    devices = jax.devices()
    if len(devices) < 2 * k:
        print(f"need {2 * k} devices for two arms of {args.deployment}, have {len(devices)}", file=sys.stderr)
        return 2
    cfg = get_config(args.model)
    limits = ServingLimits(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_decode_batch=args.max_decode_batch
    )
    on_policy = PrefixPolicy(local_prefill_tokens=args.local)
    admission = AdmissionConfig(max_queued_requests=4096)
    arms = {
        "off": ControllerConfig(limits=limits, admission=admission, prefix_policy=NO_PREFIX_CACHING),
        "on": ControllerConfig(limits=limits, admission=admission, prefix_policy=on_policy),
    }
    sim_policies = {"off": NO_PREFIX_CACHING, "on": on_policy}  # the same policies: one knob for both
    spec = conversation_spec(args, cfg)
    started = time.monotonic()
    factory = None
    if args.engine == "timed":
        from jaxserve.tools.timed_engine import timed_engine_factory

        device = get_device("cpu")
        factory = timed_engine_factory(cfg, LatencyProvider(cfg, device), ClusterSpec(device, 1, 8))
    controllers = {
        name: Controller.from_plan(args.model, plan, devices[i * k : (i + 1) * k], factory, config=config)
        for i, (name, config) in enumerate(arms.items())
    }
    for c in controllers.values():
        c.start()
    results: dict[str, list[ArmRun]] = {name: [] for name in arms}
    replays: dict[str, list[tuple[float, float, int]]] = {name: [] for name in arms}
    closed: dict[str, list[tuple[float, float, int]]] = {name: [] for name in arms}
    try:
        warm = generate_conversations(spec, max(8, args.conversations // 2), np.random.default_rng(10_000 + args.seed))
        for c in controllers.values():
            run_arm(c, warm.at_rate(args.rate * 2))  # compiles the shapes; not measured
        for rep in range(args.reps):
            convs = generate_conversations(spec, args.conversations, np.random.default_rng(args.seed + rep))
            trace = convs.at_rate(args.rate)
            for name, c in controllers.items():
                run = run_arm(c, trace)
                results[name].append(run)
                replays[name].append(simulate(args, trace, sim_policies[name], run.sent_at))
                closed[name].append(simulate(args, trace, sim_policies[name]))
    finally:
        for c in controllers.values():
            c.shutdown(drain_timeout_s=0)

    kv_token_bytes = cfg.kv_bytes_per_token
    print(
        f"{args.model} ({args.engine} engine), {args.deployment} x 2 arms on {2 * k} CPU devices; "
        f"{args.conversations} conversations x {args.reps} reps at {args.rate:g} rps (think {args.think_time:g} s), "
        f"block {args.block_size}, {args.num_kv_blocks} blocks per pool; load average {os.getloadavg()[0]:.1f}; "
        f"{time.monotonic() - started:.0f} s"
    )
    print()
    print(
        "| arm | requests | hit rate | prefill tokens computed | KV positions pulled | KV MB pulled (positions) "
        "| KV MB moved (padded) | local prefills | TTFT P50 ms | TTFT P90 ms | evictions "
        "| sim hit rate | sim KV MB | sim evictions | closed-loop sim hit rate | closed-loop sim KV MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out = {}
    med = statistics.median
    for name in arms:
        runs = results[name]
        row = {
            "hit_rate": med([r.hit_rate for r in runs]),
            "computed_tokens": med([r.computed_tokens for r in runs]),
            "prompt_tokens": med([r.prompt_tokens for r in runs]),
            "transfer_tokens": med([r.transfer_tokens for r in runs]),
            "transfer_mb": med([r.transfer_tokens * kv_token_bytes / 1e6 for r in runs]),
            "moved_mb": med([r.transfer_bytes / 1e6 for r in runs]),
            "local_prefills": med([r.local_prefills for r in runs]),
            "ttft_p50_ms": med([r.ttft_p50 * 1e3 for r in runs]),
            "ttft_p90_ms": med([r.ttft_p90 * 1e3 for r in runs]),
            "failed": sum(r.failed for r in runs),
            "evictions": med([r.evictions for r in runs]),
            "sim_hit_rate": med([s[0] for s in replays[name]]),
            "sim_kv_mb": med([s[1] / 1e6 for s in replays[name]]),
            "sim_evictions": med([s[2] for s in replays[name]]),
            "closed_sim_hit_rate": med([s[0] for s in closed[name]]),
            "closed_sim_kv_mb": med([s[1] / 1e6 for s in closed[name]]),
            "runs": [dataclasses.asdict(r) for r in runs],
            "sims": replays[name],
            "closed_loop_sims": closed[name],
        }
        out[name] = row
        print(
            f"| {name} | {len(trace)} | {row['hit_rate']:.1%} | {row['computed_tokens']:.0f} / {row['prompt_tokens']:.0f} "
            f"| {row['transfer_tokens']:.0f} | {row['transfer_mb']:.2f} | {row['moved_mb']:.2f} | {row['local_prefills']:.0f} "
            f"| {row['ttft_p50_ms']:.1f} | {row['ttft_p90_ms']:.1f} | {row['evictions']:.0f} | {row['sim_hit_rate']:.1%} "
            f"| {row['sim_kv_mb']:.2f} | {row['sim_evictions']:.0f} | {row['closed_sim_hit_rate']:.1%} "
            f"| {row['closed_sim_kv_mb']:.2f} |"
        )
    on, off = out["on"], out["off"]
    print()
    print(
        f"on vs off: prefill tokens x{on['computed_tokens'] / off['computed_tokens']:.3f} "
        f"(1 - hit rate = {1 - on['hit_rate']:.3f}), KV positions pulled x{on['transfer_tokens'] / off['transfer_tokens']:.3f}, "
        f"TTFT P50 x{on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}, P90 x{on['ttft_p90_ms'] / off['ttft_p90_ms']:.2f}; "
        f"simulator (replaying the send times) vs runtime (on): hit rate {on['sim_hit_rate']:.1%} vs {on['hit_rate']:.1%}, "
        f"KV MB {on['sim_kv_mb']:.2f} vs {on['transfer_mb']:.2f} ({on['sim_kv_mb'] / on['transfer_mb'] - 1:+.1%})"
    )
    print("per repetition (on): runtime / replay sim / closed-loop sim")
    for rep, (r, s, cl) in enumerate(zip(results["on"], replays["on"], closed["on"], strict=True)):
        mb = r.transfer_tokens * kv_token_bytes / 1e6
        print(
            f"  rep {rep}: hit rate {r.hit_rate:.1%} / {s[0]:.1%} / {cl[0]:.1%}; KV MB {mb:.2f} / {s[1] / 1e6:.2f} "
            f"({s[1] / 1e6 / mb - 1:+.1%}) / {cl[1] / 1e6:.2f} ({cl[1] / 1e6 / mb - 1:+.1%}); "
            f"evictions {r.evictions} / {s[2]} / {cl[2]}"
        )
    if any(row["failed"] for row in out.values()):
        print("WARNING: some requests failed", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "arms": out}, indent=1))
    return 0


@dataclasses.dataclass
class CostRun:
    load_average: float
    tokens_per_s: float  # prompt + output tokens over the run's wall time
    ttft_p50: float
    hit_rate: float
    cpu_ms_per_ktok: float = 0.0  # this process's CPU time over the run, per 1,000 tokens (robust to other load)


def _unique_prompts(args: argparse.Namespace, vocab: int, rep: int, arm: int) -> list[tuple[int, ...]]:
    """Prompts no cache holds: fresh random token ids (first token 2, BOS), a new draw per run."""
    rng = np.random.default_rng(1_000_003 * (rep + 1) + arm)
    return [
        (2, *(int(x) for x in rng.integers(4, vocab, args.overhead_prompt_tokens - 1)))
        for _ in range(args.overhead_requests)
    ]


def _prompt_hits(c: Controller) -> tuple[int, int]:
    """(hit, looked-up) prompt tokens so far where prompts are computed (prefill and colocated instances)."""
    caches = [i.cache for i in c.instances if i.role in ("prefill", "colocated")]
    return sum(x.stats.num_hit_tokens for x in caches), sum(x.stats.num_query_tokens for x in caches)


def _hit_rate(c: Controller, before: tuple[int, int]) -> float:
    hit, query = (a - b for a, b in zip(_prompt_hits(c), before, strict=True))
    return hit / query if query else 0.0


def _burst_run(c: Controller, prompts: list[tuple[int, ...]], max_tokens: int, tag: str) -> CostRun:
    from jaxserve.core.request import GenerateRequest, SamplingParams

    clear_caches(c)
    before = _prompt_hits(c)
    load = os.getloadavg()[0]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    streams = [c.submit(GenerateRequest(f"{tag}-{i}", p, sampling)) for i, p in enumerate(prompts)]
    ttfts, tokens = [], 0
    for stream, prompt in zip(streams, prompts, strict=True):
        ids, last = stream.collect(timeout_s=600)
        assert last.timings is not None and last.timings.first_token_at is not None
        ttfts.append(last.timings.first_token_at - last.timings.arrival_at)
        tokens += len(prompt) + len(ids)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return CostRun(load, tokens / wall, float(np.median(ttfts)), _hit_rate(c, before), 1e6 * cpu / tokens)


def _trace_run(c: Controller, trace: SharedPrefixWorkload) -> CostRun:
    load = os.getloadavg()[0]
    before = _prompt_hits(c)
    t0, cpu0 = time.perf_counter(), time.process_time()
    run = run_arm(c, trace)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = int(trace.workload.input_lens.sum() + trace.workload.output_lens.sum())
    return CostRun(load, tokens / wall, run.ttft_p50, _hit_rate(c, before), 1e6 * cpu / tokens)


def overhead(args: argparse.Namespace) -> int:
    """`--overhead`: caching on vs off, interleaved, at 0 % hit and on the multi-turn trace (module docstring)."""
    cfg = get_config(args.model)
    devices = jax.devices()
    limits = ServingLimits(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_decode_batch=args.max_decode_batch
    )
    admission = AdmissionConfig(max_queued_requests=4096)
    policies = {"off": NO_PREFIX_CACHING, "on": PrefixPolicy(local_prefill_tokens=args.local)}
    spec = conversation_spec(args, cfg)
    started = time.monotonic()
    print(
        f"{args.model}, caching off vs on, interleaved, {args.reps} reps; 0 % hit: {args.overhead_requests} requests "
        f"of {args.overhead_prompt_tokens} unique tokens + {args.answer_tokens} out, all at once; multi-turn: "
        f"{args.conversations} conversations at {args.rate:g} rps; block {args.block_size}, {args.num_kv_blocks} "
        f"blocks per pool; load average {os.getloadavg()[0]:.1f} at start"
    )
    summary = []
    for deployment in args.overhead_deployments.split(";"):
        plan = parse_deployment(deployment)
        k = plan.num_devices
        if len(devices) < 2 * k:
            print(f"need {2 * k} devices for two arms of {deployment}, have {len(devices)}", file=sys.stderr)
            return 2
        controllers = {
            name: Controller.from_plan(
                args.model,
                plan,
                devices[i * k : (i + 1) * k],
                config=ControllerConfig(limits=limits, admission=admission, prefix_policy=policy),
            )
            for i, (name, policy) in enumerate(policies.items())
        }
        runs: dict[tuple[str, str], list[CostRun]] = {}
        try:
            for c in controllers.values():
                c.start()
            warm = generate_conversations(spec, max(8, args.conversations // 2), np.random.default_rng(10_000))
            for i, c in enumerate(controllers.values()):  # compiles the shapes; not measured
                run_arm(c, warm.at_rate(args.rate * 2))
                _burst_run(c, _unique_prompts(args, cfg.vocab_size, -1, i), args.answer_tokens, "warm")
            for rep in range(args.reps):
                trace = generate_conversations(spec, args.conversations, np.random.default_rng(args.seed + rep))
                for i, (name, c) in enumerate(controllers.items()):
                    prompts = _unique_prompts(args, cfg.vocab_size, rep, i)
                    runs.setdefault(("0 % hit", name), []).append(_burst_run(c, prompts, args.answer_tokens, f"r{rep}"))
                for name, c in controllers.items():
                    runs.setdefault(("multi-turn", name), []).append(_trace_run(c, trace.at_rate(args.rate)))
        finally:
            for c in controllers.values():
                c.shutdown(drain_timeout_s=0)
        print()
        print(f"{deployment}")
        print("| workload | arm | rep | load avg | hit rate | tokens/s | TTFT P50 ms | CPU ms / 1k tokens |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for (workload, name), rs in runs.items():
            for rep, r in enumerate(rs):
                print(
                    f"| {workload} | {name} | {rep} | {r.load_average:.1f} | {r.hit_rate:.1%} | {r.tokens_per_s:.0f} "
                    f"| {r.ttft_p50 * 1e3:.1f} | {r.cpu_ms_per_ktok:.0f} |"
                )
        med = statistics.median
        for workload in ("0 % hit", "multi-turn"):
            off, on = runs[(workload, "off")], runs[(workload, "on")]
            thr = med([r.tokens_per_s for r in on]) / med([r.tokens_per_s for r in off])
            ttft = med([r.ttft_p50 for r in on]) / med([r.ttft_p50 for r in off])
            # each repetition's on / off (the arms ran back to back, so they share that moment's load)
            paired_thr = med([b.tokens_per_s / a.tokens_per_s for a, b in zip(off, on, strict=True)])
            paired_ttft = med([b.ttft_p50 / a.ttft_p50 for a, b in zip(off, on, strict=True)])
            cpu = med([r.cpu_ms_per_ktok for r in on]) / med([r.cpu_ms_per_ktok for r in off])
            summary.append(
                (deployment, workload, med([r.hit_rate for r in on]), thr, ttft, paired_thr, paired_ttft, cpu)
            )
    print()
    print(
        "| deployment | workload | hit rate (on) | throughput on / off | TTFT P50 on / off "
        "| paired throughput | paired TTFT | CPU per token on / off |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for deployment, workload, hit, thr, ttft, p_thr, p_ttft, cpu in summary:
        print(
            f"| {deployment} | {workload} | {hit:.1%} | {thr:.3f} | {ttft:.3f} | {p_thr:.3f} | {p_ttft:.3f} | {cpu:.3f} |"
        )
    print(
        f"(medians over {args.reps} interleaved repetitions; paired: the median of each repetition's on / off; CPU: "
        f"this process's CPU time per token, which other processes' load hardly moves; "
        f"{time.monotonic() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
