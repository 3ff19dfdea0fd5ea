"""Bare matmul rates of XLA:CPU (JAX) and torch on this machine, fp32 and bf16, at a model's linear-layer shapes.

What bounds the prefill and the large-batch decode step against transformers: both run the same products, so
if the two libraries' bare matmuls reach the same GFLOP/s, no schedule makes one model's prefill much faster
than the other's in the same dtype. Per shape and row count, the four contenders (jax f32, jax bf16 with fp32
accumulation, torch f32, torch bf16) run interleaved (A B C D A B C D ...) `--reps` times after a warm-up
round, each sample `--inner` products; the minimum per product is printed with its GFLOP/s, and the load
average before and after.

    PYTHONPATH=. .venv/bin/python scripts/bench_matmul.py --threads 2                    # SmolLM2-135M's shapes
    PYTHONPATH=. .venv/bin/python scripts/bench_matmul.py --threads 2 --shapes 768x3072,768x50272
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from bench_model import pin_threads  # this script's folder is on sys.path when it runs


def _jax_run(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], None]:
    def run(a: Any, b: Any) -> None:
        fn(a, b).block_until_ready()

    return run


def _torch_run(torch: Any) -> Callable[[Any, Any], None]:
    def run(a: Any, b: Any) -> None:
        with torch.inference_mode():
            torch.matmul(a, b)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default="576x1536,576x1728,1536x576,576x49152", help="K x N of the weight, comma-separated"
    )
    ap.add_argument("--rows", default="1,8,32,512")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=5, help="products per sample")
    ap.add_argument("--threads", type=int, default=0, help="pin both libraries to N cores (0: leave as is)")
    args = ap.parse_args()
    pin_threads(args.threads)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads); "
          f"load average before {os.getloadavg()[0]:.2f}; min of {args.reps} interleaved samples of {args.inner}")  # fmt: skip
    print(f"{'K x N':>12}{'rows':>6}{'jax f32':>18}{'jax bf16':>18}{'torch f32':>18}{'torch bf16':>18}   ms (GFLOP/s)")
    f32 = jax.jit(lambda a, b: a @ b)
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        k, n = (int(x) for x in shape.split("x"))
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            ja, jb = jnp.asarray(x), jnp.asarray(w)
            ja16, jb16 = ja.astype(jnp.bfloat16), jb.astype(jnp.bfloat16)
            ta, tb = torch.from_numpy(x), torch.from_numpy(w)
            ta16, tb16 = ta.bfloat16(), tb.bfloat16()

            contenders: dict[str, tuple[Callable[..., Any], tuple[Any, Any]]] = {
                "jax f32": (_jax_run(f32), (ja, jb)),
                "jax bf16": (_jax_run(bf16), (ja16, jb16)),
                "torch f32": (_torch_run(torch), (ta, tb)),
                "torch bf16": (_torch_run(torch), (ta16, tb16)),
            }
            best = {name: float("inf") for name in contenders}
            for fn, operands in contenders.values():
                fn(*operands)
            for _ in range(args.reps):
                for name, (fn, operands) in contenders.items():
                    t0 = time.perf_counter()
                    for _ in range(args.inner):
                        fn(*operands)
                    best[name] = min(best[name], (time.perf_counter() - t0) / args.inner)
            flops = 2 * rows * k * n
            cells = "".join(f"{best[c] * 1e3:>9.3f} ({flops / best[c] / 1e9:>4.0f})  " for c in contenders)
            print(f"{shape:>12}{rows:>6}  {cells}", flush=True)
    print(f"load average after {os.getloadavg()[0]:.2f} (this benchmark's own threads count in it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
