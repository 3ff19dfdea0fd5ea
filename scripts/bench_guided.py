"""Measure the grammar libraries for guided decoding on this machine: xgrammar vs llguidance.

For each library, on a real tokenizer (SmolLM2-135M-Instruct's, from the model cache's GGUF, 49,152 ids):
the time to compile a JSON schema (cold), and the host time per output token of the mask (fill the next
token's bitmask, then accept the chosen token) for a batch of `--batch` constrained rows, driving each matcher
through a schema-valid output by always taking the lowest allowed token id. Both libraries write the same
packed int32 bitmask [B, ceil(V / 32)], which is what reaches JAX (one `device_put` per step, unpacked on
the device: `jaxserve.runtime.guided.apply_bitmask`), so the device side is the same for both; its cost is
measured once, beside a decode step of the same batch (`--decode-step`: the real engine on the model, mask included).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_guided.py [--model smollm2-135m-instruct] [--batch 16] [--decode-step]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def first_allowed(mask_row: np.ndarray) -> int:
    """The lowest token id a packed int32 bitmask row allows."""
    words = np.flatnonzero(mask_row)
    w = int(words[0])
    word = int(mask_row[w]) & 0xFFFFFFFF
    return w * 32 + ((word & -word).bit_length() - 1)


def bench_xgrammar(hf_tok, vocab: int, batch: int, steps: int) -> dict[str, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, vocab).numpy()
    per_step = []
    for _ in range(steps):
        t0 = time.perf_counter()
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        for i in live:
            matchers[i].fill_next_token_bitmask(mask, i)
        for i in live:
            matchers[i].accept_token(first_allowed(mask[i]))
        per_step.append(time.perf_counter() - t0)
    return {"compile_s": compile_s, "step_ms": 1e3 * statistics.median(per_step), "steps": len(per_step)}


def bench_llguidance(hf_tok, vocab: int, batch: int, steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
    compile_s = time.perf_counter() - t0  # llguidance compiles lazily: the first masks pay the rest
    mask = lln.allocate_token_bitmask(batch, vocab)
    per_step = []
    for _ in range(steps):
        t0 = time.perf_counter()
        live = [i for i, m in enumerate(matchers) if not m.is_stopped()]
        if not live:
            break
        for i in live:
            lln.fill_next_token_bitmask(matchers[i], mask, i)
        for i in live:
            matchers[i].consume_token(first_allowed(mask[i]))
        per_step.append(time.perf_counter() - t0)
    return {"compile_s": compile_s, "step_ms": 1e3 * statistics.median(per_step), "steps": len(per_step)}


def bench_device(vocab: int, batch: int, repeats: int = 50) -> float:
    """Milliseconds to put a packed bitmask [B, V/32] on the device and mask logits [B, V] with it."""
    import jax

    from jaxserve.runtime.guided import apply_bitmask

    logits = jax.numpy.zeros((batch, vocab), jax.numpy.float32)
    mask = np.full((batch, (vocab + 31) // 32), -1, np.int32)
    apply_bitmask(logits, jax.device_put(mask)).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        apply_bitmask(logits, jax.device_put(mask)).block_until_ready()
    return 1e3 * (time.perf_counter() - t0) / repeats


def bench_decode_step(source: str, tokenizer, batch: int, repeats: int, steps: int = 8) -> dict[str, float]:
    """Median ms per token of `ModelEngine.decode_step` at `batch` one-token rows (context 1: the cheapest step,
    so the mask's share is the largest it gets), unconstrained vs every row constrained by a JSON schema (the host
    mask and its device application included), interleaved; and of `decode_steps(..., steps)` (multi-step
    decoding: one on-device loop unconstrained; guided rows fall back to single steps)."""
    import jax

    from jaxserve.core.request import GuidedSpec, SamplingParams
    from jaxserve.runtime.engines.contract import StepBatch, StepRow
    from jaxserve.runtime.engines.model import ModelEngine
    from jaxserve.runtime.guided import GuidedDecoder

    engine = ModelEngine.load(source, jax.devices()[:1])
    cfg = engine.model_config
    engine.guided = GuidedDecoder(tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    pages = engine.init_pages(batch * 2, 16)
    batches = {}
    # a string of at least 64 characters: the grammar cannot end within the measured steps
    long_text = '{"type":"object","properties":{"text":{"type":"string","minLength":64}},"required":["text"]}'
    for name, guided in (("plain", None), ("guided", GuidedSpec("json_schema", long_text))):
        sampling = SamplingParams(max_tokens=64, ignore_eos=True, guided=guided)
        batches[name] = StepBatch(
            tuple(
                StepRow(f"r{i}", (100 + i,), 0, (2 * i, 2 * i + 1), sampling, seed=i, sample_index=0)
                for i in range(batch)
            )
        )
    samples: dict[str, list[float]] = {}
    for rnd in range(3 + repeats):  # the first 3 rounds compile
        for name, b in batches.items():
            t0 = time.perf_counter()
            _, pages = engine.decode_step(b, pages)
            t1 = time.perf_counter()
            _, pages = engine.decode_steps(b, pages, steps)
            t2 = time.perf_counter()
            if rnd >= 3:
                samples.setdefault(f"{name} step", []).append(t1 - t0)
                samples.setdefault(f"{name} multi-step", []).append((t2 - t1) / steps)
    return {k: 1e3 * statistics.median(v) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--decode-step", action="store_true", help="also time a decode step of the model, guided or not")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    from transformers import PreTrainedTokenizerFast

    from jaxserve.model_registry import model_cache_dir
    from models.checkpoint import load_tokenizer

    path = model_cache_dir() / args.model
    tok = load_tokenizer(path)
    if tok is None:
        raise SystemExit(f"{args.model}: no tokenizer")
    vocab = tok.get_vocab_size()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok)
    print(f"load average {os.getloadavg()[0]:.2f}; vocabulary {vocab}; batch {args.batch}")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        r = fn(hf_tok, vocab, args.batch, args.steps)
        print(
            f"{name:11s} compile {r['compile_s'] * 1e3:8.1f} ms   mask+accept per step (batch {args.batch}) "
            f"{r['step_ms']:6.2f} ms   over {r['steps']} steps"
        )
    print(f"device: put + apply the bitmask [B, V/32] to logits [B, V]: {bench_device(vocab, args.batch):.2f} ms")
    if args.decode_step:
        t = bench_decode_step(str(path), tok, args.batch, args.repeats)
        for kind in ("step", "multi-step"):
            plain, guided = t[f"plain {kind}"], t[f"guided {kind}"]
            print(
                f"decode {kind} (batch {args.batch}, context 1), ms per token: plain {plain:.1f}, every row guided "
                f"{guided:.1f} (+{100 * (guided - plain) / plain:.1f} %)"
            )


if __name__ == "__main__":
    main()
