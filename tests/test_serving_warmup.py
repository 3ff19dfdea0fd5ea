"""Cold buckets: the server warms the controller up before it reports ready, and `jaxserve serve`
turns on JAX's persistent compilation cache (`--compile-cache DIR`, `off`)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
from serving_helpers import fake_controller, running_server

from jaxserve.cli import build_parser
from jaxserve.commands.serve import compile_cache_dir
from jaxserve.runtime.compilation.cache import default_cache_dir


def test_server_calls_controller_warmup_before_ready_and_logs_time_to_ready(caplog):
    controller = fake_controller(first_device=6)
    calls: list[float] = []
    events: list[str] = []
    real_warmup, real_start_background = controller.warmup, controller.start_background_compiles

    def recording_warmup(*, start_background: bool = True) -> float:
        seconds = real_warmup(start_background=start_background)
        calls.append(seconds)
        events.append(f"warmup(start_background={start_background})")
        return seconds

    def recording_start_background() -> None:
        events.append("background compiles")
        real_start_background()

    controller.warmup = recording_warmup  # type: ignore[method-assign]
    controller.start_background_compiles = recording_start_background  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="jaxserve.serving.server"), running_server(controller, warmup=True) as s:
        assert len(calls) == 1 and calls[0] > 0  # before start() returned, i.e. before health SERVING
        assert httpx.get(f"{s.http_url}/health").status_code == 200
    assert any("ready in" in r.getMessage() and "warm-up" in r.getMessage() for r in caplog.records)
    # the compiles left to the background start once the server listens, not during its start
    assert events == ["warmup(start_background=False)", "background compiles"]


def test_no_warmup_skips_it():
    controller = fake_controller(first_device=6)
    called: list[bool] = []
    controller.warmup = lambda: called.append(True) or 0.0  # type: ignore[method-assign]
    with running_server(controller, warmup=False):
        pass
    assert called == []


def test_compile_cache_flag(tmp_path: Path, monkeypatch):
    parser = build_parser()
    args = parser.parse_args(["serve"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir(args.compile_cache) == default_cache_dir() == tmp_path / "xdg" / "jaxserve" / "xla"
    assert compile_cache_dir(parser.parse_args(["serve", "--compile-cache", "off"]).compile_cache) is None
    chosen = parser.parse_args(["serve", "--compile-cache", str(tmp_path / "c")]).compile_cache
    assert compile_cache_dir(chosen) == tmp_path / "c"


def test_enable_compile_cache_writes_compiled_programs(tmp_path: Path):
    # A fresh process: the cache is process-global JAX configuration.
    code = (
        "import sys; from pathlib import Path\n"
        "from jaxserve.runtime.compilation.cache import enable_private_compilation_cache\n"
        "enable_private_compilation_cache(Path(sys.argv[1]), min_compile_time_s=0.0)\n"
        "import jax, jax.numpy as jnp\n"
        "print(float(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(7)).sum()))\n"
    )
    cache = tmp_path / "cache"
    subprocess.run([sys.executable, "-c", code, str(cache)], check=True, timeout=120, capture_output=True)
    assert any(p.is_file() for p in cache.rglob("*")), "no compiled program was written to the cache"
