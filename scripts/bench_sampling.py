"""The sampler's cost per step against the sorting sampler it replaced, and against torch's, on a real vocabulary.

`jaxserve.runtime.sampling` cuts top-k and top-p by bisection over the values' bits and draws by Gumbel-max with
noise from a counter hash; before it, each row sorted its whole vocabulary (`argsort`) and drew with threefry
(`jax.random.categorical`). That sampler is kept here, as the baseline, with what transformers' logits warpers
do in torch (sort, cut, softmax, `multinomial`). Greedy rows: XLA's `argmax` against `argmax_rows`.

Per case the contenders run interleaved (A B C A B C ...) `--reps` times after a warm-up call, each sample one
batch; min and median milliseconds are printed with the ratio, and the load average before and after. First, the
trace, lowering and compile seconds of both JAX samplers (what a server pays per row count at start).

    PYTHONPATH=. .venv/bin/python scripts/bench_sampling.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from bench_model import pin_threads  # this script's folder is on sys.path when it runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default: SmolLM2's 49152)")
    ap.add_argument("--batches", default="1,8,32", help="rows per step, comma-separated")
    ap.add_argument("--reps", type=int, default=7, help="interleaved samples per contender (default 7)")
    ap.add_argument(
        "--threads", type=int, default=None, help="pin the process to N cores, torch to N threads (default: all cores)"
    )
    args = ap.parse_args()
    if args.threads:
        pin_threads(args.threads)  # the process's cores: XLA's CPU pool is sized from them
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runtime import sampling

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and args.threads:
        torch.set_num_threads(args.threads)

    def sorting_row(logits, temperature, top_k, top_p, seed_hi, seed_lo, index):  # type: ignore[no-untyped-def]
        """The sampler before the change (one row; vmapped): sort the vocabulary, cut, threefry draw."""
        vocab = logits.shape[-1]
        scaled = logits / jnp.maximum(temperature, 1e-6)
        order = jnp.argsort(-scaled)
        sorted_logits = scaled[order]
        rank = jnp.arange(vocab)
        keep = jnp.where(top_k > 0, rank < top_k, True)
        probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
        keep = keep & ((jnp.cumsum(probs) - probs < top_p) | (rank == 0))
        key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed_hi), seed_lo), index)
        choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
        return jnp.where(temperature == 0.0, jnp.argmax(logits), order[choice]).astype(jnp.int32)

    sorting = jax.jit(jax.vmap(sorting_row))

    def torch_sample(logits: Any, top_k: int, top_p: float, temperature: float) -> Any:
        """transformers' warpers in order (temperature, top-k, top-p), then one multinomial draw per row."""
        with torch.inference_mode():
            scores = logits / temperature
            if top_k:
                kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
                scores = scores.masked_fill(scores < kth, -float("inf"))
            if top_p < 1.0:
                sorted_logits, sorted_idx = torch.sort(scores, descending=False)
                cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
                remove = cum <= 1 - top_p
                remove[..., -1:] = False
                scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
            return torch.multinomial(scores.softmax(dim=-1), 1)

    greedy_xla = jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))

    def contenders(
        logits: Any, t_logits: Any, inputs: tuple[Any, ...], top_k: int, top_p: float, temperature: float
    ) -> dict[str, Callable[[], Any]]:
        """One step's sampling by each contender (greedy: XLA's argmax, `argmax_rows`, torch's argmax)."""
        if temperature == 0.0:
            runs = {
                "before": lambda: greedy_xla(logits).block_until_ready(),
                "jaxserve": lambda: sampling._greedy(logits).block_until_ready(),
            }
            if torch:
                runs["torch"] = lambda: torch.argmax(t_logits, dim=-1)
            return runs
        runs = {
            "before": lambda: sorting(logits, *inputs).block_until_ready(),
            "jaxserve": lambda: sampling._sample_batch(logits, *inputs).block_until_ready(),
        }
        if torch:
            runs["torch"] = lambda: torch_sample(t_logits, top_k, top_p, temperature)
        return runs

    def cell(times: dict[str, list[float]], k: str) -> str:
        return f"{min(times[k]):7.2f} / {np.median(times[k]):6.2f}" if k in times else f"{'-':>16s}"

    rng = np.random.default_rng(0)
    print(
        f"vocab {args.vocab}; jax {jax.__version__} on {jax.devices()[0].platform}; torch "
        f"{torch.__version__ if torch else 'not installed'}; threads {args.threads or 'all'}"
    )
    b = 8  # before any run of that shape: nothing of it is cached yet
    args8 = (
        jnp.zeros((b, args.vocab), jnp.float32),
        np.ones(b, np.float32),
        np.full(b, 50, np.int32),
        np.full(b, 0.9, np.float32),
        np.zeros(b, np.uint32),
        np.zeros(b, np.uint32),
        np.zeros(b, np.uint32),
    )
    for name, fn in (("before", sorting), ("jaxserve", sampling._sample_batch)):
        t0 = time.perf_counter()
        traced = fn.trace(*args8)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        print(
            f"start-up cost of the {name} sampler (batch {b}): trace {t1 - t0:.3f} s, lower {t2 - t1:.3f} s, "
            f"compile {t3 - t2:.3f} s"
        )
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(
        f"{'case':34s} {'before (ms)':>16s} {'jaxserve (ms)':>16s} {'torch (ms)':>16s}  before/jaxserve  torch/jaxserve"
    )
    cases = [
        ("greedy", 0, 1.0, 0.0),
        ("temperature 0.8", 0, 1.0, 0.8),
        ("top_k 50", 50, 1.0, 0.8),
        ("top_p 0.9", 0, 0.9, 0.8),
        ("top_k 50 + top_p 0.9", 50, 0.9, 0.8),
    ]
    for b in [int(x) for x in args.batches.split(",")]:
        host = rng.normal(scale=3.0, size=(b, args.vocab)).astype(np.float32)
        logits = jnp.asarray(host)
        t_logits = torch.from_numpy(host) if torch else None
        for name, top_k, top_p, temperature in cases:
            inputs = (
                np.full(b, temperature, np.float32),
                np.full(b, top_k, np.int32),
                np.full(b, top_p, np.float32),
                np.arange(b, dtype=np.uint32),
                np.zeros(b, np.uint32),
                np.zeros(b, np.uint32),
            )
            runs = contenders(logits, t_logits, inputs, top_k, top_p, temperature)
            times: dict[str, list[float]] = {k: [] for k in runs}
            for run in runs.values():
                run()  # compile / warm
            for _ in range(args.reps):
                for k, run in runs.items():
                    t0 = time.perf_counter()
                    run()
                    times[k].append((time.perf_counter() - t0) * 1e3)

            ratio = min(times["before"]) / min(times["jaxserve"])
            vs_torch = f"{min(times['torch']) / min(times['jaxserve']):14.2f}x" if "torch" in times else ""
            print(
                f"{f'batch {b}, {name}':34s} {cell(times, 'before')} {cell(times, 'jaxserve')} {cell(times, 'torch')}  "
                f"{ratio:15.2f}x {vs_torch}"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
