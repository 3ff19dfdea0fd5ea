"""JAX's persistent compilation cache: where it lives, and turning it on, so a restarted server skips its compiles.

`serve --compile-cache` turns it on (`enable_private_compilation_cache`: the directory must be this user's alone);
a library caller or a test calls `enable_compilation_cache`. JAX is imported only when a cache is turned on.
A process that starts engines elsewhere (the Ray backend's actors) hands them `CompileCacheConfig.current()`, so
every actor reads and fills the same cache as an embedded engine would: a second start compiles nothing anywhere.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/jaxserve/xla` (default `~/.cache/jaxserve/xla`), never the repository."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxserve" / "xla"


def enable_compilation_cache(cache_dir: str | Path | None = None, min_compile_time_s: float = 0.2) -> Path:
    """Turn on JAX's persistent compilation cache in `cache_dir` (default: `default_cache_dir()`); the directory.

    Programs that compiled in under `min_compile_time_s` are not stored."""
    import jax

    path = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser().absolute()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@dataclasses.dataclass(frozen=True)
class CompileCacheConfig:
    """The persistent compilation cache of one process, as another process turns on the same one."""

    directory: str
    min_compile_time_s: float

    @classmethod
    def current(cls) -> CompileCacheConfig | None:
        """This process's cache (None when none is on)."""
        import jax

        directory = getattr(jax.config, "jax_compilation_cache_dir")  # noqa: B009 (a flag the stubs do not declare)
        if not directory:
            return None
        return cls(str(directory), float(getattr(jax.config, "jax_persistent_cache_min_compile_time_secs")))  # noqa: B009

    def enable(self) -> Path:
        """Turn the same cache on in this process (`enable_compilation_cache`)."""
        return enable_compilation_cache(self.directory, self.min_compile_time_s)


def enable_private_compilation_cache(directory: Path, min_compile_time_s: float) -> Path:
    """`enable_compilation_cache` in a directory that must be this user's alone (`models.kernels.trust.
    ensure_private_dir`: created 0700 when missing; UntrustedDirectoryError, an OSError, when another user owns it
    or its group or others may write it): the cache holds compiled programs this process runs."""
    from models.kernels.trust import ensure_private_dir

    ensure_private_dir(directory, "the XLA compilation cache (--compile-cache)")
    return enable_compilation_cache(directory, min_compile_time_s)
