"""Trusting a cache directory before loading from it (the CPU kernel, XLA's compilation cache, pulled models).

A cache this process loads native code, compiled programs or model weights from must be writable by this
user only: a shared or world-writable cache lets another user plant a library, an executable that runs
inside the server, or the weights it serves. `ensure_private_dir` creates a missing directory for this user alone (mode 0700) and refuses an
existing one that another user owns or that its group or others may write, as ssh does for its keys,
with a message that says how to fix it.

The directories above it count too, as ssh checks every directory up to the root: whoever may rename
entries of a parent can move the cache away and put a directory of theirs in its place. So every
ancestor of the cache (on the path as named and on its real path, links resolved) must be owned by root
or this user, and one that its group or others may write must have the sticky bit (as /tmp has: only an
entry's owner may then rename or delete it); a symbolic link on the way must be root's or this user's.
Pure standard library, in the contract layer: the model registry (`jaxserve.model_registry`) and the
kernels (`models.kernels.trust` re-exports it) share it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UntrustedDirectoryError(PermissionError):
    """A cache directory another user could write to, or swap for one of theirs."""


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _writers(mode: int) -> str:
    """Who besides the owner may write an entry of this mode ("its group and others"; "" for nobody)."""
    return " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if mode & bit)


def _refuse_if(problems: list[str], fixes: list[str], subject: str, threat: str) -> None:
    """Raise UntrustedDirectoryError when there are `problems`: "`subject` <problems>: `threat`. Fix it (<fixes>)"."""
    if problems:
        raise UntrustedDirectoryError(
            f"{subject} {' and '.join(problems)}: {threat}. Fix it ({'; '.join(fixes)}) or use a directory of your own."
        )


def _check_parents(path: Path, what: str, cache: Path) -> None:
    """Raise UntrustedDirectoryError if a directory above `path` (itself excluded) lets another user swap it.
    `cache` is the cache directory the message names."""
    uid = _uid()
    if uid is None:  # no POSIX owners here
        return
    for link in (p for p in (path, *path.parents) if p.is_symlink()):  # its owner may point it elsewhere
        owner = link.lstat().st_uid
        if owner not in (0, uid):
            raise UntrustedDirectoryError(
                f"{what} {cache} is reached through the symbolic link {link}, owned by uid {owner} (neither root "
                f"nor this user, uid {uid}): they could point it at a directory of theirs. Use the real path "
                f"({link.resolve()}) or a directory of your own."
            )
    for parent in path.parents:
        info = parent.stat()  # follows a link: the directory it names is what holds the entry
        problems: list[str] = []
        fixes: list[str] = []
        if info.st_uid not in (0, uid):
            problems.append(f"owned by uid {info.st_uid} (neither root nor this user, uid {uid})")
            fixes.append(f"chown {uid} {parent}")
        who = _writers(info.st_mode)
        if who and not info.st_mode & stat.S_ISVTX:
            problems.append(f"writable by {who} without the sticky bit (mode {stat.S_IMODE(info.st_mode):o})")
            fixes.append(f"chmod go-w {parent}, or chmod +t {parent}")
        _refuse_if(
            problems,
            fixes,
            f"{what} {cache} sits under {parent}, which is",
            "another user could replace the cache with a directory of theirs",
        )


def ensure_private_dir(path: str | Path, what: str) -> Path:
    """Create `path` (mode 0700) if it is missing; raise UntrustedDirectoryError unless it is a directory owned
    by this user and not writable by its group or others, below directories no other user can swap it in
    (see the module docstring). `what` names it in the message. Returns the path."""
    path = Path(path).expanduser().absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and existing != path:  # refuse before creating anything in an unsafe place
        for chain in (existing, existing.resolve()):
            _check_parents(chain / "x", what, path)  # `chain` and every directory above it
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return check_private_dir(path, what)


def check_private_dir(path: str | Path, what: str) -> Path:
    """Raise UntrustedDirectoryError unless the existing `path` is this user's private directory below
    directories no other user can swap it in (`ensure_private_dir` without the creation). Returns the path."""
    path = Path(path).expanduser().absolute()
    info = path.stat()  # follows a symbolic link: the directory it names is what gets loaded from
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedDirectoryError(f"{what} {path} is not a directory")
    problems: list[str] = []
    fixes: list[str] = []
    uid = _uid()
    if uid is not None and info.st_uid != uid:
        problems.append(f"owned by uid {info.st_uid}, not by this user (uid {uid})")
        fixes.append(f"chown {uid} {path}")
    who = _writers(info.st_mode)
    if who:
        problems.append(f"writable by {who} (mode {stat.S_IMODE(info.st_mode):o})")
        fixes.append(f"chmod go-w {path}")
    _refuse_if(problems, fixes, f"{what} {path} is", "another user could plant code this process would load")
    for chain in (path, path.resolve()):  # the way it is named, and where it really is
        _check_parents(chain, what, path)
    return path
