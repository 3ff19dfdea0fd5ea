"""Background warm-up of an engine: shape covering and the compile thread (`warmup(background=True)`).

`ModelEngine.warmup(background=True)` compiles only what must be compiled before serving (the buckets that
hold all others, the decode side's inserts) before it returns, and hands the rest to this mixin as an ordered
list of `CompileJob`s, run on a niced daemon thread. A job compiles one program ahead of time (nothing read or
written: the serving threads keep their pools) and then publishes it (`publish`: the engine adds its shape to
a ready set that is replaced, never mutated, so a serving thread reads it without a lock). Until a program is
published its work takes a fallback that compiles nothing:
* a step or prefill batch runs padded up to the cheapest compiled bucket that holds it (`_covering`; which
  buckets and in which order: `warmup_plan.py`), or, when none holds it whole, as consecutive sub-batches
  that each one holds (`_held_runs`);
* a prefix-caching prefill batch with a hit is prefilled densely, its KV not kept in the pool while the insert
  of its length compiles;
* a partial pull moves the whole KV.

Slower for a while, never waiting on XLA (only a lone prompt longer than every compiled bucket compiles its
own: the thread compiles those first). The thread stops between jobs when asked
(`stop_background_warmup`, and at interpreter exit for every engine still compiling).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.runtime.engines.warmup_plan import is_held

log = logging.getLogger("jaxserve.runtime.engines.model")  # the engine's log: one logger for its warm-up lines


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One program the background thread compiles: `compile()` builds it without running it (it must touch
    no serving state), then `publish()` tells the serving side it may use it."""

    what: str  # for the log: e.g. "prefill (8, 64)"
    compile: Callable[[], None]
    publish: Callable[[], None]


class BackgroundWarmup:
    """Shape covering and the background compile thread of an engine (a mixin: the engine builds the jobs)."""

    def _init_background_warmup(self) -> None:
        # Shape covering (`warmup(background=True)`): once on, a step or prefill batch whose own bucket is not
        # compiled yet runs padded up to the cheapest compiled bucket that holds it, so no request waits on XLA
        # while the remaining buckets compile on a background thread. Sets are replaced, never mutated.
        self._cover = False
        self._ready_prefill: frozenset[tuple[int, int]] = frozenset()
        self._ready_steps: frozenset[tuple[int, int, int]] = frozenset()
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        self._publishing = threading.Lock()  # `_publish` from several compile threads loses no key
        self._hold = False  # `hold_background_warmup`: the next jobs wait for `start_background_warmup`
        self._deferred: Sequence[CompileJob] = ()

    def _publish(self, ready_set: str, key: object) -> None:
        """One compiled program is in: `key` joins the engine's ready set named `ready_set` (a new set)."""
        with self._publishing:
            setattr(self, ready_set, getattr(self, ready_set) | {key})

    # ---- the thread ------------------------------------------------------------------
    def _start_background(self, jobs: Sequence[CompileJob]) -> None:
        """Run `jobs` in order on a daemon thread; each publishes its program once compiled. Stops between
        jobs when asked (`stop_background_warmup`); a job that fails leaves the rest to their fallbacks.
        Held (`hold_background_warmup`): kept until `start_background_warmup()`."""
        self.stop_background_warmup()
        if self._hold:
            self._hold, self._deferred = False, jobs
            return
        self._stop_background.clear()

        def work() -> None:
            t0, done = time.perf_counter(), 0
            with contextlib.suppress(AttributeError, OSError):  # compiles yield the cores to serving steps (Linux)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            try:
                for job in jobs:
                    if self._stop_background.is_set():
                        return
                    job.compile()
                    job.publish()
                    done += 1
                log.info("background warm-up compiled %d more programs in %.1f s", done, time.perf_counter() - t0)
            except Exception:  # a failed background compile only leaves its work to the fallbacks
                log.exception("background warm-up stopped after %d programs (at %s)", done, jobs[done].what)

        self._background = threading.Thread(target=work, name="jaxserve-background-warmup", daemon=True)
        _BACKGROUND.add(self)
        self._background.start()

    def hold_background_warmup(self) -> None:
        """The next `warmup(background=True)` keeps its background jobs until `start_background_warmup()`: a
        server warming several engines starts every thread once all foreground warm-ups are done, so no
        engine's background compiles slow another's way to ready."""
        self._hold = True

    def start_background_warmup(self) -> None:
        """Start the background jobs `hold_background_warmup` kept waiting (if any)."""
        jobs, self._deferred, self._hold = self._deferred, (), False
        if jobs:
            self._start_background(jobs)

    def stop_background_warmup(self, timeout_s: float = 60.0) -> None:
        """Stop the background warm-up after the program it is compiling (if one runs)."""
        self._deferred = ()
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

    def _covering(self, shape: tuple[int, ...], ready: frozenset[Any]) -> tuple[int, ...]:
        """`shape` if compiled (or covering is off), else the cheapest compiled bucket at least as large in
        every dimension (rows x tokens first, then table width); `shape` itself when none holds it."""
        if not self._cover or shape in ready:
            return shape
        holders = [r for r in ready if all(x >= y for x, y in zip(r, shape, strict=True))]
        if not holders:
            return shape
        return min(holders, key=lambda r: (r[0] * r[1], r[2:], r[0]))

    def _held_runs(
        self, ids: Sequence[int], shape_of: Callable[[Sequence[int]], tuple[int, ...]], ready: frozenset[Any]
    ) -> list[list[int]]:
        """`ids` (a batch's rows) as one run, or, while covering and no compiled bucket holds the batch's
        `shape_of`, split in order into the fewest consecutive runs that each one holds: a batch wider than
        every compiled bucket (8 prompts of 32 tokens beside buckets of 4 x 32 and 8 x 16) runs as two
        compiled programs, never as a new one. Kept whole when some row alone is held by none (it compiles
        either way: one program, not one per row)."""
        whole = list(ids)
        if not self._cover or len(whole) < 2 or is_held(shape_of(whole), ready):
            return [whole]
        if not all(is_held(shape_of([i]), ready) for i in whole):
            return [whole]
        runs: list[list[int]] = [[]]
        for i in whole:
            if runs[-1] and not is_held(shape_of([*runs[-1], i]), ready):
                runs.append([])
            runs[-1].append(i)
        return runs


# Engines whose background warm-up may still compile: stopped (between programs) before the interpreter exits.
_BACKGROUND: weakref.WeakSet[BackgroundWarmup] = weakref.WeakSet()


@atexit.register
def _stop_background_warmups() -> None:
    for engine in list(_BACKGROUND):
        engine.stop_background_warmup(timeout_s=30.0)
