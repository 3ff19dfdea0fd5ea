"""Paged decode attention of the CPU kernel with grouped K/V heads: MHA vs GQA vs MQA, grouped vs per-query-head reads.

One layer of a random head-major pool ([N, KVH, bs, D] blocks, shuffled tables, every row `context` positions
long plus the step's own token, as a decode step calls it), `--heads` query heads, per batch and context.
Contenders, run interleaved (A B C ... A B C ...) `--reps` >= 5 times after a warm-up round, median and min:

* `mha`      the kernel (`impl="cpu_kernel"`) over KVH = H: one work item per (row, head);
* `gqa`      the kernel over KVH = H / `--gqa-group`: one item per (row, K/V head) attending its G query heads
             to each block it fetches (this change);
* `gqa_rep`  the kernel over that pool with every K/V head repeated for its G query heads (repeat_kv, built
             once outside the timing): K/V read once per *query* head, the per-head path the kernel had;
* `gqa_xla`  `impl="xla_heads_flat"` over the grouped pool: what impl="cpu_kernel" ran for a GQA pool before
             this change (the XLA chunk loop's grouped einsums);
* `mqa`, `mqa_rep`, `mqa_xla` the same for KVH = 1;
* `mha_base` (with `--baseline-source FILE.cc`): another build of the kernel, e.g. the source before this change
             (`git show <commit>:models/kernels/paged_attention_cpu.cc > /tmp/base.cc`), over the MHA pool,
             so MHA's speed can be compared across the change in the same run.

The release build of the kernel runs (`JAXSERVE_KERNEL_CHECKS=0`). The load average is printed before and
after each row; the machine is shared, so read ratios within a row (interleaved), not across runs.

    PYTHONPATH=. .venv/bin/python scripts/bench_attention.py --threads 2
    PYTHONPATH=. .venv/bin/python scripts/bench_attention.py --threads 2 --baseline-source /tmp/base.cc
    PYTHONPATH=. .venv/bin/python scripts/bench_attention.py --batches 8 --contexts 512 --reps 5   # smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

from bench_model import interleaved, load_avg, pin_threads  # this script's folder is on sys.path when it runs


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--heads", type=int, default=12, help="query heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--gqa-group", type=int, default=3, help="query heads per K/V head of the GQA pool")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="pin to N cores and size XLA's pool to N (0: as is)")
    ap.add_argument("--baseline-source", default="", help="a kernel source to build and time as mha_base")
    args = ap.parse_args()
    if args.reps < 5:
        ap.error("--reps must be >= 5")
    if args.heads % args.gqa_group:
        ap.error("--heads must be a multiple of --gqa-group")
    return args


def build_baseline(source: str) -> str:
    """Build `source` with the kernel's flags and register it as an FFI target; returns the target's name."""
    import ctypes

    import jax

    from models.kernels import cpu as cpu_kernel

    cxx = cpu_kernel.compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler for --baseline-source")
    lib = os.path.join(tempfile.mkdtemp(prefix="jaxserve-bench-"), "baseline.so")
    flags = (*cpu_kernel._FLAGS, *cpu_kernel._NATIVE)
    subprocess.run([cxx, *flags, f"-I{jax.ffi.include_dir()}", source, "-o", lib], check=True)
    handle = ctypes.cdll.LoadLibrary(lib)
    jax.ffi.register_ffi_target("bench_baseline", jax.ffi.pycapsule(handle.JaxservePagedAttention), platform="cpu")
    return "bench_baseline"


def _contenders(
    q: Any,
    tab: Any,
    lengths: Any,
    pools: dict[int, tuple[Any, ...]],
    run_kernel: Callable[..., Any],
    run_base: Callable[..., Any] | None,
    xla: Callable[..., Any],
    h: int,
    g: int,
) -> dict[str, Callable[[], Any]]:
    """One row's contenders over its pools (K/V heads -> (k pages, v pages, new k, new v))."""
    import jax
    import jax.numpy as jnp

    contenders: dict[str, Callable[[], Any]] = {}

    def add(name: str, fn: Callable[..., Any], pool: tuple[Any, ...]) -> None:
        contenders[name] = lambda: jax.block_until_ready(fn(q, pool[0], pool[1], tab, lengths, *pool[2:]))

    add("mha", run_kernel, pools[h])
    if run_base is not None:
        add("mha_base", run_base, pools[h])
    for name, kvh in (("gqa", h // g), ("mqa", 1)):
        rep = tuple(jnp.repeat(x, h // kvh, axis=1) for x in pools[kvh])  # [.., H, ..]: one copy per query head
        add(name, run_kernel, pools[kvh])
        add(f"{name}_rep", run_kernel, rep)
        add(f"{name}_xla", xla, pools[kvh])
    return contenders


def main() -> int:
    args = _parse()
    pin_threads(args.threads)
    os.environ["JAXSERVE_KERNEL_CHECKS"] = "0"  # time the release build
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.kernels import cpu as cpu_kernel
    from models.paged_attention import paged_decode_attention

    if cpu_kernel.paged_attention_target() is None:
        raise SystemExit(f"the CPU kernel is not available here: {cpu_kernel.build_error()}")
    baseline = build_baseline(args.baseline_source) if args.baseline_source else ""
    h, d, bs, g = args.heads, args.head_dim, args.block_size, args.gqa_group
    scale = d**-0.5
    rng = np.random.default_rng(0)
    print(f"paged decode attention, CPU kernel, H={h} query heads, head_dim {d}, block size {bs}, one layer, f32; "
          f"{args.reps} reps interleaved; ms median (min); threads {args.threads or 'all'}")  # fmt: skip
    print(f"load average before: {load_avg():.2f}")

    def kernel(target: str = "") -> Callable[..., Any]:
        @jax.jit
        def run(q: Any, kp: Any, vp: Any, tables: Any, lengths: Any, kn: Any, vn: Any) -> Any:
            if target:  # the baseline build, called as paged_attention.py calls the kernel
                call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
                return call(q, kp[None], vp[None], tables, lengths, jnp.asarray(0, jnp.int32), kn, vn,
                            scale=np.float32(scale), has_new=True)  # fmt: skip
            return paged_decode_attention(q, kp, vp, tables, lengths, scale=scale, impl="cpu_kernel",
                                          new_kv=(kn, vn), block_layout="heads")  # fmt: skip

        return run

    @jax.jit
    def xla(q: Any, kp: Any, vp: Any, tables: Any, lengths: Any, kn: Any, vn: Any) -> Any:
        return paged_decode_attention(q, kp, vp, tables, lengths, scale=scale, impl="xla_heads_flat",
                                      new_kv=(kn, vn), block_layout="heads")  # fmt: skip

    run_kernel = kernel()
    run_base = kernel(baseline) if baseline else None
    for ctx in [int(x) for x in args.contexts.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            per_row = -(-ctx // bs)
            width = 1 << (per_row - 1).bit_length()  # the engine's power-of-two table width
            n = b * per_row + 1
            tables = np.zeros((b, width), np.int32)
            tables[:, :per_row] = rng.permutation(n - 1)[: b * per_row].reshape(b, per_row) + 1
            tab, lengths = jnp.asarray(tables), jnp.full((b,), ctx, jnp.int32)
            q = jnp.asarray(rng.standard_normal((b, h, d), np.float32))
            pools: dict[int, tuple[Any, ...]] = {}
            for kvh in sorted({h, h // g, 1}):
                kp = rng.standard_normal((n, kvh, bs, d), np.float32)
                vp = rng.standard_normal((n, kvh, bs, d), np.float32)
                kn, vn = rng.standard_normal((2, b, kvh, d), np.float32)
                pools[kvh] = tuple(jnp.asarray(x) for x in (kp, vp, kn, vn))
            contenders = _contenders(q, tab, lengths, pools, run_kernel, run_base, xla, h, g)
            before = load_avg()
            ms = {k: [x * 1e3 for x in v] for k, v in interleaved(contenders, args.reps).items()}
            med = {k: statistics.median(v) for k, v in ms.items()}
            print(f"\nbatch {b}, context {ctx} (K+V bytes read: MHA {2 * b * ctx * h * d * 4 / 2**20:.0f} MiB, "
                  f"GQA {2 * b * ctx * (h // g) * d * 4 / 2**20:.0f} MiB, MQA {2 * b * ctx * d * 4 / 2**20:.1f} MiB)"
                  f"   load {before:.2f} -> {load_avg():.2f}", flush=True)  # fmt: skip
            for k, v in ms.items():
                print(f"  {k:>9}  {med[k]:8.2f} ({min(v):.2f})   mha / {k}: {med['mha'] / med[k]:5.2f}x")
            for name in ("gqa", "mqa"):
                print(f"  {name}: {med[f'{name}_rep'] / med[name]:.2f}x the per-query-head reads, "
                      f"{med[f'{name}_xla'] / med[name]:.2f}x the XLA loop it replaced")  # fmt: skip
            del pools, contenders  # free this row's pools before the next row's
    print(f"\nload average after: {load_avg():.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
