"""Start-up as a new user meets it: `jaxserve serve` to its ready line, then a cold burst of mixed requests.

    PYTHONPATH=. .venv/bin/python scripts/bench_startup.py                 # the embedded tiny model
    PYTHONPATH=. .venv/bin/python scripts/bench_startup.py --model smollm2-135m-instruct
    PYTHONPATH=. .venv/bin/python scripts/bench_startup.py --model smollm2-135m-instruct --backend ray

Each run starts `jaxserve serve` (its defaults: background warm-up on, both cores) in a child process with
a fresh `XDG_CACHE_HOME` shared by that run's two starts: the first start compiles into an empty
compilation cache ("fresh"), the second finds it filled ("warm"). After each ready line the script sends a
burst of `--burst` requests at once over HTTP (prompt lengths spread from 4 tokens to the model's longest
prompt bucket, outputs 2-48 tokens, a quarter with `n`=2), then the same burst again. A request that had to
wait for a compile on the request path would show as a first-burst TTFT seconds above the second burst's;
the script prints both bursts' TTFT P50 and max, the load average before each start, and the phases the
server logged (its own `ready in` seconds and each engine's warm-up line: seconds per part, programs left to
the background). The server's stderr goes to `--log-dir` (default: a temp folder) for the background compile
log. `--log-compiles` (JAX_LOG_COMPILES=1 in the server: its own cost is small but not nil) adds the programs
compiled before the last engine's foreground warm-up line, by name.

Before the bursts, right after the ready line, one chat-like pair: a prompt, then the same prompt again (a second
turn's shared prefix); `second_turn_cached` is the tokens the server reports cached for the second (usage's
`cached_tokens`): caching works from the first minute when it is the prompt's full blocks, not 0 while the
background still compiles. `--backend ray` starts the same deployment on Ray actors (serve's `--backend ray`):
its ready time is Ray's own start-up plus the actors' warm-ups, which read the same compilation cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from jaxserve.commands.common import DEFAULT_DEPLOYMENT
from jaxserve.model_registry import model_cache_dir
from jaxserve.tools.bench.launch import ServeProcess
from jaxserve.tools.bench.loadgen import Target, run_workload
from placement.workload import Workload


def burst(num: int, longest_prompt: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    inputs = np.unique(np.geomspace(4, longest_prompt, num).astype(np.int64))
    inputs = np.resize(inputs, num)
    rng.shuffle(inputs)
    outputs = rng.integers(2, 49, size=num).astype(np.int64)
    return Workload(np.zeros(num), inputs, outputs, 1.0)


def ttft_stats(run: object) -> dict[str, float | int]:
    records = run.records  # type: ignore[attr-defined]
    ok = [r.ttft_s for r in records if r.ok]
    return {
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "ttft_p50_s": float(np.median(ok)) if ok else float("nan"),
        "ttft_max_s": float(max(ok)) if ok else float("nan"),
    }


PHASE_MARKS = (
    "built the CPU paged-attention kernel", "warm-up compiled", "warmed its buckets", "ready in", "background warm-up"
)  # fmt: skip


def logged_phases(log_path: Path) -> list[str]:
    """The server log's start-up lines (time of day, then the message), for the per-phase story."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    out = []
    for line in lines:
        if any(mark in line for mark in PHASE_MARKS):
            day_time, _, rest = line.partition(" INFO ")
            out.append(f"{day_time.split(' ')[-1]} {rest.split(': ', 1)[-1][:160]}")
    return out


def foreground_compiles(log_path: Path) -> dict[str, int]:
    """Programs XLA compiled before the last foreground warm-up line of the server log (JAX_LOG_COMPILES), by name."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    ends = [i for i, line in enumerate(lines) if "engines.model: warm-up compiled" in line]
    counts: dict[str, int] = {}
    for line in lines[: ends[-1] if ends else 0]:
        if "Finished XLA compilation of " in line and not line.startswith("WARNING:"):  # absl's copy of the line
            name = line.split("Finished XLA compilation of ", 1)[1].split(" in ")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def second_turn_cached(http_address: str, prompt_tokens: int, vocab_size: int) -> list[int]:
    """The cached tokens the server reports for a prompt sent twice, one request after the other (0 and the
    prompt's full blocks when caching works)."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, vocab_size, size=prompt_tokens)]
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "ignore_eos": True}).encode()
    out = []
    for _ in range(2):
        request = urllib.request.Request(
            f"http://{http_address}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            usage = json.load(response)["usage"]
        out.append(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
    return out


def one_start(args: argparse.Namespace, cache_home: str, label: str, log_dir: Path) -> dict[str, object]:
    load = os.getloadavg()[0]
    server = ServeProcess(
        args.deployment,
        args.model,
        extra_args=["--log-level", "info", *(["--backend", "ray"] if args.backend == "ray" else [])],
        single_core=False,
        startup_timeout_s=args.startup_timeout,
        log_path=log_dir / f"serve-{label}.log",
        # the kernel build and the XLA cache start empty; a pulled model stays where it is
        env={
            "XDG_CACHE_HOME": cache_home,
            "JAXSERVE_MODEL_CACHE": str(model_cache_dir()),
            **({"JAX_LOG_COMPILES": "1"} if args.log_compiles else {}),
        },
    )
    started = time.perf_counter()
    with server:
        ready_s = time.perf_counter() - started
        turns = second_turn_cached(server.http_address, args.turn_tokens, args.vocab_size)
        target = Target(server.http_address, http=True, timeout_s=600.0)
        work = burst(args.burst, args.longest_prompt, seed=1)
        cold = asyncio.run(run_workload(work, target, vocab_size=args.vocab_size, seed=2))
        again = asyncio.run(run_workload(work, target, vocab_size=args.vocab_size, seed=2))
    compiles = foreground_compiles(log_dir / f"serve-{label}.log") if args.log_compiles else {}
    return {
        "start": label,
        **({"compiles_before_ready": sum(compiles.values()), "compiled": compiles} if args.log_compiles else {}),
        "load_1min": round(load, 2),
        "ready_s": round(ready_s, 2),
        "second_turn_cached": turns[1],
        "cold_burst": ttft_stats(cold),
        "second_burst": ttft_stats(again),
        "server_log": logged_phases(log_dir / f"serve-{label}.log"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="serve's --model (default: serve's default, the embedded tiny model)")
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT)
    ap.add_argument("--burst", type=int, default=24)
    ap.add_argument("--longest-prompt", type=int, default=400, help="the burst's longest prompt (tokens)")
    ap.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids are drawn below this")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--backend", choices=("embedded", "ray"), default="embedded", help="serve's --backend")
    ap.add_argument("--turn-tokens", type=int, default=100, help="the prompt sent twice right after ready")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument(
        "--cache-home", type=Path, default=None, help="an XDG_CACHE_HOME an earlier run filled: both starts are warm"
    )
    ap.add_argument("--log-compiles", action="store_true", help="count the programs compiled before ready")
    args = ap.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="jaxserve-startup-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cache_home = str(args.cache_home) if args.cache_home else tempfile.mkdtemp(prefix="jaxserve-xdg-")
    print(f"load average before: {os.getloadavg()}; XDG_CACHE_HOME={cache_home}", flush=True)
    for label in ("warm", "warm-again") if args.cache_home else ("fresh", "warm"):
        print(json.dumps(one_start(args, cache_home, label, log_dir)), flush=True)
    print(f"load average after: {os.getloadavg()}; server logs in {log_dir}", flush=True)


if __name__ == "__main__":
    main()
