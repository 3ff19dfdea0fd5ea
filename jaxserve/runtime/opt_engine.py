"""The real engine: `Engine` over a `ShardedOPT` on one instance's tp x pp grid.

Shapes are padded to buckets so XLA compiles a handful of programs, not one per
request: prefill batches to (next power of two rows) x (next power of two >= 16
tokens); paged steps to (power-of-two rows) x (1 token for pure decode steps, a
power of two >= 16 with prompt chunks) x (power-of-two block-table width).
Padding rows have length 0, so they write no KV.

Pipeline parallelism: `ShardedOPT` dispatches stage by stage without waiting,
so `prefill` and `decode_step` split a batch into `pp` micro-batches and
dispatch them all before reading any result: stage s+1 works on micro-batch k
while stage s starts micro-batch k+1 (JAX's asynchronous dispatch does the
overlap).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.plan import InstanceSpec
from jaxserve.runtime.engine import (
    KVLayout,
    KVPages,
    PrefilledSequence,
    PrefillItem,
    PrefillResult,
    SequenceKV,
    StageKV,
    StagePages,
    StepBatch,
    StepRow,
    bucket,
)
from jaxserve.runtime.kv_pool import write_sequence
from jaxserve.runtime.sampling import sample
from models.config import OPTConfig
from models.opt import KVCache, PagedKVCache
from models.sharding import ShardedOPT

MIN_PROMPT_BUCKET = 16


class OPTEngine:
    """Prefill, insert and paged decode steps of an OPT model placed on one instance's devices."""

    def __init__(self, model: ShardedOPT) -> None:
        self.model = model
        self._cfg = model.cfg
        self._layout = KVLayout(
            stage_layers=tuple(st.num_layers for st in model.layout.stages),
            shardings=tuple(NamedSharding(m, PartitionSpec(None, None, "tp", None)) for m in model.meshes),
        )

    @classmethod
    def load(
        cls, source: str, devices: Sequence[jax.Device], tp: int = 1, pp: int = 1, dtype: str = "float32"
    ) -> OPTEngine:
        return cls(ShardedOPT.load(source, tp=tp, pp=pp, devices=devices, dtype=dtype))

    @property
    def model_config(self) -> OPTConfig:
        return self._cfg

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(self.model.devices)

    def kv_layout(self) -> KVLayout:
        return self._layout

    # ---- prefill ---------------------------------------------------------------
    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        num_micro = min(self.model.pp, len(items))
        groups = [list(g) for g in np.array_split(np.arange(len(items)), num_micro)] if num_micro > 1 else []
        if not groups:
            groups = [list(range(len(items)))]
        dispatched = [self._dispatch_prefill([items[i] for i in g]) for g in groups]  # no waiting in between
        out: list[PrefilledSequence] = []
        for g, (tokens, caches) in zip(groups, dispatched, strict=True):
            first = np.asarray(tokens)
            for row, i in enumerate(g):
                n = len(items[i].token_ids)
                padded = bucket(n, MIN_PROMPT_BUCKET)
                kv = tuple(StageKV(k=c.k[:, row, :padded], v=c.v[:, row, :padded]) for c in caches)  # [L_s, T, H, D]
                out.append(PrefilledSequence(items[i].request_id, int(first[row]), n, kv))
        return PrefillResult(tuple(out))

    def _dispatch_prefill(self, items: Sequence[PrefillItem]) -> tuple[jax.Array, list[KVCache]]:
        b = bucket(len(items))
        t = bucket(max(len(i.token_ids) for i in items), MIN_PROMPT_BUCKET, self._cfg.max_position_embeddings)
        tokens = np.full((b, t), self._cfg.pad_token_id, dtype=np.int32)
        lengths = np.ones(b, dtype=np.int32)  # padding rows: one pad token, ignored
        for r, item in enumerate(items):
            tokens[r, : len(item.token_ids)] = item.token_ids
            lengths[r] = len(item.token_ids)
        logits, caches = self.model.prefill(tokens, lengths)  # [B, V]
        first = sample(logits, [i.sampling for i in items], [i.seed for i in items], [0] * len(items))
        return first, caches

    # ---- decode side -----------------------------------------------------------
    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        return tuple(StagePages(k=c.k, v=c.v) for c in self.model.init_paged_caches(num_blocks, block_size))

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        return write_sequence(pages, kv, num_tokens, block_table)

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        rows = batch.rows
        caches = [PagedKVCache(k=p.k, v=p.v) for p in pages]
        num_micro = min(self.model.pp, len(rows))
        # With pp > 1 the rows go through the stages as micro-batches, all dispatched before any
        # result is read; each micro-batch threads the (donated) caches on to the next.
        groups = [list(g) for g in np.array_split(np.arange(len(rows)), num_micro)] if num_micro > 1 else []
        sampled = []
        for g in groups or [list(range(len(rows)))]:
            tokens, caches = self._dispatch_step([rows[i] for i in g], caches)
            sampled.append((g, tokens))
        out = [0] * len(rows)
        for g, tokens in sampled:
            for i, tok in zip(g, np.asarray(tokens)[: len(g)], strict=True):
                out[i] = int(tok)
        return out, tuple(StagePages(k=c.k, v=c.v) for c in caches)

    def _dispatch_step(
        self, rows: Sequence[StepRow], caches: list[PagedKVCache]
    ) -> tuple[jax.Array, list[PagedKVCache]]:
        longest = max(len(r.token_ids) for r in rows)
        # A one-row one-token step compiles (XLA CPU) to a path ~2x slower than two rows; pad it to two.
        b = bucket(len(rows), 2 if longest == 1 else 1)
        t = 1 if longest == 1 else bucket(longest, MIN_PROMPT_BUCKET)
        m = bucket(max(len(r.block_table) for r in rows), 4)
        tokens = np.full((b, t), self._cfg.pad_token_id, dtype=np.int32)
        starts = np.zeros(b, dtype=np.int32)
        lengths = np.zeros(b, dtype=np.int32)  # padding rows: length 0, nothing written
        tables = np.zeros((b, m), dtype=np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.token_ids)] = r.token_ids
            starts[i] = r.start_position
            lengths[i] = len(r.token_ids)
            tables[i, : len(r.block_table)] = r.block_table
        logits, caches = self.model.extend_paged(tokens, starts, lengths, caches, tables)  # [B, V]
        sampled = sample(logits, [r.sampling for r in rows], [r.seed for r in rows], [r.sample_index for r in rows])
        return sampled, caches


def opt_engine_factory(
    source: str, dtype: str = "float32"
) -> Callable[[InstanceSpec, Sequence[jax.Device]], OPTEngine]:
    """An engine factory: every instance loads `source` straight into its own sharding."""

    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> OPTEngine:
        return OPTEngine.load(source, devices, tp=spec.tp, pp=spec.pp, dtype=dtype)

    return factory
