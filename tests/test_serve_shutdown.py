"""How a `jaxserve serve` process ends: a signal at any moment stops it (status 0), and no exit finalizes the
interpreter while a background warm-up compile is inside XLA.

* SIGTERM during the warm-up stops at once (an orchestrator stopping a pod that is still compiling), instead of
  compiling to the end, printing the ready line and only then stopping: the timed engine with a profile whose
  every step takes a minute, so a prompt exit can only come from the signal.
* SIGINT or SIGTERM while `serve` loads the model and builds its instances, before its event loop handles
  signals: it used to die of SIGTERM (status -15) and to take SIGINT as a KeyboardInterrupt, which a garbage
  collector callback could swallow (the server went on to serve).
* SIGINT right after the ready line, while the background warm-up compiles: a clean stop.
* A process whose background compile outlives the stop's bounded wait: the exit waits for that compile; it used
  to finalize around it and abort ("terminate called ... FATAL: exception not rethrown").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def _serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    """`jaxserve serve` (the embedded tiny model unless `args` say otherwise) on free ports, with caches of its own
    (a cold compilation cache: the background warm-up has programs to compile after the ready line); stderr
    goes to a file the test reads as it grows."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve", "serve", "--grpc-port", "0", "--http-port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    return proc, stderr_path


def _wait_for_log(proc: subprocess.Popen[str], stderr_path: Path, text: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in stderr_path.read_text():
        assert proc.poll() is None, f"the server exited before logging {text!r}: {stderr_path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s:.0f} s"
        time.sleep(0.02)


def _assert_exited_cleanly(proc: subprocess.Popen[str], stderr_path: Path) -> str:
    """The process ends by itself with status 0 (60 s: a stop takes seconds, a missed signal never ends)."""
    try:
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = stderr_path.read_text()
    assert status == 0, f"exit status {status}\n{log}"
    for crash in ("terminate called", "FATAL", "Traceback", "Exception ignored"):
        assert crash not in log, log
    return log


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_while_loading_stops_at_once_with_status_0(tmp_path: Path, sig: signal.Signals) -> None:
    # "compilation cache: ..." is logged once JAX is imported, before the weights are loaded and the instances
    # built: the stretch before `run_until_signal`'s event loop handles signals.
    proc, stderr_path = _serve(tmp_path)
    _wait_for_log(proc, stderr_path, "compilation cache:")
    proc.send_signal(sig)
    log = _assert_exited_cleanly(proc, stderr_path)
    assert "during start-up" in log and "stopping without serving" in log, log
    assert proc.stdout is not None and "ready" not in proc.stdout.read()


@pytest.mark.slow  # one `jaxserve serve` process to ready on a cold compilation cache, 12-30 s
def test_sigint_right_after_ready_stops_cleanly_while_the_background_warmup_compiles(tmp_path: Path) -> None:
    proc, stderr_path = _serve(tmp_path)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ready line, or "" if the server died
    assert line.startswith("ready grpc="), f"{line!r}\n{stderr_path.read_text()}"
    proc.send_signal(signal.SIGINT)
    log = _assert_exited_cleanly(proc, stderr_path)
    assert "compile in the background" in log, log  # there was background work when the signal came
    assert "stopping: draining in-flight requests" in log, log


# A process with one engine's background warm-up: its first job waits (polling a file the test creates) and then
# compiles a real XLA program; the main thread stops the warm-up with a bound too short for it, as a shutdown does
# (`Controller.shutdown`: 5 s, less than one compile on a loaded machine), and returns.
_EXIT_DURING_COMPILE = """
import logging, sys, time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.runtime.compilation.background import BackgroundWarmup, CompileJob

logging.basicConfig(level=logging.INFO)
out = Path(sys.argv[1])


class Engine(BackgroundWarmup):
    def __init__(self) -> None:
        self._init_background_warmup()


def held_compile() -> None:
    (out / "compiling").touch()
    while not (out / "release").exists():
        time.sleep(0.01)
    x = jnp.ones((64, 64))
    jax.jit(lambda a: jnp.tanh(a @ a) @ a).lower(x).compile()


def touch(name):
    return lambda: (out / name).touch()


engine = Engine()
engine._start_background([CompileJob("held", held_compile, touch("published")), CompileJob("next", touch("next"), touch("next"))])
while not (out / "compiling").exists():
    time.sleep(0.01)
engine.stop_background_warmup(timeout_s=0.1)
print("main returns", flush=True)
"""


def _exit_during_compile(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """The `_EXIT_DURING_COMPILE` process, once it says it waits at exit for its held compile."""
    script = tmp_path / "exit_during_compile.py"
    script.write_text(_EXIT_DURING_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # a real compile, not a hit
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
    # The compile is held until the process says it waits for it at exit; a process that does not wait ends
    # first (it used to: the stop's bounded wait forgot the thread, and the exit finalized around it).
    deadline = time.monotonic() + 120
    while "exit: waiting for the background compile in progress (held)" not in stderr_path.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"exited with its compile still running:\n{stderr_path.read_text()}")
        assert time.monotonic() < deadline, stderr_path.read_text()
        time.sleep(0.02)
    return proc, stderr_path


def test_exit_waits_for_the_background_compile_in_progress(tmp_path: Path) -> None:
    proc, stderr_path = _exit_during_compile(tmp_path)
    try:
        (tmp_path / "release").touch()
        assert proc.wait(timeout=120) == 0, stderr_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = stderr_path.read_text()
    assert (tmp_path / "published").exists(), log  # the compile in progress ran to its end
    assert not (tmp_path / "next").exists(), log  # and nothing after it: the warm-up was stopped
    assert "terminate called" not in log and "FATAL" not in log, log
    assert proc.stdout is not None and proc.stdout.read() == "main returns\n"


def test_sigint_while_the_exit_waits_for_a_compile_leaves_at_once(tmp_path: Path) -> None:
    """Ctrl-C during that wait: out at once with status 130, without finalizing around the thread (no abort)."""
    proc, stderr_path = _exit_during_compile(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)  # the compile stays held: only the signal can end the wait
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = stderr_path.read_text()
    assert status == 130, log
    assert "interrupted: exiting without waiting for the background compile" in log, log
    assert not (tmp_path / "published").exists(), log
    assert "terminate called" not in log and "FATAL" not in log, log
