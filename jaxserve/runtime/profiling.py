"""Timing the real engine at a grid of shapes, for `jaxserve profile` (the fit is `placement/profile_fit.py`).

What is timed is exactly what the runtime's instances call, host overhead and sampling included:

* `dist` prefill — `ModelEngine.prefill(items)` (a prefill instance's step);
* decode — `ModelEngine.decode_step` over one-token rows on a paged pool (a decode instance's step,
  and a colocated instance's decode-only step);
* `coloc` prefill — `ModelEngine.decode_step` over prompt rows (`is_prompt`), the colocated
  instance's prefill-priority step.

Each shape runs once untimed (XLA compiles it) and then `repeats` times (more for short steps, until
its runs total `min_total_s`), in each of `passes` passes over the whole grid; the fastest run is kept:
on a shared machine other work only ever adds time, so the minimum is the step's own cost, and a
shape's runs spread over minutes are not all caught by one busy stretch of a neighbour. The
engine pads shapes to buckets, so the grid includes batch sizes and lengths between powers of two:
the fit then describes what the runtime really sees rather than only the bucket edges.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import numpy as np

from jaxserve.core.limits import DEFAULT_LIMITS
from jaxserve.core.request import SamplingParams
from jaxserve.core.scheduling import blocks_for
from jaxserve.core.step_samples import DecodeSample, PrefillSample
from jaxserve.runtime.engines.contract import PrefillItem, StepBatch, StepRow
from jaxserve.runtime.engines.model import ModelEngine
from models.config import ModelConfig

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
# A full grid's timing: 3 passes, short steps repeated until 0.1 s (`scripts/profile_fidelity.py` measured
# the off-grid P90 error of a single pass at 14-19 % on a shared machine, the small decode steps moving
# ±30 % between runs; the fastest of 3 passes is what its documented figures use).
DEFAULT_PASSES = 3
DEFAULT_MIN_TOTAL_S = 0.1


@dataclasses.dataclass(frozen=True)
class Grid:
    """Shapes to time. Prefill: (batch, prompt length) pairs; decode: (batch, context per sequence)."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    coloc_prefill: tuple[tuple[int, int], ...] = ()
    repeats: int = 3
    block_size: int = DEFAULT_LIMITS.block_size  # the KV page the server uses
    clock: str = "wall"  # a key of CLOCKS
    passes: int = 1  # passes over the whole grid; each shape keeps its fastest run of all of them
    min_total_s: float = 0.0  # repeat a short shape (up to 50 x repeats) until its runs total this


def default_grid(max_positions: int, quick: bool = False, block_size: int = DEFAULT_LIMITS.block_size) -> Grid:
    """A grid spanning short to long prompts, single prompts to batches, small to large decode batches.

    `quick` is a minimal grid (a few shapes per phase, for tests and smoke runs).
    """
    longest = min(max_positions // 2, 512)
    if quick:
        short, mid = min(32, longest), min(128, longest)
        prefill_q = ((1, 16), (1, short), (1, mid), (2, short), (2, mid // 2))
        decode_q = ((1, 16), (1, mid), (4, 16), (4, mid), (8, mid // 2))
        return Grid(prefill_q, decode_q, prefill_q, repeats=2, block_size=block_size)
    lengths = [n for n in (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if n <= longest]
    batches = (1, 2, 3, 4, 6, 8)
    prefill = tuple((1, n) for n in lengths) + tuple(
        (b, n) for b in batches if b > 1 for n in lengths if b * n <= 2 * longest
    )
    ctxs = [c for c in (16, 64, 160, 320) if c < max_positions - 1]
    # batches between powers of two too: the engine pads rows, so only such a grid tells a cost per padded
    # row (kernels) from one per actual row or context token (host work)
    # up to 64 rows: each bucket has a cost of its own (placement/bucket_latency.py) and one beyond the grid
    # is extrapolated; serving caps decode at 32 rows by default, and plans may run 64
    decode = tuple((b, c) for b in (1, 2, 3, 4, 8, 12, 16, 32, 64) for c in ctxs)
    return Grid(
        prefill=prefill,
        decode=decode,
        coloc_prefill=prefill,
        repeats=3,
        block_size=block_size,
        passes=DEFAULT_PASSES,
        min_total_s=DEFAULT_MIN_TOTAL_S,
    )


def custom_grid(
    prefill_lengths: Sequence[int],
    prefill_batches: Sequence[int],
    decode_batches: Sequence[int],
    decode_contexts: Sequence[int],
    repeats: int = 3,
    block_size: int = DEFAULT_LIMITS.block_size,
) -> Grid:
    """Every single prompt of each length, batches up to twice the longest prompt in total, every decode pair."""
    cap = 2 * max(prefill_lengths)
    prefill = tuple((1, n) for n in prefill_lengths) + tuple(
        (b, n) for b in prefill_batches if b > 1 for n in prefill_lengths if b * n <= cap
    )
    decode = tuple((b, c) for b in decode_batches for c in decode_contexts)
    return Grid(
        prefill,
        decode,
        prefill,
        repeats=repeats,
        block_size=block_size,
        passes=DEFAULT_PASSES,
        min_total_s=DEFAULT_MIN_TOTAL_S,
    )


# What a step's time is read from: `wall` (elapsed time, what a server on dedicated cores sees) or `cpu`
# (this process's CPU time, all its threads: the step's own work, not the time other processes
# held the core — the clock to use on a shared machine, valid while the step never waits idle).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _time(fn: Callable[[], object], repeats: int, clock: str = "wall", min_total_s: float = 0.0) -> float:
    """The fastest of at least `repeats` runs, more (up to 50 × `repeats`) until they total `min_total_s`:
    a short step gets more tries at a run nothing disturbed."""
    now = CLOCKS[clock]
    jax.block_until_ready(fn())  # compile (and finish) before the clock starts
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_total_s and len(times) < 50 * repeats):
        start = now()
        out = fn()
        jax.block_until_ready(out)
        times.append(now() - start)
    return min(times)


def _prompt(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(4, vocab, size=n))


def time_prefill(
    engine: ModelEngine,
    shapes: Sequence[tuple[int, int]],
    repeats: int,
    seed: int = 0,
    clock: str = "wall",
    min_total_s: float = 0.0,
) -> list[PrefillSample]:
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    out = []
    for b, n in shapes:
        items = [PrefillItem(f"p{i}", _prompt(rng, n, vocab), GREEDY, i) for i in range(b)]

        def call(items: list[PrefillItem] = items) -> object:
            result = engine.prefill(items)
            return [s.kv for s in result.sequences]  # the KV slices the instance keeps are part of the step

        out.append(PrefillSample((n,) * b, _time(call, repeats, clock, min_total_s)))
    return out


class _Pool:
    """A paged pool big enough for the largest shape, reused (and donated) across calls."""

    def __init__(self, engine: ModelEngine, num_blocks: int, block_size: int) -> None:
        self.engine = engine
        self.block_size = block_size
        self.pages = engine.init_pages(num_blocks, block_size)

    def step(self, rows: tuple[StepRow, ...]) -> object:
        tokens, self.pages = self.engine.decode_step(StepBatch(rows), self.pages)
        return tokens


def _tables(batch: int, tokens_each: int, block_size: int) -> list[tuple[int, ...]]:
    per = blocks_for(tokens_each, block_size)
    return [tuple(range(i * per, (i + 1) * per)) for i in range(batch)]


def time_decode(
    engine: ModelEngine,
    shapes: Sequence[tuple[int, int]],
    repeats: int,
    block_size: int,
    clock: str = "wall",
    min_total_s: float = 0.0,
    num_blocks: int | None = None,
) -> list[DecodeSample]:
    """`num_blocks` sizes the paged pool (default: the largest shape's need); a caller timing shapes one
    call at a time passes the same size to each, so every step runs on the same pool shape."""
    need = max(b * blocks_for(c + 1, block_size) for b, c in shapes)
    pool = _Pool(engine, max(need, num_blocks or 0), block_size)
    out = []
    for b, c in shapes:
        rows = tuple(
            StepRow(f"d{i}", (5,), c, table, GREEDY, i, 1) for i, table in enumerate(_tables(b, c + 1, block_size))
        )
        out.append(DecodeSample(b, b * c, _time(functools.partial(pool.step, rows), repeats, clock, min_total_s)))
    return out


def time_coloc_prefill(
    engine: ModelEngine,
    shapes: Sequence[tuple[int, int]],
    repeats: int,
    block_size: int,
    seed: int = 0,
    clock: str = "wall",
    min_total_s: float = 0.0,
    num_blocks: int | None = None,
) -> list[PrefillSample]:
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    need = max(b * blocks_for(n, block_size) for b, n in shapes)
    pool = _Pool(engine, max(need, num_blocks or 0), block_size)  # `num_blocks` as in `time_decode`
    out = []
    for b, n in shapes:
        prompt_rows = tuple(
            StepRow(f"c{i}", _prompt(rng, n, vocab), 0, table, GREEDY, i, 0, is_prompt=True)
            for i, table in enumerate(_tables(b, n, block_size))
        )
        out.append(
            PrefillSample((n,) * b, _time(functools.partial(pool.step, prompt_rows), repeats, clock, min_total_s))
        )
    return out


@dataclasses.dataclass(frozen=True)
class Measurements:
    cfg: ModelConfig
    tp: int
    prefill: list[PrefillSample]
    decode: list[DecodeSample]
    coloc_prefill: list[PrefillSample]
    coloc_decode: list[DecodeSample]  # the same as `decode` unless that was timed with a busy neighbour


class _Neighbour:
    """Work on the devices next to the profiled ones, as a disaggregated peer instance would run it.

    A prefill instance and a decode instance are busy at the same time; where devices share physical
    resources (two vCPUs of one host core, a memory bus), each runs slower than alone. While a phase is
    timed with a neighbour, the neighbour loops the *other* phase: decode steps (batch 8) while prefill
    is timed, prefills of `length` tokens while decode is timed.
    """

    def __init__(self, engine: ModelEngine, length: int, block_size: int) -> None:
        import threading

        self.engine = engine
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        rng = np.random.default_rng(1)
        self.items = [PrefillItem("n", _prompt(rng, length, engine.model_config.vocab_size), GREEDY, 0)]
        self.pool = _Pool(engine, 8 * blocks_for(length + 1, block_size), block_size)
        tables = _tables(8, length + 1, block_size)
        self.rows = tuple(StepRow(f"n{i}", (5,), length, t, GREEDY, i, 1) for i, t in enumerate(tables))

    def _loop(self, phase: str) -> None:
        while not self.stop.is_set():
            if phase == "decode":
                jax.block_until_ready(self.pool.step(self.rows))
            else:
                jax.block_until_ready([s.kv for s in self.engine.prefill(self.items).sequences])

    def start(self, phase: str) -> None:
        import threading

        self.stop.clear()
        self._loop_once(phase)  # compiled before the clock matters
        self.thread = threading.Thread(target=self._loop, args=(phase,), daemon=True)
        self.thread.start()

    def _loop_once(self, phase: str) -> None:
        if phase == "decode":
            jax.block_until_ready(self.pool.step(self.rows))
        else:
            jax.block_until_ready([s.kv for s in self.engine.prefill(self.items).sequences])

    def end(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


def measure(
    source: str,
    tp: int,
    grid: Grid,
    devices: Sequence[jax.Device] | None = None,
    dtype: str = "float32",
    log: Callable[[str], None] | None = None,
    neighbour_length: int | None = None,
) -> Measurements:
    """Load `source` on `tp` devices and time every shape of `grid`.

    With `neighbour_length`, prefill and decode (the `dist` engines) are timed while the next `tp`
    devices run the other phase (`_Neighbour`), as in a disaggregated deployment; colocated prompt
    steps are still timed alone (a colocated instance has no busy peer).
    """
    all_devs = list(devices) if devices is not None else jax.devices()
    devs = all_devs[:tp]
    engine = ModelEngine.load(source, devs, tp=tp, pp=1, dtype=dtype)
    say = log or (lambda _msg: None)
    neighbour = None
    if neighbour_length:
        if len(all_devs) < 2 * tp:
            raise ValueError(f"timing with a busy neighbour needs {2 * tp} devices")
        peer = ModelEngine.load(source, all_devs[tp : 2 * tp], tp=tp, pp=1, dtype=dtype)
        neighbour = _Neighbour(peer, neighbour_length, grid.block_size)
    passes = max(1, grid.passes)
    runs = []
    for k in range(passes):
        label = f"tp{tp} pass {k + 1}/{passes}"
        runs.append(_one_pass(engine, grid, functools.partial(_labelled, say, label), neighbour))
    prefill = fastest_of([run[0] for run in runs])
    decode = fastest_of([run[1] for run in runs])
    coloc = fastest_of([run[2] for run in runs])
    coloc_decode = fastest_of([run[3] for run in runs])
    return Measurements(engine.model_config, tp, prefill, decode, coloc, coloc_decode)


_S = TypeVar("_S", bound=PrefillSample | DecodeSample)


def fastest_of(passes: Sequence[Sequence[_S]]) -> list[_S]:
    """Per shape, the fastest of several passes' samples (every pass timed the same shapes in order)."""
    return [min(same, key=lambda s: s.seconds) for same in zip(*passes, strict=True)]


def _labelled(say: Callable[[str], None], label: str, msg: str) -> None:
    say(f"{label}: {msg}")


def _one_pass(
    engine: ModelEngine, grid: Grid, say: Callable[[str], None], neighbour: _Neighbour | None
) -> tuple[list[PrefillSample], list[DecodeSample], list[PrefillSample], list[DecodeSample]]:
    """Every shape of `grid` once: prefill, decode, colocated prompt steps (and decode alone, with a neighbour)."""
    timing = (grid.clock, grid.min_total_s)
    say(f"{len(grid.prefill)} prefill shapes" + (" (neighbour decoding)" if neighbour else ""))
    if neighbour:
        neighbour.start("decode")
    try:
        prefill = time_prefill(engine, grid.prefill, grid.repeats, 0, *timing)
    finally:
        if neighbour:
            neighbour.end()
    say(f"{len(grid.decode)} decode shapes" + (" (neighbour prefilling)" if neighbour else ""))
    if neighbour:
        neighbour.start("prefill")
    try:
        decode = time_decode(engine, grid.decode, grid.repeats, grid.block_size, *timing)
    finally:
        if neighbour:
            neighbour.end()
    coloc: list[PrefillSample] = []
    coloc_decode = decode
    if grid.coloc_prefill:
        say(f"{len(grid.coloc_prefill)} colocated prefill shapes")
        coloc = time_coloc_prefill(engine, grid.coloc_prefill, grid.repeats, grid.block_size, 0, *timing)
        if neighbour:
            say(f"{len(grid.decode)} decode shapes alone (colocated)")
            coloc_decode = time_decode(engine, grid.decode, grid.repeats, grid.block_size, *timing)
    return prefill, decode, coloc, coloc_decode


def parallel_scaling(source: str, length: int = 256, calls: int = 8, dtype: str = "float32") -> dict[str, float]:
    """Does device 1 add a core? The same prefill on device 0 alone, then on devices 0 and 1 at once.

    Returns seconds per call alone, wall seconds for `calls` calls on each device concurrently, and
    the speed-up (2 × alone-time / together-time; 2.0 means two devices do twice the work of one).
    """
    import threading

    devs = jax.devices()
    if len(devs) < 2:
        raise ValueError("needs two devices")
    engines = [ModelEngine.load(source, [d], tp=1, pp=1, dtype=dtype) for d in devs[:2]]
    rng = np.random.default_rng(0)
    items = [PrefillItem("s", _prompt(rng, length, engines[0].model_config.vocab_size), GREEDY, 0)]

    def work(engine: ModelEngine) -> None:
        for _ in range(calls):
            jax.block_until_ready([s.kv for s in engine.prefill(items).sequences])

    for engine in engines:  # compile on both
        jax.block_until_ready([s.kv for s in engine.prefill(items).sequences])
    start = time.perf_counter()
    work(engines[0])
    alone = time.perf_counter() - start
    threads = [threading.Thread(target=work, args=(e,)) for e in engines]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = time.perf_counter() - start
    return {"alone_s_per_call": alone / calls, "together_wall_s": together, "speedup": 2 * alone / together}
