"""One side of `bench_model.py --tree-ab`: a tree's serving model, timed on request over stdin / stdout.

Run with `PYTHONPATH=<tree root>`: it imports `models` from that tree only (no path of its own), and uses only the
`ShardedModel` calls both the tree before the NNX models and after them have (`sharded_class(cfg).load`,
`prefill`, `init_paged_caches`, `extend_paged`), so the same worker times either tree. Commands, one per line:
`prefill T` (one prompt of T tokens), `decode B C N` (N paged decode steps of B rows at context C); the answer
is one JSON line with the seconds the command's timed part took. After a command, `hlo` answers with a digest
of the optimized programs it ran (names and metadata left out), so two trees can be shown to compile the same
program, which a timing on a loaded machine cannot show.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from typing import Any

import jax
import numpy as np


def main() -> int:
    model_name, dtype = sys.argv[1], sys.argv[2]
    from models.checkpoint import source_config
    from models.sharding import sharded_class

    cfg = source_config(model_name, dtype)
    model = sharded_class(cfg).load(model_name, tp=1, pp=1, devices=jax.devices()[:1], dtype=dtype, seed=0)
    rng = np.random.default_rng(0)
    pools: dict[tuple[int, int], Any] = {}
    last: tuple[Any, ...] = ()  # the last command's jitted step and arguments (for `hlo`)
    print(json.dumps({"ready": str(sys.modules["models"].__file__)}), flush=True)
    for line in sys.stdin:
        cmd, *nums = line.split()
        n = [int(x) for x in nums]
        if cmd == "prefill":
            tokens = rng.integers(3, cfg.vocab_size, (1, n[0])).astype(np.int32)
            lengths = np.array([n[0]], np.int32)
            t0 = time.perf_counter()
            jax.block_until_ready(model.prefill(tokens, lengths)[0])
            seconds = time.perf_counter() - t0
            last = (model._fn("prefill", 0, all_logits=False), tokens, lengths)
        elif cmd == "decode":
            b, ctx, steps = n
            bs = 16
            per_seq = (ctx + steps + bs) // bs
            width = 1 << (per_seq - 1).bit_length()  # the engine's power-of-two table width
            tables = np.zeros((b, width), np.int32)
            tables[:, :per_seq] = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
            if (b, ctx) not in pools:  # fill the context once (a chunked prefill into the pool)
                caches = model.init_paged_caches(b * per_seq, bs)
                prompt = rng.integers(3, cfg.vocab_size, (b, ctx)).astype(np.int32)
                zeros, full = np.zeros(b, np.int32), np.full(b, ctx, np.int32)
                _, caches = model.extend_paged(prompt, zeros, full, caches, tables)
                pools[b, ctx] = caches
            caches = pools[b, ctx]
            tok = rng.integers(3, cfg.vocab_size, (b, 1)).astype(np.int32)
            ones = np.ones(b, np.int32)
            t0 = time.perf_counter()
            for i in range(steps):  # positions ctx.. (each rep writes the same slots again)
                logits, caches = model.extend_paged(tok, np.full(b, ctx + i, np.int32), ones, caches, tables)
            jax.block_until_ready(logits)
            seconds = time.perf_counter() - t0
            pools[b, ctx] = caches
            step = model._fn("paged", 0, all_logits=False, block_layout=caches[0].block_layout)
            last = (step, tok, np.full(b, ctx, np.int32), ones, caches[0], tables)
        elif cmd == "hlo":
            fn, *args = last
            print(json.dumps({"hlo": _digest(fn.lower(model.run_params[0], *args).compile().as_text())}), flush=True)
            continue
        else:
            raise SystemExit(f"unknown command {line!r}")
        print(json.dumps({"seconds": seconds}), flush=True)
    return 0


def _digest(compiled_text: str) -> str:
    """A digest of an optimized HLO text's instructions, with names, ids, metadata and sharding annotations
    normalized away (the debug tables of source lines and a one-device mesh's axis names are not the program):
    two trees that build the same program give the same digest."""
    lines = []
    for line in compiled_text.splitlines():
        line = line.strip()
        if not line.startswith(("%", "ROOT")):
            continue
        line = re.sub(r",? *(metadata|sharding|frontend_attributes)=.*", "", line)
        line = re.sub(r"%[\w.\-]+", "%x", line)
        lines.append(re.sub(r"\b[\w.\-]+(\.\d+)+\b", "N", line))
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()[:16]


if __name__ == "__main__":
    sys.exit(main())
