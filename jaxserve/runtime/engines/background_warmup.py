"""Background bucket warm-up of an engine: shape covering and the compile thread (`warmup(background=True)`).

`ModelEngine.warmup(background=True)` compiles only the buckets that hold all others before it returns; this
mixin keeps what is compiled (`_ready_prefill`, `_ready_steps`: sets that are replaced, never mutated, so a
serving thread reads them without a lock) and compiles the remaining buckets on a niced daemon thread,
smallest first. Until a bucket is compiled, its work runs padded up to the cheapest compiled bucket that holds
it (`_covering`): slower for a while, never waiting on XLA. The thread stops between buckets when asked
(`stop_background_warmup`, and at interpreter exit for every engine still compiling).

The engine supplies the compiles: `_precompile_prefill(b, t, ...)` and `_precompile_step(b, t, m, caches, ...)`
(compile only: they read and write nothing, so the serving steps keep their pools).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

from jaxserve.core.request import SamplingParams
from models.attention import PagedKVCache

log = logging.getLogger("jaxserve.runtime.engines.model")  # the engine's log: one logger for its warm-up lines


class BackgroundWarmup:
    """Shape covering and the background compile thread of an engine (a mixin: the engine compiles)."""

    def _init_background_warmup(self) -> None:
        # Shape covering (`warmup(background=True)`): once on, a step or prefill batch whose own bucket is not
        # compiled yet runs padded up to the cheapest compiled bucket that holds it, so no request waits on XLA
        # while the remaining buckets compile on a background thread. Sets are replaced, never mutated.
        self._cover = False
        self._ready_prefill: frozenset[tuple[int, int]] = frozenset()
        self._ready_steps: frozenset[tuple[int, int, int]] = frozenset()
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()

    # ---- what the engine compiles ------------------------------------------------
    def _precompile_prefill(self, b: int, t: int, rand: SamplingParams, greedy: SamplingParams, logprobs: bool) -> None:
        raise NotImplementedError

    def _precompile_step(
        self,
        b: int,
        t: int,
        m: int,
        caches: list[PagedKVCache],
        rand: SamplingParams,
        greedy: SamplingParams,
        logprobs: bool,
    ) -> None:
        raise NotImplementedError

    # ---- the thread ------------------------------------------------------------------
    def _start_background(
        self,
        prefill_shapes: list[tuple[int, int]],
        step_shapes: list[tuple[int, int, int]],
        caches: list[PagedKVCache] | None,
        rand: SamplingParams,
        greedy: SamplingParams,
        logprobs: bool,
    ) -> None:
        """Compile the remaining buckets on a daemon thread, smallest first (the most common work); each joins
        the covering sets once compiled. Stops between buckets when asked (`stop_background_warmup`)."""
        self.stop_background_warmup()
        self._stop_background.clear()

        def work() -> None:
            t0, done = time.perf_counter(), 0
            with contextlib.suppress(AttributeError, OSError):  # compiles yield the cores to serving steps (Linux)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            try:
                for b, t in sorted(prefill_shapes, key=lambda x: (self._held(x, self._ready_prefill), bucket_area(x))):
                    if self._stop_background.is_set():
                        return
                    self._precompile_prefill(b, t, rand, greedy, logprobs)
                    self._ready_prefill = self._ready_prefill | {(b, t)}
                    done += 1
                for b, t, m in sorted(
                    step_shapes, key=lambda x: (self._held(x, self._ready_steps), bucket_area(x), x[2])
                ):
                    if self._stop_background.is_set() or caches is None:
                        return
                    self._precompile_step(b, t, m, caches, rand, greedy, logprobs)
                    self._ready_steps = self._ready_steps | {(b, t, m)}
                    done += 1
                log.info("background warm-up compiled %d more shapes in %.1f s", done, time.perf_counter() - t0)
            except Exception:  # a failed background compile only leaves that bucket to the covering
                log.exception("background warm-up stopped after %d shapes", done)

        self._background = threading.Thread(target=work, name="jaxserve-background-warmup", daemon=True)
        _BACKGROUND.add(self)
        self._background.start()

    def stop_background_warmup(self, timeout_s: float = 60.0) -> None:
        """Stop the background warm-up after the bucket it is compiling (if one runs)."""
        thread = self._background
        if thread is not None and thread.is_alive():
            self._stop_background.set()
            thread.join(timeout=timeout_s)
        self._background = None
        _BACKGROUND.discard(self)

    def background_warmup_done(self, timeout_s: float | None = None) -> bool:
        """Wait up to `timeout_s` for the background warm-up; whether none is running now."""
        thread = self._background
        if thread is not None:
            thread.join(timeout=timeout_s)
            return not thread.is_alive()
        return True

    @staticmethod
    def _held(shape: tuple[int, ...], ready: frozenset[Any]) -> bool:
        """Whether some compiled bucket holds `shape` (a bucket nothing holds compiles first in the background)."""
        return any(all(x >= y for x, y in zip(r, shape, strict=True)) for r in ready)

    def _covering(self, shape: tuple[int, ...], ready: frozenset[Any]) -> tuple[int, ...]:
        """`shape` if compiled (or covering is off), else the cheapest compiled bucket at least as large in
        every dimension (rows x tokens first, then table width); `shape` itself when none holds it."""
        if not self._cover or shape in ready:
            return shape
        holders = [r for r in ready if all(x >= y for x, y in zip(r, shape, strict=True))]
        if not holders:
            return shape
        return min(holders, key=lambda r: (r[0] * r[1], r[2:], r[0]))


_Shape = TypeVar("_Shape", bound=tuple[int, ...])


def frontier(shapes: Sequence[_Shape]) -> list[_Shape]:
    """The shapes no other shape holds (>= in every dimension): padded up, they run everything in `shapes`."""
    unique = sorted(set(shapes))
    return [s for s in unique if not any(o != s and all(x >= y for x, y in zip(o, s, strict=True)) for o in unique)]


def bucket_area(shape: tuple[int, ...]) -> int:
    """Rows x tokens of a bucket (the work it pads to)."""
    return shape[0] * shape[1]


# Engines whose background warm-up may still compile: stopped (between buckets) before the interpreter exits.
_BACKGROUND: weakref.WeakSet[BackgroundWarmup] = weakref.WeakSet()


@atexit.register
def _stop_background_warmups() -> None:
    for engine in list(_BACKGROUND):
        engine.stop_background_warmup(timeout_s=30.0)
