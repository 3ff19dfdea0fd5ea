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


# ---- the directories above it (as ssh checks every directory up to the root) ------------------------------


@pytest.mark.parametrize(("mode", "who"), [(0o777, "its group and others"), (0o757, "others"), (0o775, "its group")])
def test_a_parent_others_may_write_without_the_sticky_bit_is_refused(tmp_path: Path, mode: int, who: str) -> None:
    """Whoever may rename entries of a parent can move the cache away and put a directory of theirs there: refused,
    before anything is created, with the fix; the sticky bit (as /tmp has) makes the same parent safe."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(mode)
    cache = open_dir / "deep" / "cache"
    with pytest.raises(UntrustedDirectoryError) as info:
        ensure_private_dir(cache, "the test cache")
    message = str(info.value)
    assert f"the test cache {cache} sits under {open_dir}" in message
    assert f"writable by {who} without the sticky bit" in message
    assert f"chmod go-w {open_dir}, or chmod +t {open_dir}" in message
    assert not (open_dir / "deep").exists()  # nothing was created in the unsafe place
    (open_dir / "deep").mkdir(mode=0o700)  # an existing cache below it: refused the same way
    cache.mkdir(mode=0o700)
    with pytest.raises(UntrustedDirectoryError, match="without the sticky bit"):
        ensure_private_dir(cache, "the test cache")
    open_dir.chmod(mode | stat.S_ISVTX)  # one fix the message names
    assert ensure_private_dir(cache, "the test cache") == cache
    open_dir.chmod(0o755)  # the other
    assert ensure_private_dir(cache, "the test cache") == cache


def test_a_cache_reached_through_a_link_is_checked_where_it_really_is(tmp_path: Path) -> None:
    """A link of ours in a safe directory to a cache under a world-writable one: the real path's parents count."""
    open_dir = tmp_path / "open"
    (open_dir / "cache").mkdir(parents=True, mode=0o700)
    open_dir.chmod(0o777)
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    link = safe / "cache"
    link.symlink_to(open_dir / "cache")
    with pytest.raises(
        UntrustedDirectoryError, match=f"sits under {open_dir}, which is writable by its group and others"
    ):
        ensure_private_dir(link, "the test cache")


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="giving a directory away needs root")
def test_a_parent_another_user_owns_is_refused(tmp_path: Path) -> None:
    """Another (non-root) user's directory above the cache: they may rename what is in it, whatever its mode."""
    theirs = tmp_path / "theirs"
    (theirs / "cache").mkdir(parents=True, mode=0o700)
    theirs.chmod(0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UntrustedDirectoryError) as info:
        ensure_private_dir(theirs / "cache", "the test cache")
    message = str(info.value)
    assert f"sits under {theirs}, which is owned by uid 65534 (neither root nor this user" in message
    assert f"chown {os.getuid()} {theirs}" in message
    os.chown(theirs, 0, 0)  # root's, as /, /usr and /tmp are: fine
    assert ensure_private_dir(theirs / "cache", "the test cache") == theirs / "cache"
    link_dir = tmp_path / "links"
    link_dir.mkdir(mode=0o755)
    link = link_dir / "cache"
    link.symlink_to(theirs / "cache")
    os.lchown(link, 65534, 65534)  # a link another user owns could be pointed elsewhere
    with pytest.raises(UntrustedDirectoryError, match=r"through the symbolic link .*owned by uid 65534"):
        ensure_private_dir(link, "the test cache")
