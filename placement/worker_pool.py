"""Worker processes for the planner: a deterministic map and an ordered stream over candidate jobs.

`WorkerPool` keeps its processes across several maps (the rounds of `placement.search.evaluate_all`) and runs
in-process with one worker; results always come back by item index, so what a search picks never depends
on which worker finished first. A process that already runs JAX (the server replanning) spawns its workers
rather than forking them: forking XLA's threads can deadlock the child.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def pool_map(
    fn: Callable[[T], R], items: Sequence[T], workers: int, progress: Callable[[int, int], None] | None
) -> list[R]:
    """fn over items, in worker processes when workers > 1; results in item order."""
    with WorkerPool(workers) as pool:
        return pool.map(fn, items, progress)


class WorkerPool:
    """Worker processes kept across several maps (`evaluate_all`'s rounds); in-process when workers <= 1."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def map(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        progress: Callable[[int, int], None] | None,
        done: int = 0,
        total: int | None = None,
    ) -> list[R]:
        total = len(items) if total is None else total
        results: list[R] = []
        if self.workers <= 1 or len(items) <= 1:
            for item in items:
                results.append(fn(item))
                if progress:
                    progress(done + len(results), total)
            return results
        for r in self._executor().map(fn, items):
            results.append(r)
            if progress:
                progress(done + len(results), total)
        return results

    def stream(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        skip: Callable[[int], bool] | None,
        gated: Callable[[int], bool],
        lag: int,
    ) -> Iterator[tuple[int, R | None]]:
        """(index, fn(item)) as they finish, or (index, None) for an item `skip` rules out.

        An item that is `gated` starts (or is skipped) only once every item at least `lag` places before it
        has been yielded; `skip(i)` is asked then, and reads only those (so its answer does not depend on the
        workers' timing). Other items start as soon as a worker is free."""
        yielded: set[int] = set()
        upto = 0  # every item before this index has been yielded

        def ready(i: int) -> bool:
            return not gated(i) or i - lag < upto

        def ruled_out(i: int) -> bool:
            return gated(i) and skip is not None and skip(i)

        if self.workers <= 1:
            for i, item in enumerate(items):
                yield (i, None) if ruled_out(i) else (i, fn(item))
            return
        pool = self._executor()
        running: dict[Future[R], int] = {}
        nxt = 0
        while nxt < len(items) or running:
            while nxt < len(items) and len(running) < self.workers and ready(nxt):
                if ruled_out(nxt):
                    yielded.add(nxt)
                    yield nxt, None
                else:
                    running[pool.submit(fn, items[nxt])] = nxt
                nxt += 1
                while upto in yielded:
                    upto += 1
            if not running:
                continue  # the next item waits for nothing now (all before it were skipped)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                i = running.pop(future)
                yielded.add(i)
                yield i, future.result()
            while upto in yielded:
                upto += 1

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # Forking a process that already runs JAX (the server replanning) can deadlock its threads: spawn then.
            context = multiprocessing.get_context("spawn") if "jax" in sys.modules else None
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=context)
        return self._pool
