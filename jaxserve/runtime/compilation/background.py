"""Background warm-up of an engine: shape covering and the compile thread (`warmup` with `background`).

`ModelEngine.warmup` with `background` compiles only what must be compiled before serving (the buckets that
hold all others, the decode side's inserts) before it returns, and hands the rest to this base class as an ordered
list of `CompileJob`s, run on a niced daemon thread. A job compiles one program ahead of time (nothing read or
written: the serving threads keep their pools) and then publishes it (`publish`: the engine adds its shape to
a ready set that is replaced, never mutated, so a serving thread reads it without a lock). Until a program is
published its work takes a fallback that compiles nothing:
* a step or prefill batch runs padded up to the cheapest compiled bucket that holds it (`_covering`; which
  buckets and in which order: `plan.py`), or, when none holds it whole, as consecutive sub-batches
  that each one holds (`held_runs`);
* a prefix-caching prefill batch with a hit is prefilled densely, its KV not kept in the pool while the insert
  of its length compiles;
* a partial pull moves the whole KV.

Slower for a while, never waiting on XLA (only a lone prompt longer than every compiled bucket compiles its
own: the thread compiles those first). The thread stops between jobs when asked (`stop_background_warmup`);
a compile in progress cannot be interrupted, so a stop that waited less than it took leaves the thread
registered, and at interpreter exit every thread still compiling is stopped and joined to its end: a daemon
thread still inside XLA when the interpreter finalizes aborts the process ("terminate called ... FATAL:
exception not rethrown": jaxlib takes the GIL every 200 ms while it waits for a compile, and a thread that
takes it during finalization is unwound through C++ frames that do not allow it). The wait at exit is one
program's compile at most; a SIGINT during it leaves at once (`os._exit`, status 130), never by finalizing.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.runtime.compilation.plan import is_held

log = logging.getLogger("jaxserve.runtime.engines.model")  # the engine's log: one logger for its warm-up lines


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One program the background thread compiles: `compile()` builds it without running it (it must touch
    no serving state), then `publish()` tells the serving side it may use it."""

    what: str  # for the log: e.g. "prefill (8, 64)"
    compile: Callable[[], None]
    publish: Callable[[], None]


class BackgroundWarmup:
    """Shape covering and the background compile thread of an engine (the base of `ModelCompilation`, which builds the jobs)."""

    def _init_background_warmup(self) -> None:
        # Shape covering (`warmup` with `background`): once on, a step or prefill batch whose own bucket is not
        # compiled yet runs padded up to the cheapest compiled bucket that holds it, so no request waits on XLA
        # while the remaining buckets compile on a background thread. Sets are replaced, never mutated.
        self.cover = False
        self.ready_prefill: frozenset[tuple[int, int]] = frozenset()
        self.ready_steps: frozenset[tuple[int, int, int]] = frozenset()
        self._background: _CompileThread | None = None
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
        self._background = _CompileThread(jobs)
        self._background.start()

    def hold_background_warmup(self) -> None:
        """The next `warmup` with `background` keeps its background jobs until `start_background_warmup()`: a
        server warming several engines starts every thread once all foreground warm-ups are done, so no
        engine's background compiles slow another's way to ready."""
        self._hold = True

    def start_background_warmup(self) -> None:
        """Start the background jobs `hold_background_warmup` kept waiting (if any)."""
        jobs, self._deferred, self._hold = self._deferred, (), False
        if jobs:
            self._start_background(jobs)

    def stop_background_warmup(self, timeout_s: float = 60.0) -> None:
        """Stop the background warm-up after the program it is compiling (if one runs), waiting up to
        `timeout_s` for that; a thread still compiling then is joined at interpreter exit."""
        self._deferred = ()
        compiling = self._background
        if compiling is not None:
            compiling.stop.set()
            compiling.thread.join(timeout=timeout_s)
            if not compiling.thread.is_alive():
                self._background = None

    def background_warmup_done(self, timeout_s: float | None = None) -> bool:
        """Wait up to `timeout_s` for the background warm-up; whether none is running or held back now."""
        if self._deferred:  # held (`hold_background_warmup`): nothing to wait for until it starts
            return False
        compiling = self._background
        if compiling is not None:
            compiling.thread.join(timeout=timeout_s)
            return not compiling.thread.is_alive()
        return True

    def covering(self, shape: tuple[int, ...], ready: frozenset[Any]) -> tuple[int, ...]:
        """`shape` if compiled (or covering is off), else the cheapest compiled bucket at least as large in
        every dimension (rows x tokens first, then table width); `shape` itself when none holds it."""
        if not self.cover or shape in ready:
            return shape
        holders = [r for r in ready if all(x >= y for x, y in zip(r, shape, strict=True))]
        if not holders:
            return shape
        return min(holders, key=lambda r: (r[0] * r[1], r[2:], r[0]))

    def held_runs(
        self, ids: Sequence[int], shape_of: Callable[[Sequence[int]], tuple[int, ...]], ready: frozenset[Any]
    ) -> list[list[int]]:
        """`ids` (a batch's rows) as one run, or, while covering and no compiled bucket holds the batch's
        `shape_of`, split in order into the fewest consecutive runs that each one holds: a batch wider than
        every compiled bucket (8 prompts of 32 tokens beside buckets of 4 x 32 and 8 x 16) runs as two
        compiled programs, never as a new one. Kept whole when some row alone is held by none (it compiles
        either way: one program, not one per row)."""
        whole = list(ids)
        if not self.cover or len(whole) < 2 or is_held(shape_of(whole), ready):
            return [whole]
        if not all(is_held(shape_of([i]), ready) for i in whole):
            return [whole]
        runs: list[list[int]] = [[]]
        for i in whole:
            if runs[-1] and not is_held(shape_of([*runs[-1], i]), ready):
                runs.append([])
            runs[-1].append(i)
        return runs


class _CompileThread:
    """One background warm-up's daemon thread, with its own stop flag (a later warm-up of the same engine never
    clears it) and the job it is compiling now (for the exit log)."""

    def __init__(self, jobs: Sequence[CompileJob]) -> None:
        self.jobs = jobs
        self.stop = threading.Event()
        self.compiling: str | None = None  # the job in progress
        self.thread = threading.Thread(target=self._work, name="jaxserve-background-warmup", daemon=True)

    def start(self) -> None:
        global _exit_hook_registered
        with _LIVE_LOCK:
            _LIVE[:] = [t for t in _LIVE if t.thread.is_alive()]
            _LIVE.append(self)
            if not _exit_hook_registered:  # after JAX's own exit hooks, so it runs before them (atexit is LIFO)
                atexit.register(_join_at_exit)
                _exit_hook_registered = True
        self.thread.start()

    def _work(self) -> None:
        t0, done = time.perf_counter(), 0
        with contextlib.suppress(AttributeError, OSError):  # compiles yield the cores to serving steps (Linux)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            for job in self.jobs:
                if self.stop.is_set():
                    return
                self.compiling = job.what
                started = time.perf_counter()
                job.compile()
                job.publish()
                self.compiling = None
                done += 1
                log.debug("background warm-up: %s in %.2f s", job.what, time.perf_counter() - started)
            log.info("background warm-up compiled %d more programs in %.1f s", done, time.perf_counter() - t0)
        except Exception:  # a failed background compile only leaves its work to the fallbacks
            log.exception("background warm-up stopped after %d programs (at %s)", done, self.jobs[done].what)


# Every compile thread started and maybe still running: joined before the interpreter finalizes.
_LIVE: list[_CompileThread] = []
_LIVE_LOCK = threading.Lock()
_exit_hook_registered = False
_JOIN_POLL_S = 0.05


def _join_at_exit() -> None:
    """Stop every background warm-up and wait for the program each is compiling (XLA cannot be interrupted):
    the interpreter must not finalize while one is inside XLA. A SIGINT at any point of the wait, its log lines
    included, leaves at once (status 130) without finalizing: a KeyboardInterrupt that escaped this hook would let
    the interpreter finalize and then wait on the compile thread anyway."""
    try:
        _join_live_threads()
    except KeyboardInterrupt:
        with contextlib.suppress(BaseException):  # a second Ctrl-C inside this line must not stop the exit
            log.warning("interrupted: exiting without waiting for the background compile")
        _flush_and_exit(130)


def _join_live_threads() -> None:
    with _LIVE_LOCK:
        live = [t for t in _LIVE if t.thread.is_alive()]
    for t in live:
        t.stop.set()
    for t in live:
        if not t.thread.is_alive():
            continue
        log.info("exit: waiting for the background compile in progress (%s) to end", t.compiling or "?")
        started = time.perf_counter()
        # Joined in short waits: a signal the kernel hands to another thread only sets a flag that this thread
        # reads between waits (an untimed join would sleep through it: a Ctrl-C the process never acts on).
        while t.thread.is_alive():
            t.thread.join(timeout=_JOIN_POLL_S)
        log.info("exit: the background compile ended after %.1f s", time.perf_counter() - started)


def _flush_and_exit(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
