"""`jaxserve serve` obeys SIGTERM during its warm-up at once (an orchestrator stopping a pod that is still
compiling), instead of compiling to the end, printing the ready line and only then stopping.

The real server, as a subprocess, on the timed engine with a profile whose every step takes 4 s: the warm-up
request alone takes 8 s, so a prompt exit can only come from the signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# One warm-up step takes this long: a server that waited for its warm-up would stop a minute late, far apart from
# a prompt stop on any machine (it was 4 s, which a loaded 2-core machine's process exit alone can approach).
SLOW_STEP_S = 60.0


def test_sigterm_during_warmup_stops_at_once_without_serving(tmp_path: Path) -> None:
    profile = tmp_path / "slow.json"
    profile.write_text(
        json.dumps(
            {
                "name": "slow",
                "entries": [
                    {
                        "model": "opt-13b",
                        "tp": 1,
                        "prefill": [1.0, 0.0, 0.0],
                        "decode_small": [1.0, 0.0, 0.0],
                        "step_overhead": [SLOW_STEP_S, 0.0, 0.0],
                    }
                ],
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        serve = ["serve", "--engine", "timed", "--profile", str(profile), "--model", "opt-13b"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve", *serve, "--grpc-port", "0", "--http-port", "0"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        try:
            deadline = time.monotonic() + 120
            while "warming up" not in stderr_path.read_text():
                assert proc.poll() is None, f"the server exited before its warm-up: {stderr_path.read_text()}"
                assert time.monotonic() < deadline, "no warm-up log line within 120 s"
                time.sleep(0.05)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            took = time.monotonic() - signalled
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = stderr_path.read_text()
    assert took < SLOW_STEP_S, f"stopped {took:.1f} s after the signal: it waited for the warm-up\n{log}"
    assert "signal during start-up (warm-up): stopping without serving" in log, log
    assert proc.stdout is not None and "ready" not in proc.stdout.read()  # never announced itself ready
