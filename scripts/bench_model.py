"""Model micro-benchmark: our JAX model (OPT or Llama-style) vs Hugging Face transformers (PyTorch) on the same
random weights.

Measures, in one run on this machine's CPU (or an accelerator, see scripts/device_check.sh):

* decode step time at batch 1, 8, 16, 32 with `--context` (default 512) tokens cached: JAX
  contiguous `decode`, JAX paged `extend_paged` as serving runs it (T=1, block tables as wide as the
  filled blocks, the attention impl and pool block layout `ShardedModel` picks on this backend),
  torch with its `DynamicCache`, and a bandwidth probe (a jitted `v @ W` over a 154 MB matrix);
* the bandwidth floor of each batch: bytes the step must read (weights + KV of the context) at
  the probe's rate, and at batch 1 the fraction of it the paged step reaches;
* prefill time of one prompt of each `--prompt-len` against transformers and a bare square `jnp.dot` of
  equal FLOPs;
* with `--e2e`: `LLM.generate` vs transformers `generate` output tokens/s on the same weights (`--e2e-workload`:
  the decode-heavy or prefill-heavy preset; new random prompts every round, so prefix caching finds no repeats).

Hygiene (issue 13): contenders run interleaved (A B C A B C ...), `--reps` >= 5 repetitions each,
min and median reported, load average printed before and after; a ratio is printed only when the
load from other processes (the 1-minute load average less this benchmark's own busy threads) stayed
<= `--max-load` (default 1.0), unless `--allow-loaded`, which labels
the table LOADED. Both sides get the same threads: `--threads N` pins this process to N cores
(`os.sched_setaffinity`, before JAX starts), sets torch's intra-op threads and XLA's CPU pool.

    .venv/bin/python scripts/bench_model.py --threads 2             # opt-125m, ~5 minutes on 2 cores
    .venv/bin/python scripts/bench_model.py --e2e --threads 2       # end to end (64 x 128 in, 128 out)

  The issue-26/28 targets, one command each (SmolLM2-135M's shape; opt-125m: --model opt-125m):

    .venv/bin/python scripts/bench_model.py --model smollm2-135m --threads 2 --no-prefill       # decode table
    .venv/bin/python scripts/bench_model.py --model smollm2-135m --threads 2 --no-decode --prompt-len 512,2048,4096
    .venv/bin/python scripts/bench_model.py --model smollm2-135m --threads 2 --e2e --e2e-defaults \
        --e2e-workload decode-heavy --e2e-reps 5                   # LLM defaults, 32 x 128 in, 128 out
    .venv/bin/python scripts/bench_model.py --model smollm2-135m --threads 2 --e2e --e2e-defaults \
        --e2e-workload prefill-heavy --e2e-reps 5                  # LLM defaults, 64 x 512 in, 16 out

    .venv/bin/python scripts/bench_model.py --e2e --threads 2 --e2e-reps 5 --e2e-layouts tokens,heads
                                                                   # the same over both KV pool layouts
    .venv/bin/python scripts/bench_model.py --e2e --threads 2 --e2e-reps 5 --e2e-impls xla,xla_heads_flat
                                                                   # ... and over two paged attentions
    .venv/bin/python scripts/bench_model.py --e2e --no-torch --e2e-decode-steps 1,4,8 --e2e-reps 5  # multi-step A/B
    .venv/bin/python scripts/bench_model.py --model opt-tiny --batches 1,8 --reps 5   # smoke run
    .venv/bin/python scripts/bench_model.py --model smollm2-135m --threads 2        # Llama-style (GQA 9:3)
    .venv/bin/python scripts/bench_model.py --model smollm2-135m --threads 2 --prompt-len 512,2048 --batches 8
    .venv/bin/python scripts/bench_model.py --model smollm2-135m --e2e --threads 2
    .venv/bin/python scripts/bench_model.py --no-torch --plot ''    # accelerator: jax only, no plot
    .venv/bin/python scripts/bench_model.py --threads 2 --no-torch --no-prefill --paged-ab xla_gather,xla
                                                                   # paged attention A/B (old vs new)
    .venv/bin/python scripts/bench_model.py --threads 2 --no-torch --no-prefill --paged-ab xla,xla_tokens --batches 8,16
                                                                   # head-major vs token-major chunks
    .venv/bin/python scripts/bench_model.py --threads 2 --no-torch --no-prefill --paged-layout-ab
                                                                   # attention only: pool blocks [bs,H,D] vs [H,bs,D]
    .venv/bin/python scripts/bench_model.py --threads 2 --no-torch --no-prefill --paged-ab xla,xla:heads
                                                                   # the whole paged step over both pool layouts
    .venv/bin/python scripts/bench_model.py --threads 2 --no-torch --no-prefill --decode-ab
                                                                   # contiguous decode: stacked vs per-layer cache

`--json PATH` writes every sample; `--plot PATH` (default docs/performance.png) draws step time
vs batch for jax, paged, transformers and the bandwidth floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from jaxserve.core.limits import ServingLimits
from models.attention import DecodeCache, KVCache, init_paged_cache, insert_into_pages

ROOT = Path(__file__).resolve().parent.parent


# `--e2e-workload` presets: (prompts, prompt tokens, new tokens).
E2E_WORKLOADS = {"decode-heavy": (32, 128, 128), "prefill-heavy": (64, 512, 16)}


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--dtype", default="float32", help="weights and KV dtype (bfloat16: fp32 accumulation)")
    ap.add_argument("--prompt-len", default="512", help="prefill prompt lengths, comma-separated (e.g. 512,2048)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--decode-steps", type=int, default=4, help="decode steps timed per repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="pin to N cores for both sides (0: leave as is)")
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--allow-loaded", action="store_true", help="print ratios above --max-load, labelled LOADED")
    ap.add_argument("--no-torch", action="store_true", help="skip transformers (e.g. on an accelerator)")
    ap.add_argument("--torch-device", default="cpu", help="where transformers runs (cuda on a GPU machine)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode table (e.g. prefill lengths only)")
    ap.add_argument("--e2e", action="store_true", help="only the end-to-end LLM.generate comparison")
    ap.add_argument(
        "--e2e-workload",
        choices=sorted(E2E_WORKLOADS),
        default=None,
        help="a preset of prompts x prompt length x new tokens: "
        + "; ".join(f"{k}: {n} x {t}, {m} new" for k, (n, t, m) in sorted(E2E_WORKLOADS.items()))
        + " (the three --e2e-* sizes below override it)",
    )
    ap.add_argument("--e2e-prompts", type=int, default=None, help="default 64 (or the workload's)")
    ap.add_argument("--e2e-prompt-len", type=int, default=None, help="default 128 (or the workload's)")
    ap.add_argument("--e2e-new-tokens", type=int, default=None, help="default 128 (or the workload's)")
    ap.add_argument(
        "--e2e-torch-batch",
        type=int,
        default=0,
        help="transformers generate's batch (equal-length prompts, so no padding); 0: all prompts in one batch",
    )
    ap.add_argument("--e2e-reps", type=int, default=3)
    ap.add_argument("--e2e-max-batch", type=int, default=64, help="LLM's max_decode_batch")
    ap.add_argument(
        "--e2e-defaults",
        action="store_true",
        help="the LLMs with their defaults (pool sized from memory, offline limits), not this script's pool and caps",
    )
    ap.add_argument(
        "--e2e-decode-steps",
        default="1",
        help="decode steps per engine call, one LLM per value, interleaved (e.g. 1,4,8: multi-step A/B); "
        "with --no-torch the e2e run uses the preset's random weights and skips transformers",
    )
    ap.add_argument(
        "--e2e-layouts",
        default="",
        help="KV pool block layouts for the e2e LLMs, one LLM per value, interleaved (e.g. tokens,heads: layout "
        "A/B); default: the layout serving picks on this backend",
    )
    ap.add_argument(
        "--e2e-impls",
        default="",
        help="paged decode attention implementations for the e2e LLMs, one LLM per value, interleaved (e.g. "
        "xla,xla_heads_flat); default: the one serving picks on this backend",
    )
    ap.add_argument(
        "--paged-ab",
        default="",
        help="only paged decode, these attention implementations interleaved (e.g. xla_gather,xla; ratios vs the first); "
        "IMPL:heads runs IMPL over a pool of head-major blocks (e.g. xla,xla:heads)",
    )
    ap.add_argument(
        "--paged-layout-ab",
        action="store_true",
        help="only paged decode attention (all layers, no weights): the pool's blocks token-major [N,bs,H,D] "
        "(impl xla, xla_tokens) vs head-major [N,H,bs,D] (block_layout='heads'), interleaved",
    )
    ap.add_argument(
        "--decode-ab",
        action="store_true",
        help="only contiguous decode: the stacked KVCache [L,B,T,H,D] (old) vs the per-layer DecodeCache, interleaved",
    )
    ap.add_argument(
        "--tree-ab",
        default="",
        metavar="OLD_ROOT",
        help="the serving model (ShardedModel: prefill of each --prompt-len, paged decode steps of each --batches at "
        "--context) of the tree at OLD_ROOT against this tree's, in two worker processes, interleaved",
    )
    ap.add_argument("--json", default="", help="write all samples here")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "performance.png"), help="'' for no plot")
    args = ap.parse_args()
    preset = E2E_WORKLOADS.get(args.e2e_workload or "", (64, 128, 128))
    for name, value in zip(("e2e_prompts", "e2e_prompt_len", "e2e_new_tokens"), preset, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def pin_threads(n: int) -> None:
    """Pin this process to n cores and size XLA's CPU pool to n; call before importing jax or torch."""
    if n <= 0:
        return
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))[:n]
        os.sched_setaffinity(0, cpus)
    flags = os.environ.get("XLA_FLAGS", "")
    if "intra_op_parallelism_threads" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={n}".strip()
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def interleaved(contenders: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds of each contender, run A B C A B C ... `reps` times after one warm-up round.

    A contender that returns a float reports its own timed part (work it must redo between
    samples, such as restoring a cache, is left out); otherwise its wall time counts.
    """
    for fn in contenders.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(reps):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            own = fn()
            samples[name].append(own if isinstance(own, float) else time.perf_counter() - t0)
    return samples


def load_avg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def own_threads(args: argparse.Namespace) -> int:
    """The runnable threads this benchmark itself keeps busy while it times (it adds them to the load average)."""
    if args.threads:
        return int(args.threads)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class RatioGate:
    """Prints a ratio only while the load *from other processes* is at most `max_load` (or labelled LOADED).

    The 1-minute load average counts this benchmark's own busy threads too (on 2 cores, 2 pinned threads
    make it ~2 by themselves), so the gate subtracts them: `others = load - own_threads`.
    """

    def __init__(self, max_load: float, allow_loaded: bool, own: int = 0) -> None:
        self.max_load, self.allow_loaded, self.own = max_load, allow_loaded, own

    def __call__(self, value: float, width: int = 0) -> str:
        load = max(0.0, load_avg() - self.own)
        if load <= self.max_load:
            text = f"{value:.2f}x"
        elif self.allow_loaded:
            text = f"{value:.2f}x LOADED"
        else:
            text = f"(load {load:.1f})"
        return f"{text:>{width}}" if width else text


def stats(xs: list[float]) -> tuple[float, float]:
    return min(xs), statistics.median(xs)


def main() -> int:
    args = _parse()
    pin_threads(args.threads)
    if args.tree_ab:
        return _tree_ab(args)
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.checkpoint import params_from_hf_tensors
    from models.config import get_model_config
    from models.params import fuse_layer, init_params, unstack_layers

    cfg = get_model_config(args.model)
    dtype = jnp.dtype(args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    use_torch = not args.no_torch
    torch: Any = None
    hf: Any = None
    if use_torch:
        import torch
        import transformers

        from jaxserve.testing.hf import make_hf_model

        transformers.logging.set_verbosity_error()
        if args.threads:
            torch.set_num_threads(args.threads)
        hf = make_hf_model(cfg, seed=0)
        tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
        hf = hf.to(args.torch_device)
        host = params_from_hf_tensors(tensors, cfg, source="in-memory HF model")
    else:
        host = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0), jnp.float32))
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), host)
    # the serving layout of a one-device stage (what ShardedModel runs): one dict per layer, projections fused
    params["layers"] = [fuse_layer(lp) for lp in unstack_layers(params["layers"])]
    del host
    load_before = load_avg()
    print(
        f"model {cfg.name}: {cfg.num_params / 1e6:.1f}M params, {dtype.name}; jax {jax.__version__} on {jax.devices()[0]}"
    )
    print(
        f"cpus: {os.cpu_count()} (affinity {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}),"
        f" threads pinned: {args.threads or 'no'}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
        + (f", torch {torch.__version__} threads {torch.get_num_threads()}" if use_torch else ", no torch")
    )
    print(f"load average before: {load_before:.2f}  (reps {args.reps}, interleaved)")
    rng = np.random.default_rng(0)
    record: dict[str, Any] = {
        "model": cfg.name, "dtype": dtype.name, "platform": jax.devices()[0].platform, "paged": serving_paged()
    }  # fmt: skip

    if args.e2e:
        record["e2e"] = _e2e(args, cfg, hf, torch)
        return _finish(args, record, load_before)
    if args.paged_ab:
        record.update(_paged_ab(args, cfg, params, rng))
        return _finish(args, record, load_before)
    if args.paged_layout_ab:
        record.update(_paged_layout_ab(args, cfg, rng))
        return _finish(args, record, load_before)
    if args.decode_ab:
        record.update(_decode_ab(args, cfg, params, rng))
        return _finish(args, record, load_before)

    # ---------------- bandwidth probe ----------------
    w = jnp.asarray(rng.standard_normal((cfg.hidden_size, 50272)), jnp.float32)  # 154 MB for h = 768
    vec = jnp.ones((1, cfg.hidden_size), jnp.float32)
    probe_fn = jax.jit(lambda v, m: v @ m)

    def probe() -> None:
        probe_fn(vec, w).block_until_ready()

    # ---------------- prefill ----------------
    if not args.no_prefill:
        record["prefill"] = [_prefill(args, int(t), cfg, params, hf, torch, rng) for t in args.prompt_len.split(",")]

    if args.no_decode:
        return _finish(args, record, load_before)

    # ---------------- decode ----------------
    ctx, steps = args.context, args.decode_steps
    # bytes a step reads: every weight but OPT's position table (one row read per token)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - (
        params["embed_positions"].nbytes if "embed_positions" in params else 0
    )
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.kv_heads * cfg.head_dim * dtype.itemsize
    print()
    print(f"decode step at context {ctx}, {steps} steps per sample; ms per step (min / median of {args.reps})")
    print(f"  paged: what serving runs here, attention {serving_paged()!r} (IMPL:heads = head-major pool blocks)")
    head = f"  {'batch':>5}{'jax':>16}{'paged':>16}{'torch':>16}{'probe GB/s':>12}{'floor ms':>10}"
    print(head + f"{'jax/torch':>16}{'paged/torch':>16}{'paged/floor':>14}")
    gate = RatioGate(args.max_load, args.allow_loaded, own_threads(args))
    rows = []
    for bsz in batches:
        prompts = rng.integers(3, cfg.vocab_size, (bsz, ctx)).astype(np.int32)
        contenders = _jax_decode_contenders(params, cfg, prompts, steps, args.block_size)
        if use_torch:
            contenders["torch"] = _torch_decode_contender(hf, torch, prompts, steps, args.torch_device)
        contenders["probe"] = probe
        raw = interleaved(contenders, args.reps)
        per_step = {k: [x / steps for x in v] for k, v in raw.items() if k != "probe"}
        gbps = [w.nbytes / s / 1e9 for s in raw["probe"]]
        bytes_read = weight_bytes + bsz * ctx * kv_bytes_per_token
        floor_s = bytes_read / (max(gbps) * 1e9)
        row = {
            "batch": bsz,
            "bytes_read": bytes_read,
            "probe_gbps": gbps,
            "floor_ms": floor_s * 1e3,
            **{f"{k}_ms": [x * 1e3 for x in v] for k, v in per_step.items()},
        }
        rows.append(row)
        cells = "".join(
            f"{stats(row[k + '_ms'])[0]:>8.1f}/{stats(row[k + '_ms'])[1]:<7.1f}" if k + "_ms" in row else f"{'-':>16}"
            for k in ("jax", "paged", "torch")
        )
        if "torch_ms" in row:
            t_min = min(row["torch_ms"])
            ratio = gate(t_min / min(row["jax_ms"]), 16) + gate(t_min / min(row["paged_ms"]), 16)
        else:
            ratio = f"{'-':>16}{'-':>16}"
        bw = gate(floor_s * 1e3 / min(row["paged_ms"]), 14).replace("x", "", 1) if bsz == 1 else f"{'':>14}"
        print(f"  {bsz:>5}{cells}{max(gbps):>12.1f}{floor_s * 1e3:>10.1f}{ratio}{bw}", flush=True)
    record["decode"] = rows
    print("  targets: jax and paged >= 1.5x torch at every batch; paged at batch 1 >= 60% of the bandwidth floor")
    _plot(args.plot, rows, cfg.name, dtype.name)
    return _finish(args, record, load_before)


def _tree_ab(args: argparse.Namespace) -> int:
    """`--tree-ab OLD_ROOT`: old tree vs this tree, each in its own worker (scripts/bench_tree_worker.py, which
    imports `models` from its tree only), timed in turns (old, new, old, new, ...) after one warm-up round; each
    row also says whether the two trees compiled the same optimized program (names and metadata aside)."""
    import subprocess

    trees = {"old": Path(args.tree_ab).resolve(), "new": ROOT}
    workers = {}
    for name, root in trees.items():
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_tree_worker.py"), args.model, args.dtype]
        workers[name] = subprocess.Popen(
            cmd, env=env, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
    for name, w in workers.items():
        print(f"{name}: models from {json.loads(w.stdout.readline())['ready']}", flush=True)  # type: ignore[union-attr]

    def ask(name: str, line: str) -> float:
        w = workers[name]
        w.stdin.write(line + "\n")  # type: ignore[union-attr]
        w.stdin.flush()  # type: ignore[union-attr]
        return float(json.loads(w.stdout.readline())["seconds"])  # type: ignore[union-attr]

    def hlo(name: str) -> str:
        w = workers[name]
        w.stdin.write("hlo\n")  # type: ignore[union-attr]
        w.stdin.flush()  # type: ignore[union-attr]
        return str(json.loads(w.stdout.readline())["hlo"])  # type: ignore[union-attr]

    jobs = [] if args.no_prefill else [(f"prefill {t}", f"prefill {t}", 1) for t in args.prompt_len.split(",")]
    if not args.no_decode:
        jobs += [
            (f"decode b={b} ctx={args.context}", f"decode {b} {args.context} {args.decode_steps}", args.decode_steps)
            for b in args.batches.split(",")
        ]
    print(f"{args.model} {args.dtype}, ms per step (min / median of {args.reps}), load {load_avg():.2f}")
    rows = []
    for label, line, per in jobs:
        for name in workers:  # warm-up: compiles
            ask(name, line)
        ms: dict[str, list[float]] = {name: [] for name in workers}
        load = load_avg()
        for _ in range(args.reps):
            for name in workers:
                ms[name].append(ask(name, line) / per * 1e3)
        (o_min, o_med), (n_min, n_med) = stats(ms["old"]), stats(ms["new"])
        digests = {name: hlo(name) for name in workers}  # the optimized program each tree ran
        same = "same program" if digests["old"] == digests["new"] else "programs differ"
        print(
            f"  {label:<24} old {o_min:8.2f} / {o_med:8.2f}   new {n_min:8.2f} / {n_med:8.2f}   "
            f"new/old {n_min / o_min:.3f} (median {n_med / o_med:.3f})   {same}   load {load:.2f} -> {load_avg():.2f}",
            flush=True,
        )
        rows.append({"job": label, **{f"{k}_ms": v for k, v in ms.items()}})
    for w in workers.values():
        w.stdin.close()  # type: ignore[union-attr]
        w.wait()
    if args.json:
        Path(args.json).write_text(json.dumps({"tree_ab": rows, "model": args.model}, indent=1))
    return 0


def _finish(args: argparse.Namespace, record: dict[str, Any], load_before: float) -> int:
    load_after = load_avg()
    record["load_before"], record["load_after"] = load_before, load_after
    # Before: nothing of ours runs yet. After: our own busy threads are still in the 1-minute average.
    loaded = max(load_before, load_after - own_threads(args)) > args.max_load
    record["loaded"] = loaded
    print()
    print(
        f"load average before {load_before:.2f}, after {load_after:.2f} (limit {args.max_load} from other "
        f"processes; after counts this benchmark's {own_threads(args)} busy threads too)"
    )
    if loaded:
        if args.allow_loaded:
            print("LOADED: the machine was busy; ratios above are labelled LOADED and are not a result")
        else:
            print("REFUSED: the machine was busy, so no ratio was printed (rerun on a quiet machine or --allow-loaded)")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"samples written to {args.json}")
    return 0


def _prefill(args: argparse.Namespace, t: int, cfg: Any, params: Any, hf: Any, torch: Any, rng: Any) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import steps as model_steps  # the whole-model steps of every family

    prompt = rng.integers(3, cfg.vocab_size, (1, t)).astype(np.int32)
    lengths = np.array([t], np.int32)
    flops = prefill_flops(cfg, t)
    n = max(1, round((flops / 2) ** (1 / 3)))  # one square f32 jnp.dot with the prefill's FLOPs
    a = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    dot = jax.jit(jnp.dot)
    contenders: dict[str, Callable[[], Any]] = {
        "jax": lambda: jax.block_until_ready(model_steps.prefill(params, cfg, prompt, lengths)),
        "dot": lambda: dot(a, b).block_until_ready(),
    }
    if hf is not None:
        ids = torch.from_numpy(prompt).long().to(args.torch_device)

        def run_torch() -> None:
            with torch.inference_mode():
                hf(input_ids=ids, use_cache=True, logits_to_keep=1)
            if args.torch_device.startswith("cuda"):
                torch.cuda.synchronize()

        contenders["torch"] = run_torch
    raw = interleaved(contenders, args.reps)
    jax_s, dot_s = min(raw["jax"]), min(raw["dot"])
    dot_rate = 2 * n**3 / dot_s
    print()
    print(f"prefill, 1 x {t} tokens ({flops / 1e9:.1f} GFLOP); min / median ms")
    for k, v in raw.items():
        print(f"  {k:<8}{min(v) * 1e3:>8.1f} /{statistics.median(v) * 1e3:>8.1f}")
    gate = RatioGate(args.max_load, args.allow_loaded, own_threads(args))
    print(f"  jax prefill / bare matmul rate: {gate(flops / jax_s / dot_rate).replace('x', '', 1)} (target >= 0.75)")
    if "torch" in raw:
        print(f"  jax / transformers prefill speed: {gate(min(raw['torch']) / jax_s)} (target >= 1.5x)")
    return {"prompt_len": t, "flops": flops, "dot_n": n, **{f"{k}_ms": [x * 1e3 for x in v] for k, v in raw.items()}}


def prefill_flops(cfg: Any, t: int) -> float:
    """Matmul FLOPs of one t-token prefill with last-token logits (causal attention counted once)."""
    from models.config import layer_matmul_params

    h, n, q = cfg.hidden_size, cfg.num_layers, cfg.num_heads * cfg.head_dim
    linear = 2 * t * sum(layer_matmul_params(cfg)) * n  # q/k/v/o and the MLP (SwiGLU's three matrices)
    attention = 2 * 2 * q * (t * (t + 1) // 2) * n  # q.k and p.v over the causal triangle
    has_proj = bool(getattr(cfg, "has_projections", False))
    proj = 2 * t * cfg.embed_dim * h * has_proj + 2 * cfg.embed_dim * h * has_proj
    lm_head = 2 * cfg.embed_dim * cfg.vocab_size
    return float(linear + attention + proj + lm_head)


def serving_paged() -> str:
    """What `ShardedModel` serves the paged step with here: `IMPL` (token-major blocks) or `IMPL:heads`."""
    from models.paged_attention import block_layout_for, default_impl

    impl = default_impl()
    return f"{impl}:heads" if block_layout_for(impl) == "heads" else impl


def _jax_decode_contenders(
    params: Any, cfg: Any, prompts: Any, steps: int, block_size: int, paged_impls: Sequence[str] = ()
) -> dict[str, Callable[[], None]]:
    """Contiguous `decode` (cache as long as context + steps) and paged `extend_paged` after a prefill.

    One paged contender per attention implementation in `paged_impls` (default: what serving runs,
    `serving_paged()`), each on its own pool: named "paged" when there is one, "paged:<impl>" when
    several are compared.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import steps as model_steps  # the whole-model steps of every family

    bsz, ctx = prompts.shape
    cap = ctx + steps + 1
    _, kv = model_steps.prefill(params, cfg, prompts, np.full(bsz, ctx, np.int32))
    state: dict[str, Any] = {"cache": DecodeCache.from_kv(kv, cap)}  # the per-layer head-major decode layout
    tok = jnp.asarray(prompts[:, -1])
    positions = [jnp.full((bsz,), ctx + i, jnp.int32) for i in range(steps)]

    def run_contiguous() -> None:
        cache = state["cache"]
        for pos in positions:
            logits, cache = model_steps.decode(params, cfg, tok, pos, cache)
        jax.block_until_ready(logits)
        state["cache"] = cache

    contenders: dict[str, Callable[[], None]] = {"jax": run_contiguous}
    per_seq = (cap + block_size - 1) // block_size
    width = 1
    while width < per_seq:  # the engine's power-of-two table-width bucket over the filled blocks
        width *= 2
    tables = jnp.asarray(
        np.pad(np.arange(bsz * per_seq, dtype=np.int32).reshape(bsz, per_seq), ((0, 0), (0, width - per_seq)))
    )
    ones = jnp.ones((bsz,), jnp.int32)
    paged_impls = tuple(paged_impls) or (serving_paged(),)
    for name in paged_impls:
        impl, _, layout = name.partition(":")  # "xla:heads": impl "xla" over a pool of head-major blocks
        layout = layout or "tokens"
        pool = init_paged_cache(cfg, bsz * per_seq, block_size, dtype=kv.k.dtype, block_layout=layout)
        filled = jnp.full((bsz,), ctx, jnp.int32)
        state["pages", name] = insert_into_pages(pool, kv, tables, filled, block_layout=layout)

        def run_paged(name: str = name, impl: str = impl, layout: str = layout) -> None:
            cache = state["pages", name]
            for pos in positions:
                logits, cache = model_steps.extend_paged(
                    params, cfg, tok[:, None], pos, ones, cache, tables, attention=impl, block_layout=layout
                )
            jax.block_until_ready(logits)
            state["pages", name] = cache

        contenders["paged" if len(paged_impls) == 1 else f"paged:{name}"] = run_paged
    del kv
    return contenders


def _paged_ab(args: argparse.Namespace, cfg: Any, params: Any, rng: Any) -> dict[str, Any]:
    """`--paged-ab A,B`: paged decode steps with attention implementations A and B, interleaved, per batch."""
    import numpy as np

    impls = args.paged_ab.split(",")
    base = f"paged:{impls[0]}"
    print(f"paged decode A/B at context {args.context}, {args.decode_steps} steps per sample; ms per step (min/median)")
    print(
        f"  {'batch':>5}" + "".join(f"{i:>18}" for i in impls) + "".join(f"{i + '/' + impls[0]:>22}" for i in impls[1:])
    )
    gate = RatioGate(args.max_load, args.allow_loaded, own_threads(args))
    rows = []
    for bsz in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(3, cfg.vocab_size, (bsz, args.context)).astype(np.int32)
        contenders = _jax_decode_contenders(params, cfg, prompts, args.decode_steps, args.block_size, impls)
        del contenders["jax"]
        load = load_avg()
        raw = interleaved(contenders, args.reps)
        ms = {k: [x / args.decode_steps * 1e3 for x in v] for k, v in raw.items()}
        cells = "".join(f"{stats(ms[f'paged:{i}'])[0]:>9.1f}/{stats(ms[f'paged:{i}'])[1]:<8.1f}" for i in impls)
        # speed-up of each contender over the first: min over min and median over median
        ratios = "".join(
            gate(min(ms[base]) / min(ms[f"paged:{i}"]), 10)
            + f" ({statistics.median(ms[base]) / statistics.median(ms[f'paged:{i}']):.2f}x)"
            for i in impls[1:]
        )
        print(f"  {bsz:>5}{cells}{ratios}   load {load:.2f} -> {load_avg():.2f}", flush=True)
        rows.append({"batch": bsz, **{f"{k}_ms": v for k, v in ms.items()}})
    return {"paged_ab": rows}


def _paged_layout_ab(args: argparse.Namespace, cfg: Any, rng: Any) -> dict[str, Any]:
    """`--paged-layout-ab`: `paged_decode_attention` over every layer of a random pool, per batch, with the
    blocks token-major (today's `PagedKVCache`, impl "xla" and "xla_tokens") and head-major
    (`block_layout="heads"`, a pool layout kv_pool / kv_transfer do not have yet), interleaved."""
    import jax.numpy as jnp
    import numpy as np

    nl, h, d, bs, ctx = cfg.num_layers, cfg.num_heads, cfg.head_dim, args.block_size, args.context
    names = ("xla", "xla_tokens", "heads")
    print(f"paged attention layout A/B at context {ctx}, {nl} layers, attention only; ms per step (min/median)")
    print(f"  {'batch':>5}" + "".join(f"{n:>18}" for n in names) + "".join(f"{n + '/xla':>22}" for n in names[1:]))
    gate = RatioGate(args.max_load, args.allow_loaded, own_threads(args))
    rows = []
    for bsz in [int(b) for b in args.batches.split(",")]:
        per_seq = -(-(ctx + 1) // bs)
        width = 1 << (per_seq - 1).bit_length()  # the engine's power-of-two table width
        n = bsz * per_seq + 1
        tables = np.zeros((bsz, width), np.int32)
        tables[:, :per_seq] = rng.permutation(n - 1)[: bsz * per_seq].reshape(bsz, per_seq) + 1
        kp = rng.standard_normal((nl, n, bs, h, d), np.float32)
        vp = rng.standard_normal((nl, n, bs, h, d), np.float32)
        pools = {
            "tokens": (jnp.asarray(kp), jnp.asarray(vp)),
            "heads": (jnp.asarray(kp.transpose(0, 1, 3, 2, 4)), jnp.asarray(vp.transpose(0, 1, 3, 2, 4))),
        }
        del kp, vp
        q = jnp.asarray(rng.standard_normal((bsz, h, d), np.float32))
        lengths = jnp.full((bsz,), ctx, jnp.int32)
        tab = jnp.asarray(tables)

        contenders = {name: _layout_contender(name, nl, d, pools, q, tab, lengths) for name in names}
        load = load_avg()
        ms = {k: [x * 1e3 for x in v] for k, v in interleaved(contenders, args.reps).items()}
        cells = "".join(f"{stats(ms[k])[0]:>9.1f}/{stats(ms[k])[1]:<8.1f}" for k in names)
        ratios = "".join(
            "  "
            + gate(min(ms["xla"]) / min(ms[k]), 10)
            + f" ({statistics.median(ms['xla']) / statistics.median(ms[k]):.2f}x)"
            for k in names[1:]
        )
        print(f"  {bsz:>5}{cells}{ratios}   load {load:.2f} -> {load_avg():.2f}", flush=True)
        rows.append({"batch": bsz, **{f"{k}_ms": v for k, v in ms.items()}})
    return {"paged_layout_ab": rows}


def _layout_contender(name: str, nl: int, d: int, pools: Any, q: Any, tab: Any, lengths: Any) -> Callable[[], None]:
    """One `--paged-layout-ab` contender: attention over all `nl` layers of its pool, as one jitted call."""
    import jax
    import jax.numpy as jnp

    from models.paged_attention import paged_decode_attention

    impl, layout = ("xla", "heads") if name == "heads" else (name, "tokens")
    kpool, vpool = pools[layout]

    @jax.jit
    def step(q0: Any, kp: Any, vp: Any, tables: Any, lens: Any) -> Any:
        acc = jnp.zeros_like(q0)
        for i in range(nl):  # each layer's query depends on the previous output, as in the model
            acc = acc + paged_decode_attention(
                q0 + 1e-3 * acc, kp, vp, tables, lens, scale=d**-0.5, impl=impl, layer=i,
                new_kv=(q0, q0), block_layout=layout,
            )  # fmt: skip
        return acc

    return lambda: jax.block_until_ready(step(q, kpool, vpool, tab, lengths))


def _decode_ab(args: argparse.Namespace, cfg: Any, params: Any, rng: Any) -> dict[str, Any]:
    """`--decode-ab`: contiguous decode steps over the stacked `KVCache` and over a `DecodeCache`, interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import steps as model_steps  # the whole-model steps of every family

    ctx, steps = args.context, args.decode_steps
    print(f"contiguous decode A/B at context {ctx}, {steps} steps per sample; ms per step (min/median)")
    print(f"  {'batch':>5}{'stacked':>18}{'head-major':>18}{'speed-up':>22}")
    gate = RatioGate(args.max_load, args.allow_loaded, own_threads(args))
    rows = []
    for bsz in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(3, cfg.vocab_size, (bsz, ctx)).astype(np.int32)
        _, kv = model_steps.prefill(params, cfg, prompts, np.full(bsz, ctx, np.int32))
        cap = ctx + steps + 1
        pad = ((0, 0), (0, 0), (0, cap - ctx), (0, 0), (0, 0))
        state: dict[str, Any] = {
            "stacked": KVCache(k=jnp.pad(kv.k, pad), v=jnp.pad(kv.v, pad)),
            "head_major": DecodeCache.from_kv(kv, cap),
        }
        del kv
        tok = jnp.asarray(prompts[:, -1])
        positions = [jnp.full((bsz,), ctx + i, jnp.int32) for i in range(steps)]

        def run(name: str, state: dict[str, Any] = state, tok: Any = tok, positions: list[Any] = positions) -> None:
            cache = state[name]
            for pos in positions:
                logits, cache = model_steps.decode(params, cfg, tok, pos, cache)
            jax.block_until_ready(logits)
            state[name] = cache

        load = load_avg()
        raw = interleaved({k: partial(run, k) for k in ("stacked", "head_major")}, args.reps)
        ms = {k: [x / steps * 1e3 for x in v] for k, v in raw.items()}
        cells = "".join(f"{stats(ms[k])[0]:>9.1f}/{stats(ms[k])[1]:<8.1f}" for k in ("stacked", "head_major"))
        ratio = gate(min(ms["stacked"]) / min(ms["head_major"]), 10) + (
            f" ({statistics.median(ms['stacked']) / statistics.median(ms['head_major']):.2f}x)"
        )
        print(f"  {bsz:>5}{cells}{ratio}   load {load:.2f} -> {load_avg():.2f}", flush=True)
        rows.append({"batch": bsz, **{f"{k}_ms": v for k, v in ms.items()}})
    return {"decode_ab": rows}


def _torch_decode_contender(hf: Any, torch: Any, prompts: Any, steps: int, device: str) -> Callable[[], float]:
    """transformers decode steps (DynamicCache) after a prefill; each sample restarts from that context.

    Returns the seconds of the `steps` decode steps only: the cache copy that restarts the next
    sample is made after the clock stops.
    """
    import copy
    import inspect

    # transformers 5.2x names the cache `cache`; earlier releases `past_key_values`
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = hf(input_ids=torch.from_numpy(prompts).long().to(device), use_cache=True, logits_to_keep=1)
    base = getattr(out, name)
    tok = torch.from_numpy(prompts[:, -1:]).long().to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    state = {"cache": copy.deepcopy(base)}

    def run() -> float:
        cache = state["cache"]
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(steps):
                cache = getattr(hf(input_ids=tok, use_cache=True, **{name: cache}), name)
        sync()
        elapsed = time.perf_counter() - t0
        state["cache"] = copy.deepcopy(base)
        return elapsed

    return run


def _e2e(args: argparse.Namespace, cfg: Any, hf: Any, torch: Any) -> dict[str, Any]:
    """`LLM.generate` (one LLM per `--e2e-decode-steps` value) vs transformers `generate`, interleaved.

    Greedy, `ignore_eos`, on the same weights (without torch: the preset's random weights, jax only). Every
    round (the warm-up and each repetition) draws new random prompts, the same for every contender in it: with
    prefix caching on (the default) a repeated prompt would be a cache hit that transformers has no equivalent
    of. transformers gets batches of `--e2e-torch-batch` equal-length prompts (no padding; default all at once)
    and its default attention. Each run's CPU time (this process, all threads) is reported beside its wall time.
    """
    import tempfile

    import jax
    import numpy as np

    from jaxserve.core.request import SamplingParams
    from jaxserve.llm import LLM
    from jaxserve.runtime.controller import ControllerConfig
    from models.checkpoint import params_from_hf_tensors, save_checkpoint
    from models.sharding import sharded_class

    n, plen, new = args.e2e_prompts, args.e2e_prompt_len, args.e2e_new_tokens
    steps = [int(x) for x in str(args.e2e_decode_steps).split(",")]
    layouts = [x for x in args.e2e_layouts.split(",") if x] or [None]  # None: what serving picks
    impls = [x for x in args.e2e_impls.split(",") if x] or [None]
    # one LLM per (decode steps per call, pool layout, attention impl); named "jax N=k" (+ " LAYOUT" with
    # --e2e-layouts, + " IMPL" with --e2e-impls)
    variants = {
        f"jax N={k}" + (f" {lay}" if lay else "") + (f" {impl}" if impl else ""): (k, lay, impl)
        for k in steps
        for lay in layouts
        for impl in impls
    }
    rng = np.random.default_rng(1)
    # one prompt set per round (warm-up + reps), shared by the contenders of that round
    rounds = [rng.integers(3, cfg.vocab_size, (n, plen)).astype(np.int64) for _ in range(args.e2e_reps + 1)]
    source = args.model  # a preset name: random weights
    if hf is not None:
        source = tempfile.mkdtemp(prefix="jaxserve-bench-")
        tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
        model = sharded_class(cfg).from_params(cfg, params_from_hf_tensors(tensors, cfg), 1, 1, jax.devices()[:1])
        save_checkpoint(source, model)
        del model
    # a pool that holds every sequence at once and a batch cap of --e2e-max-batch, as transformers batches all
    blocks = n * -(-(plen + new) // 16) + 16
    defaults = {"model": source, "deployment": "colocated:tp1"}
    llms = {
        name: LLM(**defaults, block_layout=lay, attention_impl=impl)
        if args.e2e_defaults
        else LLM(
            **defaults,
            config=ControllerConfig(
                limits=ServingLimits(
                    block_size=16,
                    num_kv_blocks=blocks,
                    max_decode_batch=args.e2e_max_batch,
                    max_batch_tokens=max(512, plen),
                ),
                decode_steps_per_call=k,
            ),
            block_layout=lay,
            attention_impl=impl,
        )
        for name, (k, lay, impl) in variants.items()
    }
    for name, llm in llms.items():
        print(f"  {name}: KV pool blocks {llm.controller.colocated_instances[0].pages[0].block_layout!r}")
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    cpu: dict[str, list[float]] = {}
    turn: dict[str, int] = {}  # each contender's next round

    def next_round(name: str) -> Any:
        k = turn.get(name, 0)
        turn[name] = k + 1
        return rounds[k]

    def timed_cpu(name: str, fn: Callable[[], None]) -> None:
        c0 = time.process_time()
        fn()
        cpu.setdefault(name, []).append(time.process_time() - c0)

    def run_jax(name: str) -> Callable[[], None]:
        def run() -> None:
            batch = [list(map(int, p)) for p in next_round(name)]
            holder: list[Any] = []
            timed_cpu(name, lambda: holder.append(llms[name].generate(batch, sp)))
            outs = holder[0]
            assert all(len(o.token_ids) == new for o in outs)
            outputs[name] = [list(o.token_ids) for o in outs]

        return run

    torch_batch = args.e2e_torch_batch or n

    def run_torch() -> None:
        prompts = next_round("torch")

        def gen() -> None:
            generated: list[list[int]] = []
            with torch.inference_mode():
                for i in range(0, n, torch_batch):
                    ids = torch.from_numpy(prompts[i : i + torch_batch])
                    out = hf.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=new,
                        min_new_tokens=new,
                        do_sample=False,
                        pad_token_id=cfg.pad_token_id,
                    )
                    generated.extend(out[:, plen:].tolist())
            outputs["torch"] = generated

        timed_cpu("torch", gen)

    contenders: dict[str, Callable[[], Any]] = {name: run_jax(name) for name in variants}
    if hf is not None:
        contenders["torch"] = run_torch
    print()
    workload = f" ({args.e2e_workload})" if args.e2e_workload else ""
    print(
        f"end to end{workload}: {n} prompts x {plen} tokens, {new} new tokens each, greedy, new prompts each round; "
        f"N = decode steps per call; transformers batch {torch_batch}; s per run (min / median), CPU s of the "
        f"process (median); load average {load_avg():.2f}"
    )
    raw = interleaved(contenders, args.e2e_reps)
    for llm in llms.values():
        llm.shutdown()
    out_tokens = n * new
    for k, v in raw.items():
        cpu_med = statistics.median(cpu[k][1:]) if len(cpu.get(k, [])) > 1 else float("nan")  # [0]: warm-up
        print(
            f"  {k:<18}{min(v):>8.2f} /{statistics.median(v):>8.2f}   {out_tokens / min(v):>8.0f} output tokens/s"
            f"   cpu {cpu_med:>7.2f} s"
        )
    names = list(variants)
    same = all(outputs[k] == outputs[names[0]] for k in names)
    print(f"  outputs identical across the LLMs: {same}; load average after: {load_avg():.2f}")
    same_hf = None
    if "torch" in outputs:  # the last round's prompts on both sides
        same_hf = outputs["torch"] == outputs[names[0]]
        print(f"  greedy tokens identical to transformers generate: {same_hf}")
    gate = RatioGate(args.max_load, args.allow_loaded, own_threads(args))
    for k in names[1:]:
        med = statistics.median(raw[names[0]]) / statistics.median(raw[k])
        print(f"  {k} / {names[0]} throughput: {gate(min(raw[names[0]]) / min(raw[k]))} (median {med:.2f}x)")
    if hf is not None:
        for k in names:
            med = statistics.median(raw["torch"]) / statistics.median(raw[k])
            ratio = gate(min(raw["torch"]) / min(raw[k]))
            print(f"  LLM.generate ({k}) / transformers generate: {ratio} (median {med:.2f}x; target >= 2x)")
    return {
        "workload": args.e2e_workload,
        "prompts": n,
        "prompt_len": plen,
        "new_tokens": new,
        "torch_batch": torch_batch,
        "same_outputs": same,
        "same_as_transformers": same_hf,
        **{f"{k}_s": v for k, v in raw.items()},
        **{f"{k}_cpu_s": v[1:] for k, v in cpu.items()},
    }


def _plot(path: str, rows: list[dict[str, Any]], model: str, dtype: str) -> None:
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("jax_ms", "jax contiguous"), ("paged_ms", "jax paged"), ("torch_ms", "transformers")):
        if all(key in r for r in rows):
            ax.plot(batches, [min(r[key]) for r in rows], marker="o", label=label)
    ax.plot(batches, [r["floor_ms"] for r in rows], linestyle="--", color="gray", label="bandwidth floor")
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per decode step (min)")
    ax.set_title(f"{model} {dtype}: decode step time vs batch")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    raise SystemExit(main())
