"""Trusting a cache directory before loading code from it (the compiled CPU kernel, XLA's compilation cache).

A cache this process loads native code or compiled programs from must be writable by this user only: a
shared or world-writable cache lets another user plant a library or an executable that runs inside the
server. `ensure_private_dir` creates a missing directory for this user alone (mode 0700) and refuses an
existing one that another user owns or that its group or others may write, as ssh does for its keys,
with a message that says how to fix it. Pure standard library: `jaxserve` imports it from here.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UntrustedDirectoryError(PermissionError):
    """A cache directory another user could write to."""


def ensure_private_dir(path: str | Path, what: str) -> Path:
    """Create `path` (mode 0700) if it is missing; raise UntrustedDirectoryError unless it is a directory owned
    by this user and not writable by its group or others. `what` names it in the message. Returns the path."""
    path = Path(path).expanduser().absolute()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = path.stat()  # follows a symbolic link: the directory it names is what gets loaded from
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedDirectoryError(f"{what} {path} is not a directory")
    problems: list[str] = []
    fixes: list[str] = []
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None and info.st_uid != uid:
        problems.append(f"owned by uid {info.st_uid}, not by this user (uid {uid})")
        fixes.append(f"chown {uid} {path}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(
            w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if info.st_mode & bit
        )
        problems.append(f"writable by {who} (mode {stat.S_IMODE(info.st_mode):o})")
        fixes.append(f"chmod go-w {path}")
    if problems:
        raise UntrustedDirectoryError(
            f"{what} {path} is {' and '.join(problems)}: another user could plant code this process would load. "
            f"Fix it ({'; '.join(fixes)}) or use a directory of your own."
        )
    return path
