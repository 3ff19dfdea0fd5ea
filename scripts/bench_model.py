"""Model micro-benchmark: our JAX OPT vs Hugging Face transformers (PyTorch) on the same random weights.

Measures, in one run on this machine's CPU:
* prefill tokens/s for one prompt of `--prompt-len` tokens (default 512), JAX and torch;
* decode step time at batch 1, 8, 16, 32 with `--context` (default 512) tokens already cached:
  JAX contiguous `decode`, JAX paged `extend_paged` (T=1) and torch with its `DynamicCache`;
* prefill FLOP/s as a fraction of a bare square `jnp.dot` with the same FLOPs.

    .venv/bin/python scripts/bench_model.py            # opt-125m shape, ~2-4 minutes on 2 cores
    .venv/bin/python scripts/bench_model.py --model opt-tiny --batches 1,8 --reps 2   # smoke run

Targets (issue 2): decode throughput >= 2x transformers at batch >= 16; prefill >= 70 % of the
bare matmul rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def prefill_flops(cfg: Any, t: int) -> float:
    """Matmul FLOPs of one t-token prefill with last-token logits (causal attention counted once)."""
    h, f, n = cfg.hidden_size, cfg.ffn_dim, cfg.num_layers
    linear = 2 * t * (4 * h * h + 2 * h * f) * n
    attention = 2 * 2 * h * (t * (t + 1) // 2) * n  # q.k and p.v over the causal triangle
    proj = 2 * t * cfg.embed_dim * h * (1 if cfg.has_projections else 0) + 2 * cfg.embed_dim * h * cfg.has_projections
    lm_head = 2 * cfg.embed_dim * cfg.vocab_size
    return float(linear + attention + proj + lm_head)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--torch-threads", type=int, default=0, help="0: leave torch's default")
    args = ap.parse_args()

    import torch
    import transformers

    from jaxserve.testing.hf import make_hf_model
    from models import opt
    from models.checkpoint import params_from_hf_tensors
    from models.config import get_config

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' past_key_values rename notices
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    cfg = get_config(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"model {cfg.name}: {cfg.num_params / 1e6:.1f}M params, float32; jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    print(
        f"cpus: {os.cpu_count()}, torch {torch.__version__} threads: {torch.get_num_threads()}, transformers on the same weights"
    )

    hf = make_hf_model(cfg, seed=0)
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    params = jax.tree.map(jnp.asarray, params_from_hf_tensors(tensors, cfg, source="in-memory HF model"))
    rng = np.random.default_rng(0)

    # ---------------- prefill ----------------
    t = args.prompt_len
    prompt = rng.integers(3, cfg.vocab_size, (1, t)).astype(np.int32)
    lengths = np.array([t], np.int32)
    jax_prefill = _time(lambda: jax.block_until_ready(opt.prefill(params, cfg, prompt, lengths)), args.reps)
    with torch.inference_mode():
        ids = torch.from_numpy(prompt).long()
        torch_prefill = _time(lambda: hf(input_ids=ids, use_cache=True, logits_to_keep=1), args.reps)
    flops = prefill_flops(cfg, t)
    # the bare-matmul reference: one square f32 jnp.dot with the prefill's FLOPs
    n = max(1, round((flops / 2) ** (1 / 3)))
    a = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot_s = _time(lambda: dot(a, b).block_until_ready(), args.reps)
    dot_rate = 2 * n**3 / dot_s
    jax_rate = flops / jax_prefill
    print()
    print(f"prefill, 1 x {t} tokens ({flops / 1e9:.1f} GFLOP)")
    print(f"  {'':<18}{'ms':>10}{'tok/s':>10}{'GFLOP/s':>10}")
    print(f"  {'jax':<18}{jax_prefill * 1e3:>10.1f}{t / jax_prefill:>10.0f}{jax_rate / 1e9:>10.1f}")
    print(
        f"  {'transformers':<18}{torch_prefill * 1e3:>10.1f}{t / torch_prefill:>10.0f}{flops / torch_prefill / 1e9:>10.1f}"
    )
    print(f"  {f'jnp.dot {n}^3':<18}{dot_s * 1e3:>10.1f}{'':>10}{dot_rate / 1e9:>10.1f}")
    print(f"  jax prefill / bare matmul rate: {jax_rate / dot_rate:.0%} (target >= 70%)")
    print(f"  jax / transformers prefill speed: {torch_prefill / jax_prefill:.2f}x")

    # ---------------- decode ----------------
    ctx, steps = args.context, args.decode_steps
    print()
    print(f"decode step at context {ctx} (median of {args.reps} x {steps} steps)")
    print(
        f"  {'batch':>5}{'jax ms':>10}{'paged ms':>10}{'torch ms':>10}{'jax tok/s':>11}{'torch tok/s':>12}{'jax/torch':>10}{'paged/torch':>12}"
    )
    for bsz in batches:
        prompts = rng.integers(3, cfg.vocab_size, (bsz, ctx)).astype(np.int32)
        jax_s, paged_s = _jax_decode_step_s(params, cfg, prompts, steps, args.reps, args.block_size)
        torch_s = _torch_decode_step_s(hf, prompts, steps, args.reps)
        print(
            f"  {bsz:>5}{jax_s * 1e3:>10.1f}{paged_s * 1e3:>10.1f}{torch_s * 1e3:>10.1f}{bsz / jax_s:>11.0f}"
            f"{bsz / torch_s:>12.0f}{torch_s / jax_s:>9.2f}x{torch_s / paged_s:>11.2f}x"
        )
    print("  target: jax (and paged) >= 2x transformers tokens/s at batch >= 16")
    return 0


def _jax_decode_step_s(
    params: Any, cfg: Any, prompts: np.ndarray, steps: int, reps: int, block_size: int
) -> tuple[float, float]:
    """Seconds per decode step after a prefill of `prompts` [B, ctx]: contiguous `decode`, paged `extend_paged`."""
    from models import opt

    bsz, ctx = prompts.shape
    cap = ctx + steps + 1
    _, kv = opt.prefill(params, cfg, prompts, np.full(bsz, ctx, np.int32))
    pad = ((0, 0), (0, 0), (0, cap - ctx), (0, 0), (0, 0))
    state: dict[str, Any] = {"cache": opt.KVCache(k=jnp.pad(kv.k, pad), v=jnp.pad(kv.v, pad))}
    tok = jnp.asarray(prompts[:, -1])
    positions = [jnp.full((bsz,), ctx + i, jnp.int32) for i in range(steps)]

    def run_contiguous() -> None:
        cache = state["cache"]
        for pos in positions:
            logits, cache = opt.decode(params, cfg, tok, pos, cache)
        jax.block_until_ready(logits)
        state["cache"] = cache

    contiguous_s = _time(run_contiguous, reps) / steps
    per_seq = (cap + block_size - 1) // block_size
    tables = jnp.arange(bsz * per_seq, dtype=jnp.int32).reshape(bsz, per_seq)
    pool = opt.init_paged_cache(cfg, bsz * per_seq, block_size)
    state["cache"] = opt.insert_into_pages(pool, kv, tables, jnp.full((bsz,), ctx, jnp.int32))
    del kv, pool
    ones = jnp.ones((bsz,), jnp.int32)

    def run_paged() -> None:
        cache = state["cache"]
        for pos in positions:
            logits, cache = opt.extend_paged(params, cfg, tok[:, None], pos, ones, cache, tables)
        jax.block_until_ready(logits)
        state["cache"] = cache

    paged_s = _time(run_paged, reps) / steps
    return contiguous_s, paged_s


def _torch_decode_step_s(hf: Any, prompts: np.ndarray, steps: int, reps: int) -> float:
    """Seconds per transformers decode step (DynamicCache) after a prefill of `prompts`."""
    import torch

    with torch.inference_mode():
        base = hf(input_ids=torch.from_numpy(prompts).long(), use_cache=True, logits_to_keep=1).cache
        tok = torch.from_numpy(prompts[:, -1:]).long()

        def run() -> None:
            cache = _copy_cache(base)  # every repetition starts from the same context
            for _ in range(steps):
                cache = hf(input_ids=tok, cache=cache, use_cache=True).cache

        copy_s = _time(lambda: _copy_cache(base), reps)  # taken back out of the step time
        return max(_time(run, reps) - copy_s, 1e-9) / steps


def _copy_cache(cache: Any) -> Any:
    import copy

    return copy.deepcopy(cache)


if __name__ == "__main__":
    raise SystemExit(main())
