"""The real engine: `Engine` over a `ShardedModel` (OPT or Llama-style) on one instance's tp x pp grid.

The engine is family-blind: the sharded model runs the forward passes, its stage's split module
(`ShardedModel.graphdefs` / `run_params`: graph static, state a pytree) is what the multi-step loop
traces, and KV sizes follow `cfg.kv_heads` (a K/V head split over tp, or replicated where tp is a
multiple of them).

Shapes are padded to buckets so XLA compiles a handful of programs, not one per
request: prefill batches to (next power of two rows) x (next power of two >= 16
tokens); paged steps to (power-of-two rows) x (1 token for pure decode steps, a
power of two >= 16 with prompt chunks) x (power-of-two block-table width).
Padding rows have length 0, so they write no KV. Compiling those programs before traffic (`warmup`) is the
engine's `compilation` (`ModelCompilation`, compilation/model_engine.py: it drives the programs here and says which
buckets are compiled, and covers those still compiling); this file is the engine's steps.

Pipeline parallelism: `ShardedModel` dispatches stage by stage without waiting,
so `prefill` and `decode_step` split a batch into `pp` micro-batches and
dispatch them all before reading any result: stage s+1 works on micro-batch k
while stage s starts micro-batch k+1 (JAX's asynchronous dispatch does the
overlap). `prefill_async` returns before reading anything back (`ModelPrefill`),
so a prefill instance puts the next batch into stage 0 as soon as stage 0 has
finished this one, while later stages still work on it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.core.plan import InstanceSpec
from jaxserve.core.request import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from jaxserve.runtime.compilation.model_engine import ModelCompilation, WarmupReport
from jaxserve.runtime.compilation.plan import MIN_PROMPT_BUCKET, stop_width
from jaxserve.runtime.engines.contract import (
    Engine,
    EngineCapabilities,
    KVCopy,
    KVLayout,
    KVPages,
    PrefilledSequence,
    PrefillItem,
    PrefillResult,
    RowLogprobs,
    SequenceKV,
    StageKV,
    StepBatch,
    StepRow,
    WarmupSpec,
    bucket,
    decode_steps_one_by_one,
    row_stops,
)
from jaxserve.runtime.guided import GuidedDecoder, GuidedRow, apply_bitmask, padded_bitmask
from jaxserve.runtime.kv_pool import write_sequence
from jaxserve.runtime.sampling import (
    SamplingInputs,
    StepLogprobs,
    argmax_rows,
    logprobs_rows,
    pad_rows,
    sample,
    sample_traced,
    sampling_inputs,
    token_logprobs,
    token_logprobs_traced,
)
from models.attention import KVCache, PagedKVCache
from models.config import ModelConfig, kv_heads_per_device, kv_heads_split
from models.decoder import stage_paged
from models.paged_attention import IMPLS, BlockLayout, Impl
from models.sharding import ShardedModel, sharded_class


class ModelEngine(Engine):
    """Prefill, insert and paged decode steps of a model (any `models` family) placed on one instance's devices."""

    capabilities = EngineCapabilities(
        prefill=True,
        decode=True,
        async_prefill=True,
        dense_insert=True,
        multi_step_decode=True,
        logprobs=True,
        bucket_warmup=True,
        memory_sized_pool=True,
    )

    def __init__(self, model: ShardedModel) -> None:
        self.model = model
        self.guided: GuidedDecoder | None = None  # the masks of guided requests (set by the controller)
        self._cfg = model.cfg
        self._pad = model.cfg.filler_token_id
        # A sequence's dense KV [L, T, kv_heads, D]: split over K/V heads, or replicated where tp is a multiple of them.
        self._kv_split = kv_heads_split(model.cfg, model.tp)
        heads_axis = "tp" if self._kv_split else None
        self._layout = KVLayout(
            stage_layers=tuple(st.num_layers for st in model.layout.stages),
            shardings=tuple(NamedSharding(m, PartitionSpec(None, None, heads_axis, None)) for m in model.meshes),
        )
        # what `warmup` compiled and the background compiles (compilation/model_engine.py)
        self.compilation = ModelCompilation(self)

    @classmethod
    def load(
        cls,
        source: str,
        devices: Sequence[jax.Device],
        tp: int = 1,
        pp: int = 1,
        dtype: str = "float32",
        quantization: str | None = None,
    ) -> ModelEngine:
        """`source` placed on `devices`; at weight precision `quantization` (`models.quantize.QUANTIZATIONS`; None:
        the source's own, a GGUF served as stored)."""
        from models.checkpoint import source_config
        from models.quantize import check_serving_dtype

        check_serving_dtype(dtype, devices[0].platform if devices else None)  # 16-bit on CPU: refused, with why
        sharded = sharded_class(source_config(source, dtype))
        return cls(sharded.load(source, tp=tp, pp=pp, devices=devices, dtype=dtype, quantization=quantization))

    @property
    def model_config(self) -> ModelConfig:
        return self._cfg

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(self.model.devices)

    def kv_layout(self) -> KVLayout:
        return self._layout

    # ---- KV pool sizing ------------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one KV block takes on the device that holds the most of it: K/V heads split over tp, or all
        of them where they are replicated (tp a multiple of a Llama-style model's K/V heads)."""
        cfg = self._cfg
        layers = max(self._layout.stage_layers)
        itemsize = np.dtype(self.model.dtype).itemsize
        return 2 * layers * block_size * kv_heads_per_device(cfg, self.model.tp) * cfg.head_dim * itemsize

    def kv_blocks_for_memory(self, block_size: int, memory_fraction: float = 0.9, max_blocks: int | None = None) -> int:
        """How many KV blocks fit in the memory the weights leave (vLLM's `gpu_memory_utilization`).

        On an accelerator: per device, `memory_fraction * bytes_limit - bytes_in_use` (weights and
        whatever else is already allocated) divided by `kv_block_bytes`; the smallest device wins.
        On CPU, where devices report no memory limit and host RAM is shared with everything else
        on the machine: `memory_fraction` of the host's *available* memory (MemAvailable, i.e.
        after the weights already loaded), at most `$JAXSERVE_CPU_KV_SPACE_GIB` (default 4 GiB, as
        vLLM's CPU backend reserves), split evenly over this process's CPU devices, each device
        holding its part of every block. `max_blocks` caps the result (a server passes what its
        batch limits can use); never below 1.
        """
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        per_block = self.kv_block_bytes(block_size)
        budgets = []
        for d in self.devices:
            stats = d.memory_stats() if d.platform != "cpu" else None
            if stats and "bytes_limit" in stats:
                budgets.append(memory_fraction * stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        if not budgets:  # CPU: each device's share of the host's available memory, against its part of a block
            host = min(memory_fraction * _host_available_bytes(), cpu_kv_space_bytes())
            budgets.append(host / max(1, len(jax.devices("cpu"))))
        blocks = int(max(0.0, min(budgets)) // per_block)
        if max_blocks is not None:
            blocks = min(blocks, max_blocks)
        return max(1, blocks)

    # ---- sampling --------------------------------------------------------------
    def _sample(
        self,
        logits: jax.Array,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        indices: Sequence[int],
        guided: Sequence[GuidedRow] = (),
    ) -> tuple[jax.Array, jax.Array]:
        """`sample` on `logits` [B, V] padded up to `sampling_rows` (each row's token depends only on its seed and
        index, so padding changes none), masked first by the grammar of each guided row (`guided`: one per row).
        -> tokens [B'] (the first B are the batch's) and the logits [B', V] drawn from (masked: logprobs are the
        masked distribution's, as vLLM reports them)."""
        rows = self.compilation.sampling_rows(logits.shape[0], params)
        if rows != logits.shape[0]:
            logits = pad_rows(logits, rows)  # [rows, V]: the added rows are sampled greedily and read by no one
        if any(p.guided is not None for p in params):
            if self.guided is None:
                raise RuntimeError(
                    "a guided request reached an engine with no GuidedDecoder (Controller.guided_decoder)"
                )
            mask = self.guided.bitmask(guided)  # [B, ceil(V / 32)] int32, on the host
            logits = apply_bitmask(logits, padded_bitmask(mask, rows))  # [rows, V]
        return sample(logits, params, seeds, indices), logits

    # ---- prefill ---------------------------------------------------------------
    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        return self.prefill_async(items).result()

    def prefill_async(self, items: Sequence[PrefillItem]) -> ModelPrefill:
        """`async_prefill`: dispatch the batch (its `pp` micro-batches, stage after stage) and return at
        once; nothing is read back until `result()`, so the next batch can enter stage 0 meanwhile."""
        num_micro = min(self.model.pp, len(items))
        micro = [[int(i) for i in g] for g in np.array_split(np.arange(len(items)), num_micro)]
        groups = [  # while the background compiles, a batch no compiled bucket holds runs as held sub-batches
            run
            for g in micro
            for run in self.compilation.held_runs(
                g, lambda ids: self._prefill_bucket([items[i] for i in ids]), self.compilation.ready_prefill
            )
        ]
        dispatched = [self._dispatch_prefill([items[i] for i in g]) for g in groups]  # no waiting in between
        return ModelPrefill(tuple(items), groups, dispatched, self._layout.shardings, self.compilation.cut)

    def _dispatch_prefill(
        self, items: Sequence[PrefillItem], shape: tuple[int, int] | None = None
    ) -> tuple[jax.Array, StepLogprobs | None, list[KVCache]]:
        """Dispatch one prefill batch padded to `shape` (default: its bucket, or the compiled bucket covering it)."""
        if shape is None:
            shape = cast(
                tuple[int, int], self.compilation.covering(self._prefill_bucket(items), self.compilation.ready_prefill)
            )
        b, t = shape
        tokens = np.full((b, t), self._pad, dtype=np.int32)
        lengths = np.ones(b, dtype=np.int32)  # padding rows: one pad token, ignored
        for r, item in enumerate(items):
            tokens[r, : len(item.token_ids)] = item.token_ids
            lengths[r] = len(item.token_ids)
        logits, caches = self.model.prefill(tokens, lengths)  # [B, V]
        guided = [GuidedRow(i.request_id, i.sampling.guided, i.token_ids, 0) for i in items]
        first, logits = self._sample(
            logits, [i.sampling for i in items], [i.seed for i in items], [0] * len(items), guided
        )
        lp = token_logprobs(logits, first) if any(i.sampling.logprobs is not None for i in items) else None
        return first, lp, caches

    def _prefill_exact(self, items: Sequence[PrefillItem], b: int, t: int) -> None:
        """Prefill `items` padded to exactly (b, t), and read the result back (its per-row KV slices compile too):
        how the warm-up runs a bucket."""
        dispatched = self._dispatch_prefill(items, shape=(b, t))
        ModelPrefill(
            tuple(items), [list(range(len(items)))], [dispatched], self._layout.shardings, self.compilation.cut
        ).result()

    def _precompile_row_kv(self, b: int, t: int) -> None:
        """Compile, without running it, `_row_kv` of every stage of a (b, t) prefill batch's KV: taking the
        batch's result apart (`ModelPrefill.result`) then compiles nothing."""
        row = jax.ShapeDtypeStruct((), jnp.int32)
        for s, (num_layers, sharding) in enumerate(zip(self._layout.stage_layers, self._layout.shardings, strict=True)):
            shape = (num_layers, b, t, self._cfg.kv_heads, self._cfg.head_dim)  # [L_s, B, T, H, D]
            cache = jax.ShapeDtypeStruct(shape, self.model.dtype, sharding=self.model.kv_sharding(s))
            _row_kv.lower(cache, cache, row, sharding=sharding).compile()

    def _prefill_bucket(self, items: Sequence[PrefillItem]) -> tuple[int, int]:
        """The (rows, tokens) bucket of a prefill batch of `items`, before covering."""
        longest = max(len(i.token_ids) for i in items)
        return bucket(len(items)), bucket(longest, MIN_PROMPT_BUCKET, self._cfg.max_position_embeddings)

    # ---- decode side -----------------------------------------------------------
    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        return tuple(self.model.init_paged_caches(num_blocks, block_size))  # in the model's block_layout

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        return write_sequence(pages, kv, num_tokens, block_table)

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        """One paged step over `batch`; decode rows and prompt chunks run as separate sub-batches.

        A mixed (chunked-prefill) step would otherwise pad every one-token decode row to the
        chunk's length: 15 decodes beside a 256-token chunk cost 25x the two parts alone. Split,
        each part costs what its tokens cost, and both are dispatched before either is read.
        """
        tokens, _, pages = self._step(batch, pages, with_logprobs=False)
        return tokens, pages

    def decode_step_logprobs(
        self, batch: StepBatch, pages: KVPages
    ) -> tuple[list[int], list[TokenLogprobs | None], KVPages]:
        """`decode_step`, and the logprobs of each row that asks (`logprobs`); a sub-batch where no
        row asks computes none."""
        return self._step(batch, pages, with_logprobs=True)

    def _step(
        self, batch: StepBatch, pages: KVPages, *, with_logprobs: bool
    ) -> tuple[list[int], list[TokenLogprobs | None], KVPages]:
        rows = batch.rows
        caches = list(pages)
        block_size = pages[0].block_size
        decode_ids = [i for i, r in enumerate(rows) if len(r.token_ids) == 1]
        chunk_ids = [i for i, r in enumerate(rows) if len(r.token_ids) != 1]
        sampled: list[tuple[list[int], jax.Array, StepLogprobs | None]] = []
        for ids in (chunk_ids, decode_ids):
            if not ids:
                continue
            num_micro = min(self.model.pp, len(ids))
            # With pp > 1 the rows go through the stages as micro-batches, all dispatched before any
            # result is read; each micro-batch threads the (donated) caches on to the next.
            micro = [[ids[j] for j in g] for g in np.array_split(np.arange(len(ids)), num_micro)]
            groups = [  # while the background compiles, rows no compiled bucket holds run as held sub-batches
                run
                for g in micro
                for run in self.compilation.held_runs(
                    g,
                    lambda ids: self._natural_step_shape([rows[i] for i in ids], block_size),
                    self.compilation.ready_steps,
                )
            ]
            for g in groups:
                part = [rows[i] for i in g]
                asks = with_logprobs and any(r.sampling.logprobs is not None for r in part)
                tokens, lp, caches = self._dispatch_step(part, caches, block_size, asks)
                sampled.append((g, tokens, lp))
        out = [0] * len(rows)
        out_lp: list[TokenLogprobs | None] = [None] * len(rows)
        for g, tokens, lp in sampled:
            for i, tok in zip(g, np.asarray(tokens)[: len(g)], strict=True):
                out[i] = int(tok)
            for i, row_lp in zip(g, _host_logprobs(lp, [rows[i].sampling for i in g]), strict=True):
                out_lp[i] = row_lp
        return out, out_lp, tuple(caches)

    def decode_steps(self, batch: StepBatch, pages: KVPages, num_steps: int) -> tuple[list[list[int]], KVPages]:
        """Up to `num_steps` decode steps of one-token rows in one dispatch (multi-step decoding).

        Sampling and stop checks run on the device (a `lax.while_loop` that ends when every row has
        stopped); the host sees the tokens once, after the last step. Row r continues from
        `token_ids[0]` at `start_position`, and stops after its EOS (unless `ignore_eos`), a stop
        token id, or `sampling.max_tokens - sample_index` tokens; its list ends there. Its block table
        must cover the positions it may reach. Tokens equal `num_steps` calls of `decode_step` (same
        seeds and indices: step k samples index `sample_index + k`). With pp > 1, or a guided row: single steps.
        """
        lists, _, pages = self._steps(batch, pages, num_steps, with_logprobs=False)
        return lists, pages

    def decode_steps_logprobs(
        self, batch: StepBatch, pages: KVPages, num_steps: int
    ) -> tuple[list[list[int]], list[RowLogprobs], KVPages]:
        """`decode_steps`, and one `TokenLogprobs` per token of each row that asks (`multi_step_decode` + `logprobs`):
        the loop program's logprob variant computes them on the device, step by step, with the tokens."""
        return self._steps(batch, pages, num_steps, with_logprobs=True)

    def _steps(
        self, batch: StepBatch, pages: KVPages, num_steps: int, *, with_logprobs: bool
    ) -> tuple[list[list[int]], list[RowLogprobs], KVPages]:
        """`decode_steps` / `decode_steps_logprobs` (logprobs only for rows that ask, only `with_logprobs`)."""
        rows = batch.rows
        if any(len(r.token_ids) != 1 or r.is_prompt for r in rows):
            raise ValueError("multi-step decoding takes one-token (decode) rows only")
        # pp > 1 dispatches stage by stage; a guided row's next mask needs this step's token on the host
        if self.model.pp != 1 or any(r.sampling.guided is not None for r in rows):
            if with_logprobs:
                return decode_steps_one_by_one(self, batch, pages, num_steps)
            lists, _, pages = decode_steps_one_by_one(self, StepBatch(_without_logprobs(rows)), pages, num_steps)
            return lists, [None] * len(rows), pages
        block_size = pages[0].block_size
        b = bucket(len(rows), 2)
        m = bucket(max(min(len(r.block_table), -(-(r.start_position + num_steps) // block_size)) for r in rows))
        tokens = np.full(b, self._pad, np.int32)
        starts = np.zeros(b, np.int32)
        active = np.zeros(b, bool)
        remaining = np.zeros(b, np.int32)
        tables = np.zeros((b, m), np.int32)
        stops = [row_stops(r, self._cfg.eos_token_ids) for r in rows]
        stop_ids = np.full((b, stop_width(len(self._cfg.eos_token_ids))), -1, np.int32)
        for i, r in enumerate(rows):
            tokens[i], starts[i], active[i] = r.token_ids[0], r.start_position, True
            remaining[i] = r.sampling.max_tokens - r.sample_index
            table = r.block_table[:m]
            tables[i, : len(table)] = table
            stop_ids[i, : len(stops[i])] = stops[i]
        inputs = sampling_inputs([r.sampling for r in rows], [r.seed for r in rows], [r.sample_index for r in rows], b)
        greedy = all(r.sampling.is_greedy for r in rows)
        asks = with_logprobs and any(r.sampling.logprobs is not None for r in rows)
        cache = pages[0]
        out, cache, lp = self._run_loop(
            tokens, starts, active, remaining, cache, tables, inputs, stop_ids, num_steps, greedy, asks
        )
        host = np.asarray(out)  # [B, N]
        result = []
        for i in range(len(rows)):
            toks = host[i]
            result.append([int(t) for t in toks[toks >= 0]])
        row_lps: list[RowLogprobs] = [None] * len(rows)
        if lp is not None:
            chosen, top_ids, top_lp = (np.asarray(a) for a in lp)  # [B, N], [B, N, K], [B, N, K]
            for i, r in enumerate(rows):
                if r.sampling.logprobs is None:
                    continue
                n = len(result[i])
                per_step = logprobs_rows(chosen[i, :n], top_ids[i, :n], top_lp[i, :n], [r.sampling] * n)
                row_lps[i] = tuple(x for x in per_step if x is not None)
        return result, row_lps, (cache,)

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
    ) -> tuple[jax.Array, PagedKVCache, StepLogprobs | None]:
        put = self.model.replicated(0)
        return _decode_loop(  # type: ignore[no-any-return]
            self.model.run_params[0],
            *(jax.device_put(a, put) for a in (tokens, starts, active, remaining)),
            cache,
            jax.device_put(tables, put),
            SamplingInputs(*(jax.device_put(a, put) for a in inputs)),
            jax.device_put(stop_ids, put),
            graphdef=self.model.graphdefs[0],
            num_steps=num_steps,
            greedy=greedy,
            logprobs=with_logprobs,
            attention=self.model.stage_attention(0),
        )

    # ---- the warm-up: the engine's `compilation` (compilation/model_engine.py) ----------------------------------
    def warmup(self, spec: WarmupSpec, pages: KVPages | None = None) -> WarmupReport:
        """Compile every padded shape `spec`'s limits allow (`ModelCompilation.warmup`)."""
        return self.compilation.warmup(spec, pages)

    def kv_copy_compiled(self, kind: KVCopy, padded: int, from_padded: int = 0) -> bool:
        return self.compilation.kv_copy_compiled(kind, padded, from_padded)

    def hold_background_warmup(self) -> None:
        self.compilation.hold_background_warmup()

    def start_background_warmup(self) -> None:
        self.compilation.start_background_warmup()

    def stop_background_warmup(self, timeout_s: float = 60.0) -> None:
        self.compilation.stop_background_warmup(timeout_s)

    def background_warmup_done(self, timeout_s: float | None = None) -> bool:
        return self.compilation.background_warmup_done(timeout_s)

    def step_compiled(self, rows: Sequence[StepRow], block_size: int) -> bool:
        """Whether a step of `rows` runs a compiled bucket now (always, unless a background warm-up is still
        compiling the bucket that would hold it)."""
        if not self.compilation.cover:
            return True
        runs = self.compilation.held_runs(
            range(len(rows)),
            lambda ids: self._natural_step_shape([rows[i] for i in ids], block_size),
            self.compilation.ready_steps,
        )
        return all(self.step_shape([rows[i] for i in run], block_size) in self.compilation.ready_steps for run in runs)

    def step_shape(self, rows: Sequence[StepRow], block_size: int) -> tuple[int, int, int]:
        """The padded (rows, tokens, table width) a sub-batch of `rows` compiles to.

        The table width follows the blocks the rows have *filled* (positions < start + tokens),
        not the blocks they reserved for their whole output: attention reads `width * block_size`
        positions per row, so a reservation-wide table made the step's cost grow with `max_tokens`.
        """
        return cast(
            tuple[int, int, int],
            self.compilation.covering(self._natural_step_shape(rows, block_size), self.compilation.ready_steps),
        )

    @staticmethod
    def _natural_step_shape(rows: Sequence[StepRow], block_size: int) -> tuple[int, int, int]:
        """`step_shape` before covering: the step's own bucket."""
        longest = max(len(r.token_ids) for r in rows)
        # A one-row one-token step compiles (XLA CPU) to a path ~2x slower than two rows; pad it to two.
        b = bucket(len(rows), 2 if longest == 1 else 1)
        t = 1 if longest == 1 else bucket(longest, MIN_PROMPT_BUCKET)
        return b, t, bucket(max(filled_blocks(r, block_size) for r in rows))

    def _dispatch_step(
        self, rows: Sequence[StepRow], caches: list[PagedKVCache], block_size: int, with_logprobs: bool = False
    ) -> tuple[jax.Array, StepLogprobs | None, list[PagedKVCache]]:
        b, t, m = self.step_shape(rows, block_size)
        tokens = np.full((b, t), self._pad, dtype=np.int32)
        starts = np.zeros(b, dtype=np.int32)
        lengths = np.zeros(b, dtype=np.int32)  # padding rows: length 0, nothing written
        tables = np.zeros((b, m), dtype=np.int32)
        for i, r in enumerate(rows):
            filled = r.block_table[: filled_blocks(r, block_size)]
            tokens[i, : len(r.token_ids)] = r.token_ids
            starts[i] = r.start_position
            lengths[i] = len(r.token_ids)
            tables[i, : len(filled)] = filled
        logits, caches = self.model.extend_paged(tokens, starts, lengths, caches, tables)  # [B, V]
        guided = [GuidedRow(r.request_id, r.sampling.guided, r.token_ids, r.sample_index) for r in rows]
        sampled, logits = self._sample(
            logits, [r.sampling for r in rows], [r.seed for r in rows], [r.sample_index for r in rows], guided
        )
        return sampled, token_logprobs(logits, sampled) if with_logprobs else None, caches


@partial(
    jax.jit, static_argnames=("graphdef", "num_steps", "greedy", "logprobs", "attention"), donate_argnames=("cache",)
)
def _decode_loop(
    state: dict[Any, Any],  # the stage's module state (`ShardedModel.run_params[0]`)
    tokens: jax.Array,  # [B] the last token of each row
    starts: jax.Array,  # [B] its position
    active: jax.Array,  # [B] bool
    remaining: jax.Array,  # [B] tokens each row may still produce
    cache: PagedKVCache,
    tables: jax.Array,  # [B, M]
    inputs: SamplingInputs,
    stop_ids: jax.Array,  # [B, K] (-1 padding)
    *,
    graphdef: nnx.GraphDef[Any],
    num_steps: int,
    greedy: bool,
    logprobs: bool = False,
    attention: Impl = "xla",
) -> tuple[jax.Array, PagedKVCache, StepLogprobs | None]:
    """Up to `num_steps` paged decode steps in one program: sample on device, stop rows on device.

    A row stops after a stop token or its last allowed token; a stopped row writes no KV and
    reports -1 for the remaining steps; the loop ends once no row is active. Returns tokens
    [B, num_steps], the pool, and with `logprobs` (a separate program) each step's sampled-token
    logprob [B, num_steps] and top `MAX_LOGPROBS` [B, num_steps, K] (else None).
    """

    model = nnx.merge(graphdef, state)  # the one-stage model (trace-time only)
    cfg = model.cfg

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        k, _, _, act, *_ = carry
        return (k < num_steps) & jnp.any(act)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        k, tok, pos, act, rem, c, out, lp = carry
        lengths = act.astype(jnp.int32)
        logits, c = stage_paged(model, tok[:, None], pos, lengths, c, tables, all_logits=False, attention=attention)
        new = argmax_rows(logits) if greedy else sample_traced(logits, inputs, k)
        out = out.at[:, k].set(jnp.where(act, new, -1))
        if logprobs:
            step = token_logprobs_traced(logits, new)
            lp = StepLogprobs(*(whole.at[:, k].set(part) for whole, part in zip(lp, step, strict=True)))
        stop = jnp.any(new[:, None] == stop_ids, axis=-1) | (rem <= 1)
        return k + 1, new, pos + 1, act & ~stop, rem - 1, c, out, lp

    b = tokens.shape[0]
    out = jnp.full((b, num_steps), -1, jnp.int32)
    lp0 = None
    if logprobs:
        top = min(MAX_LOGPROBS, cfg.vocab_size)
        lp0 = StepLogprobs(
            jnp.zeros((b, num_steps), jnp.float32),
            jnp.zeros((b, num_steps, top), jnp.int32),
            jnp.zeros((b, num_steps, top), jnp.float32),
        )
    carry = (jnp.int32(0), tokens, starts, active, remaining, cache, out, lp0)
    *_, cache, out, lp = jax.lax.while_loop(cond, body, carry)
    return out, cache, lp


class ModelPrefill:
    """A dispatched `ModelEngine` prefill batch (`PrefillHandle`): device arrays, read back only by `result()`."""

    def __init__(
        self,
        items: tuple[PrefillItem, ...],
        groups: list[list[int]],
        dispatched: list[tuple[jax.Array, StepLogprobs | None, list[KVCache]]],
        shardings: Sequence[NamedSharding],  # each stage's dense-KV sharding (`KVLayout.shardings`)
        cut: Callable[[SequenceKV, int], SequenceKV],  # a row's KV to its padded length (`ModelCompilation.cut`)
    ) -> None:
        self._items, self._groups, self._dispatched, self._shardings = items, groups, dispatched, shardings
        self._cut = cut

    def wait_first_stage(self) -> None:
        """Stage 0 is free once it has written every micro-batch's KV (its program's outputs)."""
        jax.block_until_ready([caches[0] for _, _, caches in self._dispatched])

    def result(self) -> PrefillResult:
        items = self._items
        out: list[PrefilledSequence] = []
        for g, (tokens, lp, caches) in zip(self._groups, self._dispatched, strict=True):
            first = np.asarray(tokens)
            firsts_lp = _host_logprobs(lp, [items[i].sampling for i in g])
            for row, i in enumerate(g):
                n = len(items[i].token_ids)
                # [L_s, T, H, D] each, cut to the row's own padded length (programs the warm-up compiled)
                kv: SequenceKV = tuple(
                    _row_kv(c.k, c.v, np.int32(row), sharding=sh) for c, sh in zip(caches, self._shardings, strict=True)
                )
                padded = bucket(n, MIN_PROMPT_BUCKET)
                if padded < kv[0].k.shape[1]:
                    kv = self._cut(kv, padded)
                out.append(PrefilledSequence(items[i].request_id, int(first[row]), n, kv, firsts_lp[row]))
        return PrefillResult(tuple(out))


@partial(jax.jit, static_argnames=("sharding",))
def _row_kv(k: jax.Array, v: jax.Array, row: jax.Array, *, sharding: NamedSharding) -> StageKV:
    """Row `row` of a prefill batch's KV [L_s, B, T, H, D] -> [L_s, T, H, D], in the dense-KV `sharding`."""
    pick = partial(jax.lax.dynamic_index_in_dim, index=row, axis=1, keepdims=False)
    return StageKV(
        k=jax.lax.with_sharding_constraint(pick(k), sharding), v=jax.lax.with_sharding_constraint(pick(v), sharding)
    )


def _host_logprobs(lp: StepLogprobs | None, params: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
    """A dispatched step's logprobs read back (one transfer) for the rows of `params`; all None without any."""
    if lp is None:
        return [None] * len(params)
    chosen, top_ids, top_lp = (np.asarray(a) for a in lp)
    return logprobs_rows(chosen, top_ids, top_lp, params)


def _without_logprobs(rows: Sequence[StepRow]) -> tuple[StepRow, ...]:
    return tuple(
        r
        if r.sampling.logprobs is None
        else dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, logprobs=None))
        for r in rows
    )


CPU_KV_SPACE_GIB = 4.0  # the KV pools' share of host memory on CPU, unless $JAXSERVE_CPU_KV_SPACE_GIB says


def cpu_kv_space_bytes() -> float:
    """The most host memory a CPU process's KV pools take together (`$JAXSERVE_CPU_KV_SPACE_GIB`, default 4 GiB):
    host RAM is shared with the weights, the OS and everything else on the machine, and zeroing a pool of
    most of it takes many seconds of start-up."""
    raw = os.environ.get("JAXSERVE_CPU_KV_SPACE_GIB")
    try:
        gib = float(raw) if raw else CPU_KV_SPACE_GIB
    except ValueError:
        raise ValueError(f"JAXSERVE_CPU_KV_SPACE_GIB must be a number of GiB, got {raw!r}") from None
    if gib <= 0:
        raise ValueError(f"JAXSERVE_CPU_KV_SPACE_GIB must be > 0, got {raw!r}")
    return gib * 2**30


def _host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux); else free physical pages; else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def filled_blocks(row: StepRow, block_size: int) -> int:
    """Blocks of `row.block_table` that hold a position after this step: ceil((start + tokens) / block_size)."""
    return min(len(row.block_table), -(-(row.start_position + len(row.token_ids)) // block_size))


def model_engine_factory(
    source: str,
    dtype: str = "float32",
    block_layout: BlockLayout | None = None,
    attention_impl: Impl | None = None,
    quantization: str | None = None,
) -> Callable[[InstanceSpec, Sequence[jax.Device]], ModelEngine]:
    """An engine factory: every instance loads `source` straight into its own sharding, at its plan's
    precision (`InstanceSpec.quantization`) if the plan names one, else at `quantization` (None: the source's).

    `attention_impl` sets every instance's paged decode attention (`models.paged_attention`; default:
    `default_impl()` for the backend), `block_layout` its KV pool layout (default: the one that impl
    reads best, `ShardedModel.block_layout`). `source` is any model source (`models.checkpoint.source_config`):
    the family's sharded model is chosen from its config.
    """
    if attention_impl is not None and attention_impl not in IMPLS:
        raise ValueError(f"unknown paged attention implementation {attention_impl!r}; one of {', '.join(IMPLS)}")

    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> ModelEngine:
        precision = spec.quantization if spec.quantization is not None else quantization
        engine = ModelEngine.load(source, devices, tp=spec.tp, pp=spec.pp, dtype=dtype, quantization=precision)
        if attention_impl is not None:  # before the first step compiles
            engine.model.attention_impl = attention_impl
        if block_layout is not None:
            engine.model.block_layout = block_layout
        return engine

    return factory
