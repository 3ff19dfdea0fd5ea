"""A cache directory code is loaded from must be this user's alone (issue 27).

Real directories under tmp_path with real modes and owners (the tests run as root in CI's container, so a
directory can be given to another uid; elsewhere that case is skipped). `ensure_private_dir` is what the
CPU kernel's cache (`models/kernels/cpu.py`) and `serve --compile-cache` (XLA's cache) call.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from models.kernels.trust import UntrustedDirectoryError, ensure_private_dir


def test_a_missing_directory_is_created_for_this_user_alone(tmp_path: Path) -> None:
    path = ensure_private_dir(tmp_path / "a" / "cache", "the test cache")
    assert path.is_dir() and stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.parametrize(("mode", "who"), [(0o777, "its group and others"), (0o775, "its group"), (0o757, "others")])
def test_a_directory_others_may_write_is_refused_with_the_fix(tmp_path: Path, mode: int, who: str) -> None:
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(UntrustedDirectoryError) as info:
        ensure_private_dir(path, "the test cache")
    message = str(info.value)
    assert f"writable by {who}" in message and f"chmod go-w {path}" in message
    path.chmod(0o755)  # the fix the message names
    assert ensure_private_dir(path, "the test cache") == path


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="giving a directory away needs root")
def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "theirs"
    path.mkdir(mode=0o755)
    os.chown(path, 65534, 65534)
    with pytest.raises(UntrustedDirectoryError, match=f"owned by uid 65534.*chown {os.getuid()} {path}"):
        ensure_private_dir(path, "the test cache")
    link = tmp_path / "link"
    link.symlink_to(path)  # a link of ours to a directory of theirs: what is loaded from is theirs
    with pytest.raises(UntrustedDirectoryError, match="owned by uid 65534"):
        ensure_private_dir(link, "the test cache")


def test_the_cpu_kernel_refuses_a_world_writable_cache(tmp_path: Path) -> None:
    shared = tmp_path / "kernels"
    shared.mkdir()
    shared.chmod(0o777)
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from models.kernels import cpu\n"
        "print('target', cpu.paged_attention_target())\n"
    )
    env = {**os.environ, "JAXSERVE_KERNEL_CACHE": str(shared), "JAXSERVE_CPU_KERNEL": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "target None" in proc.stdout  # the XLA forms serve instead
    assert "writable by its group and others" in proc.stderr and "chmod go-w" in proc.stderr
    assert not list(shared.iterdir())  # nothing was built or loaded there


def test_serve_refuses_a_world_writable_compile_cache(tmp_path: Path) -> None:
    shared = tmp_path / "xla"
    shared.mkdir()
    shared.chmod(0o777)
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--engine", "fake", "--model", "opt-tiny", "--grpc-port", "0",
           "--http-port", "0", "--no-warmup", "--compile-cache", str(shared)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert "--compile-cache" in proc.stderr and "chmod go-w" in proc.stderr and "ready" not in proc.stdout
