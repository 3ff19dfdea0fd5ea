"""`jaxserve serve --backend ray` as a subprocess: a local loopback Ray cluster, actors, ready line, SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest

from jaxserve.runtime.engines.fake import reference_tokens
from models.config import get_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_serve_backend_ray_serves_and_stops(tmp_path) -> None:
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", XDG_CACHE_HOME=str(tmp_path / "xdg"))  # not ~/.cache
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--backend", "ray", "--engine", "fake", "--model", "opt-tiny"]
    cmd += ["--deployment", "disagg:prefill=tp2,decode=tp1", "--grpc-port", "0", "--http-port", "0", "--no-warmup"]
    with open(tmp_path / "stderr.txt", "w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            m = re.fullmatch(r"ready grpc=127\.0\.0\.1:\d+ http=(127\.0\.0\.1:\d+)\n", line)
            assert m, f"unexpected first line {line!r}"
            url = f"http://{m.group(1)}"
            prompt = [2, 100, 31, 7]
            body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == reference_tokens(prompt, 6, get_config("opt-tiny").vocab_size)
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            assert "jaxserve:kv_pull_failures_total 0.0" in metrics
            assert "jaxserve:requests_rerouted_total 0.0" in metrics
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            err.seek(0)
            log = err.read()
            assert re.search(
                r"instance prefill-0: role=prefill tp=2 x pp=1 actor pid=\d+ node=\w+ \(127\.0\.0\.1\)", log
            )
            assert re.search(r"instance decode-0: role=decode tp=1 x pp=1 actor pid=\d+", log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(ray_tmp, ignore_errors=True)
