"""A hand-computable engine: integer arithmetic instead of a model, real KV arrays on real meshes.

Every output token is `(a * last + b * S + c * n) % vocab_size`, where `last`
is the row's last input token, `S` the sum of every token id in the context
and `n` the context length (the new tokens included). Prefill (and colocated
prompt chunks) use `PREFILL_WEIGHTS`, decode uses `DECODE_WEIGHTS`, so a test
knows which side produced a token (see `reference_tokens`).

The KV is real: K of token t at position p in global layer l, head h is
`t * (l + 1) * (h + 1)` (V is `p + 1`), laid out `[L_s, T, H, 1]` per
pipeline stage with heads sharded over `tp`, exactly like the model's. Decode
recovers `S` by reading the paged pool through each row's block table, so a
block-table, transfer or layout bug changes the tokens. Sampling parameters
are ignored (the arithmetic is the "greedy" choice).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.plan import InstanceSpec
from jaxserve.runtime.engines.contract import (
    Engine,
    EngineCapabilities,
    KVLayout,
    KVPages,
    PrefilledSequence,
    PrefillItem,
    PrefillResult,
    SequenceKV,
    StageKV,
    StagePages,
    StepBatch,
    bucket,
)
from jaxserve.runtime.engines.stage_grid import StageGrid
from jaxserve.runtime.kv_pool import dense_sharding, write_sequence
from models.config import ModelConfig

PREFILL_WEIGHTS = (3, 1, 7)
DECODE_WEIGHTS = (5, 2, 11)


def fake_token(weights: tuple[int, int, int], context: Sequence[int], vocab_size: int) -> int:
    a, b, c = weights
    return (a * context[-1] + b * sum(context) + c * len(context)) % vocab_size


def reference_tokens(prompt: Sequence[int], num_tokens: int, vocab_size: int) -> list[int]:
    """What the fake engine outputs for `prompt` (no stop tokens): one prefill token, then decode tokens."""
    context = list(prompt)
    out = [fake_token(PREFILL_WEIGHTS, context, vocab_size)]
    while len(out) < num_tokens:
        context.append(out[-1])
        out.append(fake_token(DECODE_WEIGHTS, context, vocab_size))
    return out


@functools.partial(jax.jit, static_argnums=(3,))
def _context_sums(pages: StagePages, tables: jax.Array, lengths: jax.Array, block_size: int) -> jax.Array:
    k = pages.k[:, tables]  # [L_s, B, M, BS, H, 1]
    num_layers, b, m = k.shape[0], k.shape[1], k.shape[2]
    k = k.reshape(num_layers, b, m * block_size, -1)  # [L_s, B, M*BS, H]
    valid = jnp.arange(m * block_size)[None, :] < lengths[:, None]  # [B, M*BS]
    return jnp.sum(jnp.where(valid[None, :, :, None], k, 0.0), axis=(0, 2, 3))  # [B]


class FakeEngine(Engine):
    """The `Engine` contract in integer arithmetic, on a tp x pp grid of `devices`: both roles, no extras."""

    capabilities = EngineCapabilities(prefill=True, decode=True, dense_insert=True)

    def __init__(self, config: ModelConfig, devices: Sequence[jax.Device], tp: int = 1, pp: int = 1) -> None:
        grid = StageGrid.of(devices, config.num_layers, tp, pp)
        if config.kv_heads % tp:
            raise ValueError(f"{config.kv_heads} K/V heads do not split over tp={tp}")
        self._config = config
        self._devices = tuple(devices)
        self.tp, self.pp = tp, pp
        self._grid = grid
        self.meshes, self._stage_layers = grid.meshes, grid.stage_layers
        self._layer_offsets = tuple(int(x) for x in np.cumsum((0, *self._stage_layers))[:-1])
        heads = np.arange(config.kv_heads) + 1
        self._norm = float(np.sum(np.arange(1, config.num_layers + 1)) * np.sum(heads))
        self.num_prefill_calls = 0
        self.num_decode_calls = 0

    @property
    def model_config(self) -> ModelConfig:
        return self._config

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    def kv_layout(self) -> KVLayout:
        return self._grid.kv_layout()

    def _kv_values(self, stage: int, tokens: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        layers = np.arange(self._stage_layers[stage]) + self._layer_offsets[stage] + 1  # [L_s]
        heads = np.arange(self._config.kv_heads) + 1  # [KVH]
        k = tokens[None, :, None] * layers[:, None, None] * heads[None, None, :]  # [L_s, T, H]
        v = np.broadcast_to((positions + 1)[None, :, None], k.shape)
        return k[..., None].astype(np.float32), np.ascontiguousarray(v[..., None]).astype(np.float32)

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        self.num_prefill_calls += 1
        layout = self.kv_layout()
        out = []
        for item in items:
            n = len(item.token_ids)
            padded = bucket(n, 16)
            tokens = np.zeros(padded, dtype=np.int64)
            tokens[:n] = item.token_ids
            kv = []
            for s in range(self.pp):
                k, v = self._kv_values(s, tokens, np.arange(padded))
                kv.append(StageKV(k=jax.device_put(k, layout.shardings[s]), v=jax.device_put(v, layout.shardings[s])))
            first = fake_token(PREFILL_WEIGHTS, item.token_ids, self._config.vocab_size)
            out.append(PrefilledSequence(item.request_id, first, n, tuple(kv)))
        return PrefillResult(tuple(out))

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        pages = []
        for s in range(self.pp):
            shape = (self._stage_layers[s], num_blocks, block_size, self._config.kv_heads, 1)
            sharding = self._grid.page_sharding(s)
            zeros = jax.jit(lambda shape=shape: jnp.zeros(shape, jnp.float32), out_shardings=sharding)()
            pages.append(StagePages(k=zeros, v=zeros.copy()))
        return tuple(pages)

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        return write_sequence(pages, kv, num_tokens, block_table)

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        self.num_decode_calls += 1
        block_size = pages[0].k.shape[2]
        max_blocks = max(len(r.block_table) for r in batch.rows)
        # Append every row's new tokens, one row at a time (the fake has no speed to lose).
        for row in batch.rows:
            n = len(row.token_ids)
            positions = np.arange(row.start_position, row.start_position + n)
            kv = []
            for s in range(self.pp):
                k, v = self._kv_values(s, np.asarray(row.token_ids), positions)
                target = dense_sharding(pages[s])
                kv.append(StageKV(k=jax.device_put(k, target), v=jax.device_put(v, target)))
            pages = write_sequence(pages, tuple(kv), n, row.block_table, start=row.start_position)
        b = bucket(len(batch.rows))
        tables = np.zeros((b, bucket(max_blocks)), dtype=np.int32)
        lengths = np.zeros(b, dtype=np.int32)
        for i, row in enumerate(batch.rows):
            tables[i, : len(row.block_table)] = row.block_table
            lengths[i] = row.start_position + len(row.token_ids)
        sums = np.sum([np.asarray(_context_sums(p, tables, lengths, block_size)) for p in pages], axis=0)  # [B]
        tokens = []
        for i, row in enumerate(batch.rows):
            a, bw, c = PREFILL_WEIGHTS if row.is_prompt else DECODE_WEIGHTS
            total = round(float(sums[i]) / self._norm)
            tokens.append((a * row.token_ids[-1] + bw * total + c * int(lengths[i])) % self._config.vocab_size)
        return tokens, pages


def fake_engine_factory(config: ModelConfig) -> Callable[[InstanceSpec, Sequence[jax.Device]], FakeEngine]:
    """An engine factory for `Controller.from_plan` that builds fake engines on each instance's devices."""

    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> FakeEngine:
        return FakeEngine(config, devices, tp=spec.tp, pp=spec.pp)

    return factory
