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
graph, then the dot), `kernel` (`impl="cpu_kernel"`), `i8` (the kernel with int8 activations, llama.cpp's
decode arithmetic: block-32 schemes at batch <= 4, else the same as `kernel`). Printed: the min ms per call of the samples (on a
shared machine the min is the run least disturbed by others; the kernel's speed-up is also given from the
medians), the speed-up over fp32, the bytes of weights each call reads and the GB/s that makes (min). The
load average is printed before and after each model; read ratios within a row (interleaved), not across runs.

`--clock cpu` times the process's CPU time instead of the wall clock: with `--threads 1` that is the compute
time of each call however many other processes share the core (a loaded machine), though not their effect
on the caches and the memory bus.

    PYTHONPATH=. .venv/bin/python scripts/bench_quant_matmul.py --threads 2
    PYTHONPATH=. .venv/bin/python scripts/bench_quant_matmul.py --threads 1 --clock cpu --groups step --batches 1
    PYTHONPATH=. .venv/bin/python scripts/bench_quant_matmul.py --models smollm2-135m --batches 1 --reps 5  # smoke

`--model-steps`: the whole model's decode step instead (`ShardedModel.extend_paged` with one token a row, as
serving runs it; random weights of the preset,
batch 1 and `--batches`, `--context` tokens cached) at each precision, `float32` / `int8` / `int4`
(`ShardedModel.load(quantization=...)`), interleaved; printed per precision: the min ms a step, the speed-up
over float32, the bytes a token reads (every weight the step multiplies by, plus the KV it attends over) and
the bandwidth share (those bytes / step time, over the bandwidth of a 154 MB float32 `v @ W` probe):

    PYTHONPATH=. .venv/bin/python scripts/bench_quant_matmul.py --model-steps --models opt-125m --threads 2
"""

from __future__ import annotations

import argparse
import functools
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
    ap.add_argument("--model-steps", action="store_true", help="time whole decode steps per precision instead")
    ap.add_argument("--context", type=int, default=512, help="--model-steps: tokens cached")
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


def _step_bytes(model: Any, batch: int, context: int) -> int:
    """Bytes a decode step reads: every weight (a quantized one's values, scales and mins; the tied head once, as
    the head: the embedding reads one row) and the K/V of `context` tokens per row."""
    import jax
    import numpy as np

    from models import quant

    total = 0
    for state in model.run_params:
        leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
        for leaf in leaves:
            total += leaf.nbytes() if isinstance(leaf, quant.QuantizedWeight) else int(leaf.size) * leaf.dtype.itemsize
    cfg = model.cfg
    kv = 2 * cfg.num_layers * context * cfg.kv_heads * cfg.head_dim * np.dtype(model.dtype).itemsize
    return total + batch * kv


def model_steps(args: argparse.Namespace) -> int:
    """`--model-steps`: decode steps of the whole model per precision (see the module docstring)."""
    import os

    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.checkpoint import source_config
    from models.sharding import sharded_class

    probe = jnp.ones((6144, 6144), jnp.float32)  # 151 MB: the bandwidth probe
    vec = jnp.ones((1, 6144), jnp.float32)
    dot = jax.jit(lambda v, w: v @ w)
    dot(vec, probe).block_until_ready()
    best = min(interleaved({"probe": lambda: dot(vec, probe).block_until_ready()}, max(args.reps, 5))["probe"])
    gbs = probe.size * 4 / best / 1e9
    print(f"bandwidth probe: {gbs:.1f} GB/s (154 MB fp32 v @ W, min of {max(args.reps, 5)}); load {load_avg():.1f}")
    print(
        f"{'model':13} {'B':>3} {'precision':9} {'ms/step':>8} {'x fp32':>7} {'MB/token':>9} {'GB/s':>6} {'share':>6}"
    )
    for name in args.models.split(","):
        cfg = source_config(name)
        models = {
            q or "float32": sharded_class(cfg).load(name, 1, 1, jax.devices()[:1], quantization=q)
            for q in (None, "int8", "int4")
        }
        for batch in [int(b) for b in args.batches.split(",")]:
            # the paged step as serving runs it: one token a row at position context - 1, block tables as wide as
            # the filled blocks, the pool's layout and attention the ones `ShardedModel` picks here
            bs = 16
            width = -(-args.context // bs)
            tok = np.full((batch, 1), 5, np.int32)
            pos = np.full((batch,), args.context - 1, np.int32)
            ones = np.ones((batch,), np.int32)
            tables = np.arange(batch * width, dtype=np.int32).reshape(batch, width)
            caches = {k: m.init_paged_caches(batch * width, bs) for k, m in models.items()}

            def step(
                key: str,
                tok: Any,
                pos: Any,
                tables: Any,
                caches: dict[str, Any],
                models: dict[str, Any],
                ones: Any = ones,
            ) -> float:
                t0 = time.perf_counter()
                for _ in range(args.inner):
                    logits, caches[key] = models[key].extend_paged(tok, pos, ones, caches[key], tables)
                logits.block_until_ready()
                return (time.perf_counter() - t0) / args.inner

            contenders = {k: functools.partial(step, k, tok, pos, tables, caches, models) for k in models}
            samples = interleaved(contenders, args.reps)
            base = min(samples["float32"])
            for key, times in samples.items():
                ms, nbytes = min(times), _step_bytes(models[key], batch, args.context)
                rate = nbytes / ms / 1e9
                print(
                    f"{name:13} {batch:>3} {key:9} {ms * 1e3:8.2f} {base / ms:7.2f} {nbytes / 1e6:9.1f} {rate:6.1f} "
                    f"{rate / gbs:6.0%}"
                )
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} (LOADED if above the threads used)")
    return 0


def main() -> int:
    args = _parse()
    pin_threads(args.threads)
    if args.model_steps:
        return model_steps(args)
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

    def quantized(impl: quant.Impl, activations: str = "float32") -> Callable[..., Any]:
        @jax.jit
        def run(xs: list[jax.Array], ws: list[quant.QuantizedWeight]) -> list[jax.Array]:
            return [quant.quant_matmul(x, w, impl, activations) for x, w in zip(xs, ws, strict=True)]

        return run

    print(
        f"{'model':13} {'group':8} {'scheme':6} {'B':>3}  {'fp32 ms':>8} {'xla ms':>8} {'kernel ms':>9} {'i8 ms':>8}  "
        f"{'xla x':>6} {'kern x':>6} {'(med)':>6} {'i8 x':>6}  {'fp32 MB':>8} {'q MB':>7}  {'fp32 GB/s':>9} {'kern GB/s':>9}"
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
                            "i8": _timed(quantized("cpu_kernel", "int8"), (xs, qs), args.inner, args.clock),
                        },
                        args.reps,
                    )
                    t = {k: min(v) for k, v in samples.items()}
                    med = {k: statistics.median(v) for k, v in samples.items()}
                    print(
                        f"{model:13} {group:8} {scheme:6} {batch:>3}  {t['fp32'] * 1e3:8.2f} {t['xla'] * 1e3:8.2f} "
                        f"{t['kernel'] * 1e3:9.2f} {t['i8'] * 1e3:8.2f}  {t['fp32'] / t['xla']:6.2f} "
                        f"{t['fp32'] / t['kernel']:6.2f} {med['fp32'] / med['kernel']:6.2f} {t['fp32'] / t['i8']:6.2f}  "
                        f"{fp32_bytes / 1e6:8.1f} {q_bytes / 1e6:7.1f}  {fp32_bytes / t['fp32'] / 1e9:9.1f} "
                        f"{q_bytes / t['kernel'] / 1e9:9.1f}",
                        flush=True,
                    )
                del qs
        print(f"# {model}: load average {load_avg():.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
