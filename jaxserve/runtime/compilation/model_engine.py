"""The warm-up of the real engine: `ModelEngine.warmup` compiles every padded shape the serving limits allow.

`ModelCompilation`, an object each `ModelEngine` owns (`engine.compilation`) and that drives the engine through a
narrow protocol (`WarmupHost`: the model, its KV layout and the engine's own programs), as tpu-inference's
compilation manager does: which shapes is the plan's (`plan.py`, pure functions of the limits); this module runs it. Before `warmup` returns it compiles, by running the engine's own
programs once on padding that writes no KV, every prefill bucket (and its rows' KV cuts), paged step bucket,
multi-step program, KV insert and sampler; with `background=True` only the buckets that hold all others (and the
inserts and multi-step programs), handing the rest as `CompileJob`s to the compile thread of `BackgroundWarmup`
(`background.py`). A job compiles ahead of time in `compile` (nothing read or written) and adds its
programs to the engine's ready sets in `publish` only. The ready sets (replaced, never mutated) tell the
serving side what runs compiled now: its prefill and step buckets (`BackgroundWarmup`), KV copies
(`kv_copy_compiled`) and random samplers (`sampling_rows`: a batch is sampled on logits padded up to a
compiled one meanwhile).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol

import jax
import numpy as np

from jaxserve.core.request import SamplingParams
from jaxserve.runtime.compilation.background import BackgroundWarmup, CompileJob
from jaxserve.runtime.compilation.plan import (
    compile_order,
    foreground_prefill,
    foreground_steps,
    is_held,
    powers_of_two,
    prefill_buckets,
    prompt_buckets,
    step_buckets,
    stop_width,
)
from jaxserve.runtime.engines.contract import KVCopy, KVLayout, KVPages, PrefillItem, SequenceKV, StageKV, WarmupSpec
from jaxserve.runtime.kv_pool import (
    model_caches,
    pool_pages,
    precompile_read,
    precompile_slice,
    precompile_write,
    slice_sequence,
    write_sequence,
)
from jaxserve.runtime.sampling import SamplingInputs, StepLogprobs, pad_rows, sample, sampling_inputs, token_logprobs
from models.attention import PagedKVCache
from models.config import ModelConfig
from models.sharding import ShardedModel

log = logging.getLogger("jaxserve.runtime.engines.model")  # the engine's log: its warm-up line reads as the engine's


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What `ModelEngine.warmup` compiled: one entry per program shape, and the wall time it took."""

    prefill_shapes: tuple[tuple[int, int], ...]  # (rows, tokens)
    step_shapes: tuple[tuple[int, int, int], ...]  # (rows, tokens, table width)
    seconds: float
    pages: KVPages | None = None  # the pool passed in, after the warm-up steps (which write nothing)
    multi_step_shapes: tuple[tuple[int, int, int], ...] = ()  # (rows, steps, table width) of decode_steps
    num_background: int = 0  # programs left to the background thread

    @property
    def num_programs(self) -> int:
        return len(self.prefill_shapes) + len(self.step_shapes) + len(self.multi_step_shapes)


class WarmupHost(Protocol):
    """What the warm-up drives of its engine (`engines/model.py`): the model and its layout, and the engine's own
    programs, run once on padding that writes no KV."""

    model: ShardedModel
    _cfg: ModelConfig
    _pad: int  # the filler token id
    _layout: KVLayout

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages: ...

    def _prefill_exact(self, items: Sequence[PrefillItem], b: int, t: int) -> None: ...

    def _precompile_row_kv(self, b: int, t: int) -> None: ...

    def _run_loop(
        self,
        tokens: np.ndarray,
        starts: np.ndarray,
        active: np.ndarray,
        remaining: np.ndarray,
        cache: PagedKVCache,
        tables: np.ndarray,
        inputs: SamplingInputs,
        stop_ids: np.ndarray,
        num_steps: int,
        greedy: bool,
        with_logprobs: bool = False,
    ) -> tuple[jax.Array, PagedKVCache, StepLogprobs | None]: ...


class ModelCompilation(BackgroundWarmup):
    """The warm-up of one `ModelEngine` (which owns it as `engine.compilation`): `warmup` runs or compiles what the
    plan names through the engine's own programs (`WarmupHost`), and the ready sets say what is compiled now."""

    def __init__(self, engine: WarmupHost) -> None:
        self._engine = engine
        self._init_background_warmup()  # shape covering and the background compile thread (background.py)
        # The KV copies compiled so far (read only while covering is on, `kv_copy_compiled`): inserts and gathers
        # by padded length, slices by (padded length of the KV, padded length cut out). Replaced, never mutated.
        self.ready_inserts: frozenset[int] = frozenset()
        self.ready_gathers: frozenset[int] = frozenset()
        self.ready_slices: frozenset[tuple[int, int]] = frozenset()
        # Row counts whose random sampler is compiled, and the pads (rows, up to rows) to one of them: a batch that
        # samples at random on a row count whose own sampler the background still compiles is sampled padded up
        # (`sampling_rows`; its rows' tokens are the same). Read only while covering is on. Replaced, never mutated.
        self.ready_random: frozenset[int] = frozenset()
        self.ready_pads: frozenset[tuple[int, int]] = frozenset()

    def warmup(self, spec: WarmupSpec, pages: KVPages | None = None) -> WarmupReport:
        """Compile (by running once, on padding that writes no KV) every shape the limits allow.

        Prefill: every (rows, tokens) bucket some batch can land in — the smallest batch of the bucket
        (rows/2 + 1 prompts, the longest tokens/2 + 1 long, the others one token each) fits the token
        cap — with rows up to `max_prefill_rows` (a prefill instance's buffer slots), plus a single
        prompt of every length bucket up to `max_seq_len` (a longer prompt than the cap runs alone).
        Decode side: also the insert of a pulled KV of every length bucket.
        Decode: row buckets up to `max_decode_batch` x table widths up to the blocks
        `max_seq_len` positions fill. Colocated prefill (`chunk_size`: the step's prompt-token budget,
        the chunk or the token cap): every (rows, tokens) bucket of prompt rows that budget allows, at
        every table width. `decode_steps > 1` (an instance's `decode_steps_per_call`): also the
        multi-step program (`decode_steps`) of every row bucket x table width, greedy and sampled
        (one pipeline stage only; with pp > 1 it runs single steps). Pass the instance's `pages` to
        warm on its pool (returned in the report); otherwise a pool of `num_blocks` is made and
        dropped. Sampling is warmed too (greedy and random). `logprobs`: also the logprob programs
        (each row bucket's log-softmax + top-k of prefill and step logits, and the multi-step program's
        logprob variant), so a first request asking for logprobs compiles nothing. Returns what was
        compiled and how long.

        `background`: compile before returning only the buckets that hold all others of at most twice the
        token budget (rows x tokens <= 2 x the prefill cap, or the chunk / decode batch: e.g. the widest decode
        step), and the rest on a background thread ahead of time (`ShardedModel.precompile_prefill` /
        `precompile_paged`, which read and write nothing): first the buckets nothing compiled holds (a long
        single prompt), then the others, smallest first. Until a bucket is compiled, its work runs padded up to
        the cheapest compiled bucket that holds it: slower for a while, never waiting on a compile — except
        work no compiled bucket holds yet (a prompt longer than twice the cap in the first moments), which
        compiles its own. Inserts and multi-step programs compile before returning either way.

        `prefix_prefill` (a prefix-caching prefill instance, with `decode=False` and its pool): the insert of
        every prompt length bucket (a batch with no cache hit is prefilled densely and written into the pool),
        the gather of every length bucket (`kv_pool.read_sequence`: a batch with a hit hands dense copies on),
        the slice of every shorter bucket out of each (`kv_pool.slice_sequence`: a decode instance holding a
        prefix pulls only the rest), and the prompt-row steps of `chunk_size` x `max_decode_batch` rows at the
        widest table only: a batch with a hit runs padded up to it (covering), so the row and token buckets are
        not multiplied by every table width (24 shapes at the default limits, not 6 x 24). With `background`
        caching works from the first request after ready: the inserts and gathers (small copy programs) and the
        prompt-row steps that hold all others of at most twice the budget compile before returning; the other
        steps and the slices on the background thread (ahead of time: `kv_pool.precompile_*`). Until one is in
        (`step_compiled`, `kv_copy_compiled`) the prefill instance takes a path without it: a hit batch runs
        padded up to a compiled step, a partial pull whose slice is not in moves the whole KV.

        Every prefill bucket compiles with its rows' KV programs (`_row_kv`, and the cut of a row to each shorter
        padded length), so taking a dense prefill's result apart compiles nothing either.
        After `hold_background_warmup()` the background thread waits for `start_background_warmup()`.
        """
        t0 = time.perf_counter()
        cfg = self._engine._cfg
        max_len = min(spec.max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        greedy = SamplingParams(temperature=0.0)
        rand = SamplingParams(temperature=1.0, top_p=0.9, logprobs=1 if spec.logprobs else None)
        # the plan (plan.py): every bucket the limits allow, and with `spec.background` those compiled first
        prefill_shapes = (
            prefill_buckets(max_len, cfg.max_position_embeddings, spec.max_batch_tokens, spec.max_prefill_rows)
            if spec.prefill
            else []
        )
        prefill_now = foreground_prefill(prefill_shapes, spec.max_batch_tokens) if spec.background else prefill_shapes
        # With `spec.background` the random sampler (~10x a greedy one's compile) compiles before returning for one row
        # count only, the most rows of a foreground bucket; the others' are padded up to it until theirs are in.
        random_rows: int | None = None
        direct_cuts: list[tuple[int, int]] = []
        if spec.background:  # compile only (running a long bucket costs a prefill of that length), a thread per core
            random_rows = max(b for b, _ in prefill_now) if prefill_now else None
            # each once, not per bucket; only each bucket to the next shorter one (a row is cut through them in
            # turn, `cut`), the direct cuts in the background
            cuts = sorted({pair for _, t in prefill_now for pair in self._chain_cuts(t)})
            direct_cuts = sorted({(t, n) for _, t in prefill_now for n in self._cuts(t)} - set(cuts))
            with ThreadPoolExecutor(min(len(prefill_now), os.cpu_count() or 1) or 1) as threads:
                compiles = [
                    threads.submit(
                        self._precompile_prefill, *x, rand, greedy, spec.logprobs, cuts=False, random_rows=random_rows
                    )
                    for x in prefill_now
                ]
                compiles += [threads.submit(self._precompile_slice, t, n) for t, n in cuts]
                for done in compiles:
                    done.result()
            for b, _ in prefill_now:
                self._publish_sampler(b, random_rows)
            self.ready_slices = self.ready_slices | frozenset(cuts)
        else:
            for b, t_pad in prefill_now:
                self._warm_prefill(b, t_pad, rand, greedy)
        self.ready_prefill = self.ready_prefill | frozenset(prefill_now)
        phases = {"prefill": time.perf_counter() - t0}  # seconds per part, for the log line
        step_shapes: list[tuple[int, int, int]] = []
        multi_step_shapes: list[tuple[int, int, int]] = []
        later_steps: list[tuple[int, int, int]] = []
        caches_like: list[PagedKVCache] | None = None
        if spec.decode or spec.chunk_size:
            caches = model_caches(pages or self._engine.init_pages(spec.num_blocks, spec.block_size))
            widths = powers_of_two(1, min(spec.num_blocks, -(-max_len // spec.block_size)))
            shapes = step_buckets(
                decode=spec.decode,
                chunk_size=spec.chunk_size,
                max_decode_batch=spec.max_decode_batch,
                widths=widths,
                prompt_widths=widths[-1:] if spec.prefix_prefill else widths,  # narrower ones run padded up to it
            )
            steps_now = shapes
            if spec.background:
                steps_now = foreground_steps(shapes, chunk_size=spec.chunk_size, max_decode_batch=spec.max_decode_batch)
            mark = time.perf_counter()
            if spec.background and steps_now:
                random_rows = max(random_rows or 0, *(b for b, _, _ in steps_now))
            for b, t, m in steps_now:
                if spec.prefix_prefill:  # compiled, not run: a prompt-row step at the widest table runs for seconds
                    self._engine.model.precompile_paged(b, t, m, [_abstract_cache(c) for c in caches])
                    logits = self._logits_like(b)
                else:
                    tokens = np.full((b, t), self._engine._pad, np.int32)
                    zeros = np.zeros(b, np.int32)  # length 0: nothing is written
                    logits, caches = self._engine.model.extend_paged(
                        tokens, zeros, zeros, caches, np.zeros((b, m), np.int32)
                    )
                self._warm_sampling(logits, rand, greedy, spec.logprobs, random_rows)
                self._publish_sampler(b, random_rows)
                step_shapes.append((b, t, m))
            self.ready_steps = self.ready_steps | frozenset(steps_now)
            later_steps = [x for x in shapes if x not in self.ready_steps]
            phases["steps"] = time.perf_counter() - mark
            mark = time.perf_counter()
            if spec.decode and spec.decode_steps > 1 and self._engine.model.pp == 1:
                for b in powers_of_two(2, spec.max_decode_batch):
                    for m in widths:
                        for all_greedy, with_lp in itertools.product((True, False), (False, True)[: 1 + spec.logprobs]):
                            caches[0] = self._engine._run_loop(
                                np.full(b, self._engine._pad, np.int32),
                                np.zeros(b, np.int32),
                                np.zeros(b, bool),  # no row active: nothing is written, the loop ends at once
                                np.zeros(b, np.int32),
                                caches[0],
                                np.zeros((b, m), np.int32),
                                sampling_inputs([], [], [], b),
                                np.full((b, stop_width(len(self._engine._cfg.eos_token_ids))), -1, np.int32),
                                spec.decode_steps,
                                all_greedy,
                                with_lp,
                            )[1]
                        multi_step_shapes.append((b, spec.decode_steps, m))
                jax.block_until_ready(caches[0].k)
            warmed = pool_pages(caches)
            caches_like = [_abstract_cache(c) for c in caches]  # for compiles that must not touch the pool
            phases["multi-step"] = time.perf_counter() - mark
            mark = time.perf_counter()
            if spec.decode:  # the insert of a pulled KV, one program per padded length (0 tokens: nothing written)
                layout = self._engine._layout
                for t_pad in prompt_buckets(max_len, cfg.max_position_embeddings):
                    kv = tuple(
                        StageKV(
                            k=jax.device_put(np.zeros((n, t_pad, cfg.kv_heads, cfg.head_dim), page.k.dtype), sharding),
                            v=jax.device_put(np.zeros((n, t_pad, cfg.kv_heads, cfg.head_dim), page.v.dtype), sharding),
                        )
                        for n, sharding, page in zip(layout.stage_layers, layout.shardings, warmed, strict=True)
                    )
                    warmed = write_sequence(warmed, kv, 0, [0])
                    self.ready_inserts = self.ready_inserts | {t_pad}
            pages = warmed if pages is not None else None
            phases["inserts"] = time.perf_counter() - mark
        # A prefix-caching prefill instance's KV copies on its own pool (`kv_copy_compiled` says which are in)
        slices: list[CompileJob] = []
        if spec.prefix_prefill and caches_like is not None:
            copies, slices = self._pool_copy_jobs(pool_pages(caches_like), max_len, skip=frozenset(direct_cuts))
            # What caching needs compiles before ready even with a background part (small copy programs): the
            # insert that keeps a prompt's KV in the pool and the gather that hands a hit on. Only the slices of a
            # partial pull wait for the background (until then a pull moves the whole KV).
            now = copies if spec.background else [*copies, *slices]
            slices = slices if spec.background else []
            mark = time.perf_counter()
            with ThreadPoolExecutor(os.cpu_count() or 1) as threads:  # XLA compiles outside the GIL: a core each
                for done in [threads.submit(job.compile) for job in now]:
                    done.result()
            for job in now:
                job.publish()
            phases["kv copies"] = time.perf_counter() - mark
        seconds = time.perf_counter() - t0
        sampler_jobs: list[CompileJob] = []
        later_prefill = [x for x in prefill_shapes if x not in self.ready_prefill]
        if spec.prefix_prefill:  # narrower prompt-row steps run padded up to the widest table
            self.cover = True
        if spec.background:
            self.cover = True
            # first the random samplers the foreground padded up: a lone prompt's or stream's bucket has its own then
            foreground_rows = sorted({x[0] for x in (*prefill_now, *step_shapes)} - self.ready_random)
            sampler_jobs = [
                CompileJob(
                    f"random sampler ({b} rows)",
                    partial(self._compile_random_sampler, b, rand, greedy, spec.logprobs),
                    partial(self._publish_sampler, b),
                )
                for b in foreground_rows
            ]
            prefill_jobs = [
                CompileJob(
                    f"prefill {x}",
                    partial(self._precompile_prefill, *x, rand, greedy, spec.logprobs),
                    partial(self._publish_prefill, *x),
                )
                for x in compile_order(later_prefill, self.ready_prefill)
            ]
            step_jobs = [
                CompileJob(
                    f"step {x}",
                    partial(self._precompile_step, *x, caches_like, rand, greedy, spec.logprobs),
                    partial(self._publish_step, *x),
                )
                for x in compile_order(later_steps, self.ready_steps)
                if caches_like is not None
            ]
            cut_jobs = [self._slice_job(t, n) for t, n in direct_cuts]
            unheld = sum(not is_held(x, self.ready_prefill) for x in later_prefill)
            # what no compiled bucket holds (a long prompt), the rows' direct cuts, the steps, the other prefill
            # buckets, and the partial pulls' slices (caching's inserts and gathers compiled before ready)
            jobs = [*sampler_jobs, *prefill_jobs[:unheld], *cut_jobs, *step_jobs, *prefill_jobs[unheld:], *slices]
            if jobs:
                self._start_background(jobs)
        num_later = (
            len(later_prefill) + len(later_steps) + len(slices) + len(sampler_jobs) + len(direct_cuts)
            if spec.background
            else 0
        )
        log.info(
            "warm-up compiled %d prefill, %d step and %d multi-step shapes in %.1f s (%s)%s",
            len(prefill_now), len(step_shapes), len(multi_step_shapes), seconds,
            ", ".join(f"{k} {v:.1f} s" for k, v in phases.items() if v >= 0.05),
            f" ({num_later} more programs compile in the background)" if spec.background else "",
        )  # fmt: skip
        return WarmupReport(tuple(prefill_now), tuple(step_shapes), seconds, pages, tuple(multi_step_shapes), num_later)

    # ---- warm-up pieces ----------------------------------------------------------
    def _warm_prefill(self, b: int, t_pad: int, rand: SamplingParams, greedy: SamplingParams) -> None:
        """Run the prefill bucket (b rows x t_pad tokens) on padding: each row's KV is cut to its own padded
        length, so the batch holds rows of every shorter bucket too; sampled and greedy both."""
        shorter = self._cuts(t_pad)
        others = shorter or [t_pad]
        batches = (
            [[t_pad]]
            if b == 1
            else [[t_pad] + [others[(k + j) % len(others)] for j in range(b - 1)] for k in range(0, len(others), b - 1)]
        )
        for k, lengths in enumerate(batches):
            items = [
                PrefillItem(f"warm{i}", (self._engine._pad,) * n, rand if i == 0 else greedy, 0)
                for i, n in enumerate(lengths)
            ]
            self._engine._prefill_exact(items, b, t_pad)
            if b > 1 and k == 0:  # the all-greedy sampler of this row count as well
                self._engine._prefill_exact([dataclasses.replace(it, sampling=greedy) for it in items], b, t_pad)
        self.ready_slices = self.ready_slices | {(t_pad, n) for n in shorter}  # the rows' cuts ran too
        self._publish_sampler(b)  # row 0 sampled at random

    def _precompile_prefill(
        self,
        b: int,
        t: int,
        rand: SamplingParams,
        greedy: SamplingParams,
        logprobs: bool,
        *,
        cuts: bool = True,
        random_rows: int | None = None,
    ) -> None:
        """Compile the prefill bucket (b, t) without running it, and what its result takes apart: each row's
        KV (`_row_kv`) and (`cuts`) its cut to every shorter padded length; run its samplers on placeholder logits
        (`_warm_sampling`: the random one padded up to `random_rows`, if given). Publishes nothing: the caller
        does (`_publish_prefill`, or `_publish_sampler` for the foreground's)."""
        self._engine.model.precompile_prefill(b, t)
        self._engine._precompile_row_kv(b, t)
        for n in self._cuts(t) if cuts else []:
            self._precompile_slice(t, n)
        self._warm_sampling(self._logits_like(b), rand, greedy, logprobs, random_rows)

    def _publish_prefill(self, b: int, t: int) -> None:
        """A background prefill job's programs are in: its rows' cuts and random sampler, then the bucket."""
        for n in self._cuts(t):
            self._publish("ready_slices", (t, n))
        self._publish_sampler(b)
        self._publish("ready_prefill", (b, t))

    def _pool_copy_jobs(
        self, pages: KVPages, max_len: int, skip: frozenset[tuple[int, int]] = frozenset()
    ) -> tuple[list[CompileJob], list[CompileJob]]:
        """A prefix-caching prefill instance's KV copies on a pool shaped like `pages` (shapes only), for every
        prompt length bucket: the insert of a densely prefilled prompt, the gather of a prompt's KV into a dense
        copy, and (second list) the slice of every shorter bucket out of it (a decode instance holding a prefix
        pulls only the rest; the rows' cuts of the prefill buckets are among them), but those in `skip` (queued
        already)."""
        buckets = prompt_buckets(max_len, self._engine._cfg.max_position_embeddings)
        copies: list[CompileJob] = []
        for t in buckets:
            kv = self._dense_like(t)
            copies.append(
                CompileJob(
                    f"insert {t}", partial(precompile_write, pages, kv), partial(self._publish, "ready_inserts", t)
                )
            )
            copies.append(
                CompileJob(
                    f"gather {t}", partial(precompile_read, pages, t), partial(self._publish, "ready_gathers", t)
                )
            )
        slices = [self._slice_job(t, n) for t in buckets for n in buckets if n <= t and (t, n) not in skip]
        return copies, slices

    def _slice_job(self, t: int, n: int) -> CompileJob:
        """The background job of the first `n` positions of a `t`-position dense KV (a row's cut, a pull's slice)."""
        return CompileJob(
            f"slice {t} -> {n}", partial(self._precompile_slice, t, n), partial(self._publish, "ready_slices", (t, n))
        )

    def _cuts(self, t: int) -> list[int]:
        """The shorter padded lengths a row of a t-token prefill bucket is cut to."""
        return [n for n in prompt_buckets(t, self._engine._cfg.max_position_embeddings) if n < t]

    def _chain_cuts(self, t: int) -> list[tuple[int, int]]:
        """Each padded length up to `t` cut to the next shorter one: (32, 16), (64, 32), ..., (t, t / 2)."""
        lengths = [*self._cuts(t), t]
        return list(zip(lengths[1:], lengths[:-1], strict=True))

    def cut(self, kv: SequenceKV, padded: int) -> SequenceKV:
        """A prefill row's dense KV cut to its first `padded` positions (its own padded length).

        In one program once that cut is compiled. Until then (a background warm-up still compiling it) through
        each shorter padded length in turn, a compiled program a step: the request path compiles nothing, and
        the foreground warm-up compiles one cut per length instead of one per pair. With no warm-up at all, in
        one program, compiled at first use.
        """
        t = kv[0].k.shape[1]
        while (t, padded) not in self.ready_slices:
            shorter = self._cuts(t)
            if not shorter or shorter[-1] < padded or (t, shorter[-1]) not in self.ready_slices:
                break
            kv, t = slice_sequence(kv, 0, shorter[-1]), shorter[-1]
        return kv if t == padded else slice_sequence(kv, 0, padded)

    def _precompile_slice(self, t: int, n: int) -> None:
        if (t, n) not in self.ready_slices:  # a prefill bucket's cuts compiled it already
            precompile_slice(self._dense_like(t), n)

    def _dense_like(self, t: int) -> SequenceKV:
        """Shapes and shardings of a dense KV of `t` positions as this engine's prefill hands it out."""
        cfg = self._engine._cfg
        return tuple(
            StageKV(k=jax.ShapeDtypeStruct((n, t, cfg.kv_heads, cfg.head_dim), self._engine.model.dtype, sharding=sharding),  # type: ignore[arg-type]
                    v=jax.ShapeDtypeStruct((n, t, cfg.kv_heads, cfg.head_dim), self._engine.model.dtype, sharding=sharding))  # type: ignore[arg-type]
            for n, sharding in zip(self._engine._layout.stage_layers, self._engine._layout.shardings, strict=True)
        )  # fmt: skip

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
        """Compile the paged step (b, t, m) over pools shaped like `caches` without running it, and run its
        samplers on placeholder logits (published by `_publish_step`)."""
        self._engine.model.precompile_paged(b, t, m, caches)
        self._warm_sampling(self._logits_like(b), rand, greedy, logprobs)

    def _publish_step(self, b: int, t: int, m: int) -> None:
        """A background step job's programs are in: its random sampler, then the bucket."""
        self._publish_sampler(b)
        self._publish("ready_steps", (b, t, m))

    def _logits_like(self, b: int) -> jax.Array:
        """Placeholder logits [b, V] where the model leaves its logits (replicated on the last stage)."""
        last = self._engine.model.pp - 1
        return jax.device_put(
            np.zeros((b, self._engine._cfg.vocab_size), np.float32), self._engine.model.replicated(last)
        )

    def _warm_sampling(
        self,
        logits: jax.Array,
        rand: SamplingParams,
        greedy: SamplingParams,
        logprobs: bool,
        random_rows: int | None = None,
    ) -> None:
        """Run the samplers of `logits`' row count once: greedy (and its logprobs), and random; with `random_rows`
        (another row count, whose random sampler is compiled beside this one) only the pad of these logits up to
        it: this row count's own random sampler is left to the background (`_compile_random_sampler`). Publishes
        nothing: the caller does (`_publish_sampler`)."""
        b = logits.shape[0]
        greedy_tokens = sample(logits, [greedy] * b, [0] * b, [0] * b)
        out = [token_logprobs(logits, greedy_tokens) if logprobs else greedy_tokens]
        if random_rows is not None and random_rows != b:
            out.append(pad_rows(logits, random_rows))
        else:
            sampled = sample(logits, [rand] * b, [0] * b, [0] * b)
            out.append(token_logprobs(logits, sampled) if logprobs else sampled)
        jax.block_until_ready(out)

    def _publish_sampler(self, b: int, random_rows: int | None = None) -> None:
        """`_warm_sampling` of `b` rows ran: its random sampler is in, or with `random_rows` (another row count)
        the pad of its logits up to that one."""
        if random_rows is not None and random_rows != b:
            self._publish("ready_pads", (b, random_rows))
        else:
            self._publish("ready_random", b)

    def _compile_random_sampler(self, b: int, rand: SamplingParams, greedy: SamplingParams, logprobs: bool) -> None:
        """A background job: the random sampler of `b` rows (a foreground bucket's, padded up until it is in)."""
        self._warm_sampling(self._logits_like(b), rand, greedy, logprobs)

    # ---- what the serving side reads -----------------------------------------------
    def kv_copy_compiled(self, kind: KVCopy, padded: int, from_padded: int = 0) -> bool:
        """Whether a KV copy of `padded` positions runs a compiled program now: "insert" (a dense KV into the
        pool), "gather" (out of the pool, `kv_pool.read_sequence`) or "slice" (out of a prefilled KV of
        `from_padded` positions, `kv_pool.slice_sequence`). Always, unless a background warm-up still compiles it."""
        if not self.cover:
            return True
        if kind == "insert":
            return padded in self.ready_inserts
        if kind == "gather":
            return padded in self.ready_gathers
        return (from_padded, padded) in self.ready_slices

    def sampling_rows(self, rows: int, params: Sequence[SamplingParams]) -> int:
        """The rows a batch's `rows` logits are sampled on: its own, unless some row samples at random while the
        background still compiles that sampler; then the compiled random sampler its logits are padded up to."""
        if not self.cover or rows in self.ready_random or all(p.is_greedy for p in params):
            return rows
        return min((r for b, r in self.ready_pads if b == rows and r in self.ready_random), default=rows)


def _abstract(a: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


def _abstract_cache(c: PagedKVCache) -> PagedKVCache:
    """A pool's shapes and shardings, for compiles that must not touch it."""
    return PagedKVCache(k=_abstract(c.k), v=_abstract(c.v), block_layout=c.block_layout)  # type: ignore[arg-type]
