"""The engine contract between the runtime loops and a model: prefill, insert, decode step.

An engine is bound to one instance's devices (a tp x pp grid: stage s on its
own `Mesh(('tp',))`). The runtime only ever talks to it through `Engine`:

* `prefill(items) -> PrefillResult`: run the prompts, sample each first token,
  and return each sequence's KV (`SequenceKV`, dense, on this engine's devices,
  one entry per pipeline stage).
* `insert(kv, num_tokens, pages, block_table) -> KVPages`: write a pulled
  sequence's KV into the paged pool (`KVPages`) at the blocks it was given.
* `decode_step(batch, pages) -> (tokens, KVPages)`: append each row's new tokens
  (1 for a decode, a prompt chunk for colocated prefill) into the pool and
  sample one token per row.

KV arrays are pytrees of plain `jax.Array`s with the head axis sharded over
`tp`; the KV transfer reads `kv_layout()` to know where a decode engine wants
them. Two engines implement this: `jaxserve.runtime.opt_engine.OPTEngine` (the model)
and `jaxserve.testing.fake_engine.FakeEngine` (hand-computable arithmetic).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import jax
from flax import struct
from jax.sharding import NamedSharding

from jaxserve.runtime.request import SamplingParams
from models.config import OPTConfig


@struct.dataclass
class StageKV:
    """Dense KV of one sequence for one pipeline stage."""

    k: jax.Array  # [L_s, T, H, D]
    v: jax.Array  # [L_s, T, H, D]

    @property
    def num_bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


@struct.dataclass
class StagePages:
    """One pipeline stage's paged KV pool."""

    k: jax.Array  # [L_s, num_blocks, block_size, H, D]
    v: jax.Array  # [L_s, num_blocks, block_size, H, D]


SequenceKV = tuple[StageKV, ...]
KVPages = tuple[StagePages, ...]


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Where an engine keeps KV: layers per pipeline stage and each stage's dense-KV sharding."""

    stage_layers: tuple[int, ...]
    shardings: tuple[NamedSharding, ...]  # for StageKV arrays [L_s, T, H, D]

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)


@dataclasses.dataclass(frozen=True)
class PrefillItem:
    """One prompt to prefill; `seed` is the request's sampling seed (drawn when the user gave none)."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int


@dataclasses.dataclass(frozen=True)
class PrefilledSequence:
    """A prefilled prompt: its first sampled token and its KV (padded to a bucket >= num_tokens)."""

    request_id: str
    first_token: int
    num_tokens: int
    kv: SequenceKV

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.kv)


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    sequences: tuple[PrefilledSequence, ...]


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One sequence in a paged step: append `token_ids` at `start_position`, then sample.

    `sample_index` is the index of the output token being sampled (the per-request
    RNG stream position). `is_prompt` marks prompt chunks (colocated prefill).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    sample_index: int
    is_prompt: bool = False


@dataclasses.dataclass(frozen=True)
class StepBatch:
    rows: tuple[StepRow, ...]


class Engine(Protocol):
    """What a prefill, decode or colocated instance needs from a model on its devices."""

    @property
    def model_config(self) -> OPTConfig: ...

    @property
    def devices(self) -> tuple[jax.Device, ...]: ...

    def kv_layout(self) -> KVLayout: ...

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult: ...

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages: ...

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages: ...

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]: ...


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """The padded size for `n`: the next power of two >= max(n, minimum), capped at `maximum` (if >= n)."""
    size = max(minimum, 1)
    while size < n:
        size *= 2
    if maximum is not None and n <= maximum < size:
        return maximum
    return size
