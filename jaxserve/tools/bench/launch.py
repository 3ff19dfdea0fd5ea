"""Starting `jaxserve serve` as a child process for measurements, and warming it up.

`ServeProcess` runs `python -m jaxserve serve …` with the XLA flags a CPU measurement needs (a
given number of host devices, Eigen single-threaded) and optionally pinned to some cores (`cpus`:
an XLA CPU process runs all its devices' kernels on one intra-op pool sized to the cores it may
use, at least one thread per device, so pinning, not the flags, is what gives a server its own
cores), waits for its
`ready grpc=… http=…` line and stops it (SIGTERM, then SIGKILL) on exit. `warm_up` sends bursts of
1, 2, 4, … concurrent requests so every batch bucket the measurement will hit is compiled before
the clock starts: a first-seen shape costs an XLA compilation, which is not serving latency.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxserve.tools.bench.loadgen import Target, run_workload
from placement.workload import Workload

SINGLE_CORE_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
_READY = re.compile(r"ready grpc=(\S+) http=(\S+)")


def cpu_xla_flags(num_devices: int, single_core: bool = True) -> str:
    """XLA_FLAGS for `num_devices` host devices, each one core when `single_core`."""
    flags = f"--xla_force_host_platform_device_count={num_devices}"
    return f"{flags} {SINGLE_CORE_FLAGS}" if single_core else flags


class ServeProcess:
    """`jaxserve serve` in a child process; use as a context manager."""

    def __init__(
        self,
        deployment: str,
        model: str | None,
        extra_args: Sequence[str] = (),
        num_devices: int | None = None,
        single_core: bool = True,
        startup_timeout_s: float = 300.0,
        log_path: str | Path | None = None,
        cpus: Sequence[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.deployment = deployment
        self.model = model
        self.extra_args = list(extra_args)
        self.num_devices = num_devices
        self.single_core = single_core
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.cpus = tuple(cpus) if cpus else None  # `serve --cpus`: the cores the server may use
        self.env = dict(env or {})  # added to (and overriding) this process's environment
        self.proc: subprocess.Popen[str] | None = None
        self.grpc_address = ""
        self.http_address = ""

    def start(self) -> ServeProcess:
        from jaxserve.core.plan import parse_deployment

        devices = self.num_devices or parse_deployment(self.deployment).num_devices
        env = {**os.environ, **self.env}
        env["XLA_FLAGS"] = cpu_xla_flags(devices, self.single_core)
        env.setdefault("JAX_PLATFORMS", "cpu")
        cmd = [
            sys.executable, "-m", "jaxserve", "serve", "--deployment", self.deployment,
            "--grpc-port", "0", "--http-port", "0", *self.extra_args,
        ]  # fmt: skip
        if self.model:  # None: serve's default model (the embedded tiny one)
            cmd += ["--model", self.model]
        if self.cpus:
            cmd += ["--cpus", ",".join(map(str, self.cpus))]
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        found: list[str] = []

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                m = _READY.search(line)
                if m:
                    found.extend(m.groups())
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(self.startup_timeout_s)
        if not found:
            self.stop()
            raise RuntimeError(f"`jaxserve serve --deployment {self.deployment}` did not become ready")
        self.grpc_address, self.http_address = found
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def warm_up(
    address: str,
    input_len: int,
    output_len: int,
    max_batch: int,
    vocab_size: int,
    rounds: int = 2,
) -> None:
    """Bursts of 1, 2, 4, … `max_batch` simultaneous requests (twice), so every bucket is compiled."""
    sizes = []
    k = 1
    while k < max_batch:
        sizes.append(k)
        k *= 2
    sizes.append(max_batch)
    target = Target(address)
    for _ in range(rounds):
        for k in sizes:
            burst = Workload(
                np.full(k, 0.0), np.full(k, input_len, dtype=np.int64), np.full(k, output_len, dtype=np.int64), 1.0
            )
            run = asyncio.run(run_workload(burst, target, vocab_size=vocab_size, seed=k))
            errors = [r.error for r in run.records if r.error]
            if errors:
                raise RuntimeError(f"warm-up request failed: {errors[0]}")
    time.sleep(0.5)
