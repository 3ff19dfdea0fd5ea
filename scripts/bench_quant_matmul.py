"""Decode matmuls over quantized weights: the C++ kernel vs the XLA form vs the fp32 dense matmul.

Per model (opt-125m, SmolLM2-135M), two groups of a decode step's weights, random (normal, std 0.02):
* `layers`: every linear layer of every layer, as the serving path fuses them (opt-125m: qkv 768x2304, out
  768x768, fc1 768x3072, fc2 3072x768, x 12 layers; SmolLM2: qkv 576x960, o 576x576, gate|up 576x3072, down
  1536x576, x 30 layers), one jitted call running them all: the weights stream from memory as in a step;
* `lm_head`: the vocabulary projection (768x50272; 576x49152);
* `step` (ask for it with `--groups`): both, a decode step's every matmul.
Per scheme (Q4_1 and Q8_0 as a GGUF file stores them, int8 per-channel, int4 group 64) and batch, three
contenders run interleaved (A B C A B C ...) `--reps` >= 5 times after a warm-up round, each sample `--inner`
calls: `fp32` (x @ W over float32 weights, XLA's dot), `xla` (`quant_matmul(impl="xla")`: dequantize in the
graph, then the dot), `kernel` (`impl="cpu_kernel"`). Printed: the min ms per call of the samples (on a
shared machine the min is the run least disturbed by others; the kernel's speed-up is also given from the
medians), the speed-up over fp32, the bytes of weights each call reads and the GB/s that makes (min). The
load average is printed before and after each model; read ratios within a row (interleaved), not across runs.

`--clock cpu` times the process's CPU time instead of the wall clock: with `--threads 1` that is the compute
time of each call however many other processes share the core (a loaded machine), though not their effect
on the caches and the memory bus.

    PYTHONPATH=. .venv/bin/python scripts/bench_quant_matmul.py --threads 2
    PYTHONPATH=. .venv/bin/python scripts/bench_quant_matmul.py --threads 1 --clock cpu --groups step --batches 1
    PYTHONPATH=. .venv/bin/python scripts/bench_quant_matmul.py --models smollm2-135m --batches 1 --reps 5  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench_model import interleaved, load_avg, pin_threads  # this script's folder is on sys.path when it runs

MODELS: dict[str, dict[str, Any]] = {
    "opt-125m": {"layers": 12, "shapes": [(768, 2304), (768, 768), (768, 3072), (3072, 768)], "head": (768, 50272)},
    "smollm2-135m": {
        "layers": 30,
        "shapes": [(576, 960), (576, 576), (576, 3072), (1536, 576)],
        "head": (576, 49152),
    },
}
SCHEMES = ("q4_1", "q8_0", "int8", "int4")


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--groups", default="layers,lm_head")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=3, help="calls per sample")
    ap.add_argument("--threads", type=int, default=0, help="pin to N cores and size XLA's pool to N (0: as is)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time")
    args = ap.parse_args()
    if args.reps < 5:
        ap.error("--reps must be >= 5")
    return args


def _quantize(w: Any, scheme: str) -> Any:
    import gguf
    import numpy as np

    from models import quant

    if scheme == "int8":
        return quant.quantize_int8(w)
    if scheme == "int4":
        return quant.quantize_int4(w, 64)
    kind = gguf.GGMLQuantizationType[scheme.upper()]
    raw = gguf.quants.quantize(np.ascontiguousarray(w.T), kind)  # [out, bytes per row], as a GGUF file holds it
    return quant.from_gguf(raw, scheme.upper(), w.shape[0])


def _timed(fn: Callable[..., Any], args: tuple[Any, ...], inner: int, clock: str) -> Callable[[], float]:
    """A sample of `fn`: `inner` calls, then one tiny jitted call, all timed. The tiny call takes what the runtime
    defers to the next execution (freeing the XLA form's hundreds of MB of float32 weights): untimed, it landed
    on whichever contender ran next (a kernel call after the XLA form: 20.2 ms CPU, else 12.6)."""
    import jax
    import jax.numpy as jnp

    now = time.process_time if clock == "cpu" else time.perf_counter
    settle = jax.jit(lambda a: a + 1)
    one = jnp.zeros((1,), jnp.float32)

    def run() -> float:
        t0 = now()
        for _ in range(inner):
            jax.block_until_ready(fn(*args))
        jax.block_until_ready(settle(one))
        return (now() - t0) / inner

    return run


def main() -> int:
    args = _parse()
    pin_threads(args.threads)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import quant
    from models.kernels import cpu as cpu_kernel

    if cpu_kernel.quant_matmul_target() is None:
        print("the kernel is unavailable:", cpu_kernel.quant_build_error())
        return 1
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]

    @jax.jit
    def dense(xs: list[jax.Array], ws: list[jax.Array]) -> list[jax.Array]:
        return [x @ w for x, w in zip(xs, ws, strict=True)]

    def quantized(impl: quant.Impl) -> Callable[..., Any]:
        @jax.jit
        def run(xs: list[jax.Array], ws: list[quant.QuantizedWeight]) -> list[jax.Array]:
            return [quant.quant_matmul(x, w, impl) for x, w in zip(xs, ws, strict=True)]

        return run

    print(
        f"{'model':13} {'group':8} {'scheme':6} {'B':>3}  {'fp32 ms':>8} {'xla ms':>8} {'kernel ms':>9}  "
        f"{'xla x':>6} {'kern x':>6} {'(med)':>6}  {'fp32 MB':>8} {'q MB':>7}  {'fp32 GB/s':>9} {'kern GB/s':>9}"
    )
    for model in args.models.split(","):
        spec = MODELS[model]
        print(f"# {model}: load average {load_avg():.2f}, {args.clock} clock")
        for group in args.groups.split(","):
            shapes = {
                "layers": spec["shapes"] * spec["layers"],
                "lm_head": [spec["head"]],
                "step": spec["shapes"] * spec["layers"] + [spec["head"]],
            }[group]
            ws = [(rng.standard_normal(s, np.float32) * np.float32(0.02)) for s in shapes]  # [in, out]
            ws_dev = [jnp.asarray(w) for w in ws]
            fp32_bytes = sum(w.nbytes for w in ws)
            for scheme in args.schemes.split(","):
                qs = [_quantize(w, scheme) for w in ws]
                qs = jax.tree.map(jnp.asarray, qs)
                q_bytes = sum(q.nbytes() for q in qs)
                for batch in batches:
                    xs = [jnp.asarray(rng.standard_normal((batch, s[0]), np.float32)) for s in shapes]
                    samples = interleaved(
                        {
                            "fp32": _timed(dense, (xs, ws_dev), args.inner, args.clock),
                            "xla": _timed(quantized("xla"), (xs, qs), args.inner, args.clock),
                            "kernel": _timed(quantized("cpu_kernel"), (xs, qs), args.inner, args.clock),
                        },
                        args.reps,
                    )
                    t = {k: min(v) for k, v in samples.items()}
                    med = {k: statistics.median(v) for k, v in samples.items()}
                    print(
                        f"{model:13} {group:8} {scheme:6} {batch:>3}  {t['fp32'] * 1e3:8.2f} {t['xla'] * 1e3:8.2f} "
                        f"{t['kernel'] * 1e3:9.2f}  {t['fp32'] / t['xla']:6.2f} {t['fp32'] / t['kernel']:6.2f} "
                        f"{med['fp32'] / med['kernel']:6.2f}  "
                        f"{fp32_bytes / 1e6:8.1f} {q_bytes / 1e6:7.1f}  {fp32_bytes / t['fp32'] / 1e9:9.1f} "
                        f"{q_bytes / t['kernel'] / 1e9:9.1f}",
                        flush=True,
                    )
                del qs
        print(f"# {model}: load average {load_avg():.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
