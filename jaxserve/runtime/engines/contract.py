"""The engine contracts between the runtime loops and a model, one per role.

An engine is bound to one instance's devices (a tp x pp grid: stage s on its
own `Mesh(('tp',))`). The runtime talks to it only through these Protocols:

* `PrefillEngine` (a prefill instance): `prefill(items) -> PrefillResult`: run
  the prompts, sample each first token, and return each sequence's KV source
  (`PrefilledSequence.kv`: dense arrays on this engine's devices, one entry per
  pipeline stage, or `HeldKV` when another process holds them).
* `AsyncPrefillEngine` (optional, checked with `isinstance`): `prefill_async(items)` dispatches the batch
  and returns a `PrefillHandle` at once: `wait_first_stage()` blocks until the batch has left the first
  pipeline stage (the next batch may enter it), `result()` until its first tokens are on the host. A
  prefill instance keeps several batches in its pipe this way (a pp-stage instance pipelines batches);
  `start_prefill` runs an engine without it (the Ray proxy) synchronously, as a `ReadyPrefill`.
* `DecodeEngine` (a decode or colocated instance): `init_pages` builds the paged
  pool (`KVPages`); `decode_step(batch, pages) -> (tokens, KVPages)` appends each
  row's new tokens (1 for a decode, a prompt chunk for colocated prefill) into
  the pool and samples one token per row; `kv_layout()` says where it keeps KV.
* `MultiStepDecoder` (optional, checked with `isinstance` like `BucketWarmable`):
  `decode_steps(batch, pages, num_steps)` runs up to `num_steps` decode steps of one-token rows in
  one call, each row stopping exactly where single steps would stop it (stop token, EOS unless
  `ignore_eos`, `max_tokens`); a decode or colocated instance with `decode_steps_per_call > 1` uses
  it, any other engine runs one step per call.
* `LogprobEngine` (optional, checked with `isinstance`): `computes_logprobs()` says the engine reports
  logprobs: its `prefill` fills `PrefilledSequence.first_logprobs` for items whose sampling asks, and
  (a decode engine, `LogprobDecoder`) `decode_step_logprobs` / `decode_steps_logprobs` return them beside
  the tokens. The controller refuses requests with logprobs unless every engine computes them.
  `step_tokens` / `steps_tokens` are the calls instances make: logprobs only when some row asks.
* `LocalDecodeEngine` adds `insert(kv, num_tokens, pages, block_table)`: write a
  dense `SequenceKV` pulled into this process into the pool at the given blocks.
  A decode instance never calls it itself: its `KVTransfer` (bound to the
  engine) pulls and writes (`TransferHandle.insert`), so a remote engine whose
  KV is staged in another process needs no dense `insert`.

KV arrays are pytrees of plain `jax.Array`s with the head axis sharded over
`tp`. Two engines implement every contract (`Engine`):
`jaxserve.runtime.engines.opt.OPTEngine` (the model) and
`jaxserve.runtime.engines.fake.FakeEngine` (hand-computable arithmetic); the Ray
backend's proxies implement `PrefillEngine` and `DecodeEngine` respectively.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import jax
from flax import struct
from jax.sharding import NamedSharding

from jaxserve.core.request import SamplingParams, TokenLogprobs
from models.config import OPTConfig
from models.paged_attention import BlockLayout


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
    """One pipeline stage's paged KV pool.

    `block_layout` says how a block holds its positions: "tokens" `[block_size, H, D]` or "heads"
    `[H, block_size, D]` (what `OPTEngine` uses where its decode attention reads head-major blocks
    best; `models.paged_attention.block_layout_for`). It is the engine's own choice: instances
    exchange dense `StageKV`, and `kv_pool` reads and writes blocks in the pool's layout.
    """

    k: jax.Array  # [L_s, num_blocks, block_size, H, D]; "heads": [L_s, num_blocks, H, block_size, D]
    v: jax.Array
    block_layout: BlockLayout = struct.field(pytree_node=False, default="tokens")

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[3 if self.block_layout == "heads" else 2])


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
class HeldKV:
    """A prefilled KV held by another process (the Ray backend's prefill actor) under a lease.

    `holder` names the instance holding it; a transfer pulls it by request id and, if it is
    gone, can recompute it from `item` (the prefilled tokens).
    """

    holder: str
    num_bytes: int
    item: PrefillItem
    start: int = 0  # positions the puller already holds (a prefix-cache hit): the pull moves start.. only
    prefix_blocks: tuple[int, ...] = ()  # the puller's blocks holding positions ..start (restart recovery)


@dataclasses.dataclass(frozen=True)
class PrefilledSequence:
    """A prefilled prompt: its first sampled token and where its KV is (padded to a bucket >= num_tokens).

    `kv` is the transfer's source: dense arrays in this process, or `HeldKV` in another one.
    """

    request_id: str
    first_token: int
    num_tokens: int
    kv: SequenceKV | HeldKV
    first_logprobs: TokenLogprobs | None = None  # when the item's sampling asked and the engine computes them

    @property
    def num_bytes(self) -> int:
        if isinstance(self.kv, HeldKV):
            return self.kv.num_bytes
        return sum(s.num_bytes for s in self.kv)

    @property
    def dense_kv(self) -> SequenceKV:
        """The KV arrays (TypeError for a KV held elsewhere)."""
        if isinstance(self.kv, HeldKV):
            raise TypeError(f"the KV of {self.request_id!r} is held by {self.kv.holder}, not in this process")
        return self.kv


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


@runtime_checkable
class PrefillEngine(Protocol):
    """What a prefill instance needs from a model on its devices."""

    @property
    def model_config(self) -> OPTConfig: ...

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult: ...


class PrefillHandle(Protocol):
    """A dispatched prefill batch (`AsyncPrefillEngine.prefill_async`); both calls may block, from any thread."""

    def wait_first_stage(self) -> None:
        """Return once the batch has left the first pipeline stage: the next batch may enter it."""
        ...

    def result(self) -> PrefillResult:
        """Return once the batch's first tokens are on the host: its result."""
        ...


@runtime_checkable
class AsyncPrefillEngine(Protocol):
    """A prefill engine that dispatches a batch without waiting for it (`OPTEngine`, `TimedEngine`)."""

    def prefill_async(self, items: Sequence[PrefillItem]) -> PrefillHandle: ...


@dataclasses.dataclass(frozen=True)
class ReadyPrefill:
    """A prefill that is already done (an engine without `prefill_async`): neither wait blocks."""

    value: PrefillResult

    def wait_first_stage(self) -> None:
        return None

    def result(self) -> PrefillResult:
        return self.value


def start_prefill(engine: PrefillEngine, items: Sequence[PrefillItem]) -> PrefillHandle:
    """Dispatch `items` on `engine`: asynchronously where it can (`AsyncPrefillEngine`), else run it now."""
    if isinstance(engine, AsyncPrefillEngine):
        return engine.prefill_async(items)
    return ReadyPrefill(engine.prefill(items))


@runtime_checkable
class DecodeEngine(Protocol):
    """What a decode or colocated instance needs from a model on its devices (KV comes in by transfer)."""

    @property
    def model_config(self) -> OPTConfig: ...

    def kv_layout(self) -> KVLayout: ...

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages: ...

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]: ...


@runtime_checkable
class PagedPrefiller(Protocol):
    """A prefill engine whose paged pool lives with it in another process (the Ray prefill proxy).

    A prefix-caching prefill instance hands it the uncached suffixes as prompt rows (`StepRow(is_prompt=True)`,
    block tables from the instance's `PrefixCache`) and `items`, the whole prompts in the same order (what a
    restarted engine, whose pool is gone, computes again in full); it runs the rows on its pool and returns
    each prompt's whole KV (positions 0 .. start + len) as the `PrefilledSequence` a decode instance pulls.
    """

    def prefill_rows(
        self, items: Sequence[PrefillItem], batch: StepBatch, pages: KVPages
    ) -> tuple[PrefillResult, KVPages]: ...


@runtime_checkable
class MultiStepDecoder(Protocol):
    """An engine that runs several decode steps per call (`OPTEngine`, `TimedEngine`).

    `decode_steps(batch, pages, num_steps)` -> each row's tokens (1..num_steps of them) and the pool.
    Rows are one-token decode rows; row r's list ends at its first stop token (its `stop_token_ids`,
    or EOS unless `ignore_eos`) or after `sampling.max_tokens - sample_index` tokens, so the tokens
    equal `num_steps` calls of `decode_step` with the same seeds and sample indices.
    """

    def decode_steps(self, batch: StepBatch, pages: KVPages, num_steps: int) -> tuple[list[list[int]], KVPages]: ...


RowLogprobs = tuple[TokenLogprobs, ...] | None  # one per token a row produced; None: the row did not ask


@runtime_checkable
class LogprobEngine(Protocol):
    """An engine that may report logprobs; `computes_logprobs()` says whether it does (a Ray proxy asks its actor)."""

    def computes_logprobs(self) -> bool: ...


@runtime_checkable
class LogprobDecoder(Protocol):
    """A decode engine that returns each asking row's logprobs with its token (`OPTEngine`, the Ray proxy).

    `decode_step_logprobs` is `decode_step` plus, per row, a `TokenLogprobs` (None for a row whose
    `sampling.logprobs` is None).
    """

    def decode_step_logprobs(
        self, batch: StepBatch, pages: KVPages
    ) -> tuple[list[int], list[TokenLogprobs | None], KVPages]: ...


@runtime_checkable
class MultiStepLogprobDecoder(Protocol):
    """`MultiStepDecoder.decode_steps` with each asking row's logprobs, one per token (`OPTEngine`)."""

    def decode_steps_logprobs(
        self, batch: StepBatch, pages: KVPages, num_steps: int
    ) -> tuple[list[list[int]], list[RowLogprobs], KVPages]: ...


def wants_logprobs(rows: Sequence[StepRow]) -> bool:
    return any(r.sampling.logprobs is not None for r in rows)


def step_tokens(
    engine: DecodeEngine, batch: StepBatch, pages: KVPages
) -> tuple[list[int], list[TokenLogprobs | None], KVPages]:
    """One `decode_step`; with a row that asks for logprobs (and an engine that reports them) its logprobs too.

    A batch where no row asks runs the plain step: no logprob computation, no extra transfer.
    """
    if wants_logprobs(batch.rows) and isinstance(engine, LogprobDecoder):
        return engine.decode_step_logprobs(batch, pages)
    tokens, pages = engine.decode_step(batch, pages)
    return tokens, [None] * len(tokens), pages


@runtime_checkable
class MemorySizedPool(Protocol):
    """An engine that can say how many KV blocks the memory its weights leave holds (`OPTEngine`)."""

    @property
    def model_config(self) -> OPTConfig: ...

    def kv_blocks_for_memory(
        self, block_size: int, memory_fraction: float = 0.9, max_blocks: int | None = None
    ) -> int: ...


@runtime_checkable
class LocalDecodeEngine(DecodeEngine, Protocol):
    """A decode engine in this process: dense KV pulled here is written into its pool with `insert`."""

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages: ...


@runtime_checkable
class BucketWarmable(Protocol):
    """An engine that can compile every padded shape the serving limits allow before traffic (`OPTEngine`)."""

    def warmup(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_decode_batch_size: int = 32,
        max_batch_tokens: int = 512,
        max_seq_len: int | None = None,
        chunk_size: int | None = None,
        prefill: bool = True,
        decode: bool = True,
        pages: KVPages | None = None,
        max_prefill_rows: int | None = None,
        decode_steps: int = 1,
        logprobs: bool = False,
    ) -> WarmedPages: ...


class WarmedPages(Protocol):
    """What a warm-up hands back: the pool it was given, after steps that wrote nothing."""

    @property
    def pages(self) -> KVPages | None: ...


@runtime_checkable
class Engine(PrefillEngine, LocalDecodeEngine, Protocol):
    """Both roles in one process (`OPTEngine`, `FakeEngine`): what the embedded factories build."""

    @property
    def devices(self) -> tuple[jax.Device, ...]: ...


def row_stops(row: StepRow, eos_token_id: int) -> tuple[int, ...]:
    """The token ids that end `row`'s request: its stop token ids, and EOS unless `ignore_eos`."""
    return tuple(row.sampling.stop_token_ids) + (() if row.sampling.ignore_eos else (eos_token_id,))


def decode_steps_one_by_one(
    engine: DecodeEngine, batch: StepBatch, pages: KVPages, num_steps: int
) -> tuple[list[list[int]], list[RowLogprobs], KVPages]:
    """`MultiStepDecoder.decode_steps` as `num_steps` calls of `step_tokens` (stops checked on the host).

    For engines whose multi-step program does not apply (pipeline parallelism): the same tokens (and,
    for rows that ask, logprobs), one dispatch per step.
    """
    eos = engine.model_config.eos_token_id
    out: list[list[int]] = [[] for _ in batch.rows]
    lps: list[list[TokenLogprobs | None]] = [[] for _ in batch.rows]
    live = list(range(len(batch.rows)))
    for k in range(num_steps):
        if not live:
            break
        step = []
        for i in live:
            r = batch.rows[i]
            last = out[i][-1] if out[i] else r.token_ids[0]
            step.append(dataclasses.replace(r, token_ids=(last,), start_position=r.start_position + k,
                                            sample_index=r.sample_index + k))  # fmt: skip
        tokens, logprobs, pages = step_tokens(engine, StepBatch(tuple(step)), pages)
        for i, tok, lp in zip(live, tokens, logprobs, strict=True):
            out[i].append(tok)
            lps[i].append(lp)
        live = [
            i
            for i in live
            if out[i][-1] not in row_stops(batch.rows[i], eos)
            and batch.rows[i].sample_index + len(out[i]) < batch.rows[i].sampling.max_tokens
        ]
    return out, [_row_logprobs(x) for x in lps], pages


def _row_logprobs(values: Sequence[TokenLogprobs | None]) -> RowLogprobs:
    taken = [v for v in values if v is not None]
    return tuple(taken) if taken and len(taken) == len(values) else None


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """The padded size for `n`: the next power of two >= max(n, minimum), capped at `maximum` (if >= n)."""
    size = max(minimum, 1)
    while size < n:
        size *= 2
    if maximum is not None and n <= maximum < size:
        return maximum
    return size
