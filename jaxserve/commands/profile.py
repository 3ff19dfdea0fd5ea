"""`jaxserve profile`: time the real engine on this machine and fit the latency model's coefficients.

    jaxserve profile --model opt-tiny -o profile.json
    jaxserve profile --model DIR --tp 1,2 --engines disagg,colocated --quick -o profile.json
    jaxserve profile --model opt-tiny --deployment disagg:prefill=tp2,decode=tp1 -o profile.json
    jaxserve profile --model opt-mini --deployment colocated:tp1 --from-server 127.0.0.1:8000 -o served.json

For every tensor-parallel degree (from `--tp`, or the instances of `--deployment`), loads the model
on that many devices, times prefill batches, decode steps and colocated prefill steps over a grid of
shapes (`jaxserve/runtime/profiling.py`; per shape the fastest of `--repeats` runs in each of `--passes`
passes over the grid, compile excluded),
fits C1..C6 and the per-step overhead (`step_overhead`: a constant per step, a term per context token, an
extra constant per prompt step — what `placement/step_time.py` charges) by one least squares
(`placement/profile_fit.py`), finds L_m, prints the fit error, and writes a profile that `jaxserve plan/simulate --profile` read (the
schema in `placement/latency.py`; each entry also carries its fit errors under `fit`). The engine pads
every step to a power-of-two bucket, so by default the fit is in padded shapes and the entry records
`engine_padding` (the buckets and which table columns its decode attention reads) and `bucket_costs`
(each timed bucket's own cost, which charge instead of C1..C6: `placement/bucket_latency.py`): plan and
simulate then charge a batch what the engine really computes. A bucket the grid did not time is
interpolated between its neighbours, or continued from the largest, so the grid should reach the
buckets serving uses (the default goes to 64 decode rows and 1024 padded prompt tokens).

On a CPU, Eigen is made single-threaded unless `--cpu-multi-thread`; serve with the same XLA flags.
That does not make one XLA device one core: a process runs every device's kernels on one intra-op
pool sized to the cores it may use (at least one thread per device). To time what a pinned server
gets, pin the profile the same way (`--cpus`, as `jaxserve serve --cpus`). On a machine other work
shares, `--clock cpu` reads each step's CPU time instead of elapsed time (`scripts/profile_fidelity.py`
checks such a fit against shapes off the grid).
Pipeline stages are not timed separately: the latency model derives a stage from the per-tp fit.

`--from-server HOST:PORT` fits instead to the steps a running server recorded (`GET /debug/steps` on
its HTTP port): each step's shape and wall time from deciding the batch to handing its tokens on, so
the host work around the engine and whatever else shares the cores is in the fit. Drive the server
with the workload first (e.g. `jaxserve bench`); `--since` keeps only steps after a server time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.commands.common import ensure_host_devices, pin_to_cpus_flag
from jaxserve.core.limits import DEFAULT_LIMITS

SINGLE_CORE_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"

if TYPE_CHECKING:
    from models.config import ModelConfig
    from placement.padding import EnginePadding


def engine_padding(cfg: ModelConfig, block_size: int, dtype: str, tp: int = 1) -> EnginePadding:
    """The shapes this process's engine computes at tensor-parallel degree `tp`: `ModelEngine`'s buckets and
    its decode attention's form (`models.paged_attention.default_impl`, which `models.sharding.ShardedOPT`
    runs: the CPU kernel reads each row's filled positions, the CPU's chunked loop only filled chunks of
    the table, the one-gather form all of it; a tp > 1 stage runs the chunked loop in the kernel's place)."""
    import jax.numpy as jnp

    from models.paged_attention import (
        CHUNK_BYTES,
        HEAD_MAJOR_LOOPS,
        HEADS_CHUNK_BYTES,
        HEADS_FLAT_MIN_CHUNK_COLUMNS,
        HEADS_MAX_CHUNK_COLUMNS,
        block_layout_for,
        default_impl,
        stage_impl,
    )
    from placement.padding import EnginePadding

    impl = stage_impl(default_impl(), tp)  # what ShardedOPT runs on a stage of tp devices
    if impl == "cpu_kernel":  # each row's own positions, no chunks
        return EnginePadding(block_size=block_size, attention_exact=True)
    chunked = impl in HEAD_MAJOR_LOOPS  # the chunk loop (the flat form takes at least 4 columns a chunk)
    heads = chunked and block_layout_for(impl) == "heads"  # the pool layout ShardedOPT creates for impl
    return EnginePadding(
        block_size=block_size,
        attention_chunk_bytes=(HEADS_CHUNK_BYTES if heads else CHUNK_BYTES) if chunked else 0,
        kv_column_bytes=block_size * cfg.kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize if chunked else 0,
        attention_chunk_pow2=heads,
        attention_chunk_max_columns=HEADS_MAX_CHUNK_COLUMNS if heads else 0,
        attention_chunk_min_columns=HEADS_FLAT_MIN_CHUNK_COLUMNS if heads and impl == "xla_heads_flat" else 1,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory or preset name (random weights)")
    parser.add_argument("--tp", default=None, help="comma-separated tensor-parallel degrees (default 1)")
    parser.add_argument("--deployment", default=None, help="profile the tp degrees this deployment spec uses")
    parser.add_argument(
        "--engines",
        default="disagg,colocated",
        help="disagg (prefill/decode engines), colocated, or both (the old names dist, coloc are accepted)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds, for tests)")
    parser.add_argument("--prefill-lengths", default=None, help="grid: prompt lengths, e.g. 64,128,256")
    parser.add_argument("--prefill-batches", default="1,2,3,4", help="grid: prompts per prefill batch")
    parser.add_argument("--decode-batches", default="1,2,3,4,8,12,16,32,64", help="grid: sequences per decode step")
    parser.add_argument("--decode-contexts", default="16,64,160,320", help="grid: context tokens per sequence")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per shape (the fastest is kept)")
    parser.add_argument(
        "--passes",
        type=int,
        default=None,
        help="passes over the whole grid, the fastest run per shape kept "
        "(default 3, 1 with --quick: a shape's runs spread over minutes outlast a neighbour's busy stretch)",
    )
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: elapsed time per step (a dedicated machine); cpu: this process's CPU time per step, "
        "which other processes on a shared machine do not inflate",
    )
    parser.add_argument(
        "--block-size", type=int, default=DEFAULT_LIMITS.block_size, help="paged KV block size the server uses"
    )
    parser.add_argument("--saturation", type=float, default=0.9, help="L_m: share of peak prefill throughput")
    parser.add_argument("--prefill-tokens", type=int, default=None, help="write this L_m instead of detecting it")
    parser.add_argument("--name", default=None, help="profile name (default: MODEL-DEVICE-measured)")
    parser.add_argument("--device-name", default=None, help="what the profile says it was measured on")
    parser.add_argument("--cpu-multi-thread", action="store_true", help="leave XLA's CPU threading as it is")
    parser.add_argument(
        "--busy-neighbour",
        type=int,
        default=None,
        metavar="TOKENS",
        help="time the dist engines while the next tp devices run the other phase (prompts of TOKENS), "
        "as in a disaggregated deployment whose devices share cores; colocated entries are timed alone",
    )
    parser.add_argument(
        "--cpus", default=None, help="run on these CPUs only, e.g. 0 or 0-1: time what a pinned server gets"
    )
    parser.add_argument(
        "--no-padding",
        action="store_true",
        help="fit actual shapes, not the padded buckets the engine computes (then plan/simulate charge actual shapes)",
    )
    parser.add_argument(
        "--from-server",
        default=None,
        metavar="HOST:PORT",
        help="fit to a running server's recorded steps (its HTTP port) instead of timing the engine here",
    )
    parser.add_argument("--since", type=float, default=0.0, help="--from-server: only steps after this server time")
    parser.add_argument(
        "--admin-key",
        default=None,
        help="--from-server: the server's admin key (/debug/steps is an operator route; default: env JAXSERVE_ADMIN_KEY)",
    )
    parser.add_argument("--samples-out", default=None, help="also write the raw timings (JSON)")
    parser.add_argument("-o", "--output", required=True, help="profile JSON to write")


def _tps(args: argparse.Namespace) -> list[int]:
    from jaxserve.core.plan import parse_deployment

    if args.deployment:
        return sorted({inst.tp for inst in parse_deployment(args.deployment).instances})
    return sorted({int(x) for x in (args.tp or "1").split(",") if x.strip()})


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    if args.from_server:
        return _from_server(args)
    try:
        tps = _tps(args)
    except (ValueError, Exception) as e:
        print(f"jaxserve profile: error: {e}", file=sys.stderr)
        return 2
    aliases = {"dist": "disagg", "coloc": "colocated"}
    engines = [aliases.get(e.strip(), e.strip()) for e in args.engines.split(",") if e.strip()]
    if not tps or any(tp < 1 for tp in tps) or not engines or any(e not in ("disagg", "colocated") for e in engines):
        print("jaxserve profile: error: need tp >= 1 and engines from disagg,colocated", file=sys.stderr)
        return 2
    if not pin_to_cpus_flag(args.cpus, "jaxserve profile: "):
        return 2
    ensure_host_devices(
        (2 if args.busy_neighbour else 1) * max(tps), "" if args.cpu_multi_thread else SINGLE_CORE_FLAGS
    )

    import dataclasses

    import jax

    from jaxserve.runtime.profiling import custom_grid, default_grid, measure
    from models.checkpoint import source_config
    from placement.profile_fit import profile_entry

    try:
        cfg = source_config(args.model)
    except (KeyError, OSError, ValueError) as e:
        print(f"jaxserve profile: error: {e}", file=sys.stderr)
        return 2
    if (2 if args.busy_neighbour else 1) * max(tps) > len(jax.devices()):
        print(
            f"jaxserve profile: error: needs {(2 if args.busy_neighbour else 1) * max(tps)} devices, have {len(jax.devices())}",
            file=sys.stderr,
        )
        return 2
    if args.prefill_lengths:
        try:
            grid = custom_grid(
                _ints(args.prefill_lengths),
                _ints(args.prefill_batches),
                _ints(args.decode_batches),
                _ints(args.decode_contexts),
                block_size=args.block_size,
            )
        except ValueError as e:
            print(f"jaxserve profile: error: bad grid: {e}", file=sys.stderr)
            return 2
    else:
        grid = default_grid(cfg.max_position_embeddings, args.quick, args.block_size)
    grid = dataclasses.replace(grid, clock=args.clock)
    if args.repeats:
        grid = dataclasses.replace(grid, repeats=args.repeats)
    if args.passes is not None:
        if args.passes < 1:
            print("jaxserve profile: error: --passes must be >= 1", file=sys.stderr)
            return 2
        grid = dataclasses.replace(grid, passes=args.passes)
    if "colocated" not in engines:
        grid = dataclasses.replace(grid, coloc_prefill=())
    platform = jax.devices()[0].platform
    device = args.device_name or ("cpu" if platform == "cpu" else jax.devices()[0].device_kind.lower())

    def log(msg: str) -> None:
        print(f"[profile] {msg}", file=sys.stderr, flush=True)

    entries, raw = [], []
    for tp in tps:
        m = measure(args.model, tp, grid, dtype=args.dtype, log=log, neighbour_length=args.busy_neighbour)
        cfg = m.cfg
        raw.append(
            {
                "tp": tp,
                "prefill": [dataclasses.asdict(s) for s in m.prefill],
                "decode": [dataclasses.asdict(s) for s in m.decode],
                "coloc_prefill": [dataclasses.asdict(s) for s in m.coloc_prefill],
                "coloc_decode": [dataclasses.asdict(s) for s in m.coloc_decode],
                "busy_neighbour": args.busy_neighbour,
            }
        )
        for engine in engines:
            prefill = m.prefill if engine == "disagg" else m.coloc_prefill
            entry = profile_entry(
                cfg,
                tp,
                engine,
                prefill,
                m.decode if engine == "disagg" else m.coloc_decode,
                attention_tile=16,  # the latency formula's attention tile b, not the KV page size
                l_m=args.prefill_tokens,
                saturation=args.saturation,
                # the engine pads every step to a bucket; fit (and later charge) what it computes
                padding=None if args.no_padding else engine_padding(cfg, args.block_size, args.dtype, tp),
            )
            entries.append(entry)
            fit = entry["fit"]
            print(
                f"{cfg.name} tp{tp} {engine:<5}: C1 {entry['C1']:.3e} C2 {entry['C2']:.3e} C3 {entry['C3']:.3e} "
                f"C4 {entry['C4']:.3e} C5 {entry['C5']:.3e} C6 {entry['C6']:.3e} "
                f"step_overhead [{', '.join(f'{v:.3e}' for v in entry['step_overhead'])}]  L_m {entry['L_m']}  "
                f"{'bucket costs ' if 'bucket_costs' in entry else ''}"
                f"fit error prefill mean {fit['prefill']['mean_rel_error']:.1%} max {fit['prefill']['max_rel_error']:.1%}, "
                f"decode mean {fit['decode']['mean_rel_error']:.1%} max {fit['decode']['max_rel_error']:.1%}"
            )
    profile = {
        "name": args.name or f"{cfg.name}-{device}-measured",
        "device": device,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "entries": entries,
    }
    with open(args.output, "w") as fh:
        json.dump(profile, fh, indent=2)
        fh.write("\n")
    if args.samples_out:
        with open(args.samples_out, "w") as fh:
            json.dump({"model": cfg.name, "grid": dataclasses.asdict(grid), "measurements": raw}, fh)
    print(f"profile written to {args.output}")
    return 0


def _from_server(args: argparse.Namespace) -> int:
    """Fit the latency model to a running server's step records."""
    import urllib.error
    import urllib.request

    from jaxserve.core.plan import PlanError, parse_deployment
    from models.checkpoint import source_config
    from placement.profile_fit import profile_entry, samples_from_steps

    def fail(msg: str) -> int:
        print(f"jaxserve profile: error: {msg}", file=sys.stderr)
        return 2

    if not args.deployment:
        return fail("--from-server needs --deployment (the served one: it says which tp each role runs)")
    try:
        plan = parse_deployment(args.deployment)
        cfg = source_config(args.model)
    except (PlanError, KeyError, OSError, ValueError) as e:
        return fail(str(e))
    kind_tps = {inst.tp for inst in plan.instances}
    if len(kind_tps) != 1:
        return fail("--from-server fits one entry per engine: serve one tp for every instance, or profile the engines")
    tp = kind_tps.pop()
    request = urllib.request.Request(f"http://{args.from_server}/debug/steps?since={args.since}")
    admin_key = args.admin_key if args.admin_key is not None else os.environ.get("JAXSERVE_ADMIN_KEY")
    if admin_key:
        request.add_header("Authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            served = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        return fail(f"could not read http://{args.from_server}/debug/steps: {e}")
    by_role: dict[str, list[dict]] = {}
    for inst in served["instances"]:
        by_role.setdefault(inst["role"], []).extend(inst["steps"])
    groups = [("colocated", by_role.get("colocated", []), by_role.get("colocated", []))]
    groups.append(("disagg", by_role.get("prefill", []), by_role.get("decode", [])))
    padding = None if args.no_padding else engine_padding(cfg, args.block_size, args.dtype, tp)
    entries = []
    for engine, pre_steps, dec_steps in groups:
        if not pre_steps and not dec_steps:
            continue
        prefill, _ = samples_from_steps(pre_steps)
        _, decode = samples_from_steps(dec_steps)
        if len(prefill) < 3 or len(decode) < 3:
            return fail(f"{engine}: {len(prefill)} prefill and {len(decode)} decode steps recorded; need 3 of each")
        entry = profile_entry(
            cfg, tp, engine, prefill, decode, l_m=args.prefill_tokens, saturation=args.saturation, padding=padding
        )
        entries.append(entry)
        fit = entry["fit"]
        print(
            f"{cfg.name} tp{tp} {engine:<5} from {len(prefill)} prefill + {len(decode)} decode served steps: "
            f"fit error prefill mean {fit['prefill']['mean_rel_error']:.1%}, decode mean {fit['decode']['mean_rel_error']:.1%}"
        )
    if not entries:
        return fail("the server recorded no steps (drive it with requests first)")
    profile = {
        "name": args.name or f"{cfg.name}-served",
        "device": args.device_name or "served",
        "source": f"steps recorded by the server at {args.from_server} running {args.deployment}",
        "entries": entries,
    }
    Path(args.output).write_text(json.dumps(profile, indent=2) + "\n")
    if args.samples_out:
        Path(args.samples_out).write_text(json.dumps(served))
    print(f"profile written to {args.output}")
    return 0
