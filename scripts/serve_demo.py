"""The whole serving path in one command: start `jaxserve serve`, stream a few completions, stop it.

    python scripts/serve_demo.py                 # the embedded default model and deployment
    python scripts/serve_demo.py --max-tokens 48 -- --deployment disagg:prefill=tp2,decode=tp1

Starts the server in the background on free ports, waits for its `ready` line, sends
each prompt through `jaxserve.client.Client`, prints the tokens as they stream in and
each request's TTFT and TPOT (measured by the server), then stops the server with
SIGTERM and checks that it exited cleanly. Arguments after `--` go to `jaxserve serve`.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time

from jaxserve.client import Client

PROMPTS = ["def fibonacci(n):", "import os\n\nclass ", "for i in range("]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three code openings")
    parser.add_argument("serve_args", nargs="*", help="extra `jaxserve serve` arguments (after --)")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "jaxserve", "serve", "--grpc-port", "0", "--http-port", "0", *args.serve_args]
    print("$", " ".join(command[1:]), flush=True)
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        m = re.match(r"ready grpc=(\S+) http=(\S+)", line)
        if not m:
            print(f"server did not start (exit code {server.wait()})", file=sys.stderr)
            return 1
        print(line.strip(), flush=True)
        with Client(m.group(1), timeout_s=300) as client:
            info = client.model_info()
            print(f"model {info.name}: {info.num_layers} layers, hidden {info.hidden_size}, vocab {info.vocab_size}")
            for i, prompt in enumerate(args.prompt or PROMPTS):
                # Without a tokenizer (a preset with random weights) the prompts are token ids.
                text = prompt if info.has_tokenizer else None
                ids = None if info.has_tokenizer else [info.bos_token_id, 100 + 37 * i, 31]
                print(f"\n>>> {text!r}" if text else f"\n>>> prompt_ids={ids}")
                last = None
                for chunk in client.stream(text, prompt_ids=ids, max_tokens=args.max_tokens, temperature=0.0):
                    print(chunk.text if text else f"{list(chunk.token_ids)} ", end="", flush=True)
                    last = chunk
                t = last.timings if last is not None else None
                if last is not None and t is not None and t.ttft_s is not None:
                    tpot = f"{t.tpot_s * 1e3:.2f} ms" if t.tpot_s is not None else "n/a"
                    print(
                        f"\n[{last.num_output_tokens} tokens, {last.finish_reason}] "
                        f"TTFT {t.ttft_s * 1e3:.1f} ms  TPOT {tpot}  KV moved {t.kv_transfer_bytes} B"
                    )
    finally:
        server.send_signal(signal.SIGTERM)
        start = time.monotonic()
        code = server.wait(timeout=60)
        print(f"\nserver stopped (exit code {code}) in {time.monotonic() - start:.1f} s")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
