"""The engine contract between the runtime loops and a model: one `Engine`, its abilities as attributes.

An engine is bound to one instance's devices (a tp x pp grid: stage s on its own `Mesh(('tp',))`). The
runtime talks to it only through `Engine`, whose `capabilities` (`EngineCapabilities`, a frozen dataclass)
say which roles it plays and which optional calls it has; callers read them, and an unsupported call raises
`UnsupportedEngineCall` (the contract's default body), never a silent fallback. In the manner of JetStream's
`engine_api.py`, the life of a request through it:

* the prefill role (a prefill instance): `prefill(items) -> PrefillResult` runs the prompts, samples each
  first token and returns each sequence's KV source (`PrefilledSequence.kv`: dense arrays on this engine's
  devices, one entry per pipeline stage, or `HeldKV` when another process holds them). With `async_prefill`,
  `prefill_async(items)` returns a `PrefillHandle` at once: `wait_first_stage()` blocks until the batch has
  left the first pipeline stage (the next batch may enter it), `result()` until its first tokens are on the
  host, so a pp-stage instance pipelines batches (`start_prefill` picks). With `paged_prefill` (the Ray
  prefill proxy), a prefix-caching prefill instance runs the uncached suffixes on the engine's own pool
  (`prefill_rows`);
* the decode role (a decode or colocated instance): `init_pages` builds the paged pool (`KVPages`),
  `decode_step(batch, pages) -> (tokens, KVPages)` appends each row's new tokens (1 for a decode, a prompt
  chunk for colocated prefill) and samples one token per row, `kv_layout()` says where it keeps KV. KV comes
  in by transfer: the instance's `KVTransfer` pulls it and, for an engine in this process (`dense_insert`),
  writes it with `insert(kv, num_tokens, pages, block_table)`; a remote engine's KV is staged in its process;
* `multi_step_decode`: `decode_steps(batch, pages, num_steps)` runs up to `num_steps` decode steps of
  one-token rows in one call, each row stopping exactly where single steps would stop it (stop token, EOS
  unless `ignore_eos`, `max_tokens`); an instance with `decode_steps_per_call > 1` uses it;
* `logprobs`: `prefill` fills `PrefilledSequence.first_logprobs` for items whose sampling asks, and
  `decode_step_logprobs` / `decode_steps_logprobs` return them beside the tokens. The controller refuses
  requests with logprobs unless every engine has them; `step_tokens` is the call instances make (logprobs
  only when some row asks);
* `bucket_warmup`: `warmup(...)` compiles every padded shape the serving limits allow before traffic;
  `memory_sized_pool`: `kv_blocks_for_memory(...)` sizes the pool from the memory the weights leave.

KV arrays are pytrees of plain `jax.Array`s with the head axis sharded over `tp`. The backends sit beside
this file: `opt.ModelEngine` (the model), `fake.FakeEngine` (hand-computable arithmetic) and
`timed.TimedEngine` (computes nothing, sleeps the step-cost contract's time); the Ray backend's proxies
(`ray_backend/remote_engine.py`) play one role each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol

import jax
from jax.sharding import NamedSharding

from jaxserve.core.limits import DEFAULT_LIMITS
from jaxserve.core.request import SamplingParams, TokenLogprobs, finish_reason, stop_token_ids
from models.attention import PagedKVCache
from models.config import ModelConfig
from models.pytree import pytree_dataclass


@pytree_dataclass
class StageKV:
    """Dense KV of one sequence for one pipeline stage."""

    k: jax.Array  # [L_s, T, H, D]
    v: jax.Array  # [L_s, T, H, D]

    @property
    def num_bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


# One pipeline stage's paged KV pool: the model's own block pool (`models.attention.PagedKVCache`), one type from
# the model to the engines, the pool bookkeeping and KV transfer, never converted. Its `block_layout` says how
# a block holds its positions: "tokens" `[block_size, H, D]` or "heads" `[H, block_size, D]` (what `ModelEngine`
# uses where its decode attention reads head-major blocks best; `models.paged_attention.block_layout_for`). It
# is the engine's own choice: instances exchange dense `StageKV`, and `kv_pool` reads and writes blocks in the
# pool's layout. k, v: [L_s, num_blocks, block_size, H, D]; "heads": [L_s, num_blocks, H, block_size, D].
StagePages = PagedKVCache


SequenceKV = tuple[StageKV, ...]
KVPages = tuple[StagePages, ...]
KVCopy = Literal["insert", "gather", "slice"]  # the KV copies of a pool (`Engine.kv_copy_compiled`)


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
    """One prompt to prefill; `seed` is the request's sampling seed (drawn when the user gave none).

    `arrived_at`: when the request reached the server (`time.monotonic`). Engines that compute ignore it;
    the timed engine starts a batch's modelled time no earlier than its last prompt's arrival, not at the
    host's (late) wake-up after an idle gap."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    arrived_at: float | None = None


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


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What an engine does: its roles and its optional calls. Callers read these; a call an engine does not
    support raises `UnsupportedEngineCall`.

    * `prefill`: the prefill role, `prefill(items)`;
    * `decode`: the decode role, a paged pool of its own: `kv_layout`, `init_pages`, `decode_step`;
    * `async_prefill`: `prefill_async(items)` dispatches a batch without waiting (a pipelined prefill instance);
      without it `start_prefill` runs `prefill` at once (`ReadyPrefill`);
    * `paged_prefill`: `prefill_rows(items, batch, pages)` on a pool that lives with the engine (the Ray prefill
      proxy; it builds that pool with `init_pages` but runs no `decode_step`);
    * `dense_insert`: `insert(kv, ...)` writes dense KV pulled into this process into the pool (an engine in
      this process; a remote one's KV is staged in its actor's process instead);
    * `multi_step_decode`: `decode_steps(batch, pages, num_steps)`;
    * `logprobs`: `prefill` fills `PrefilledSequence.first_logprobs` for items that ask and, with the decode
      role, `decode_step_logprobs` (with `multi_step_decode`, also `decode_steps_logprobs`) returns them;
    * `bucket_warmup`: `warmup(...)` compiles every padded shape the serving limits allow before traffic;
    * `memory_sized_pool`: `kv_blocks_for_memory(...)` says how many KV blocks the memory its weights leave holds.
    """

    prefill: bool = False
    decode: bool = False
    async_prefill: bool = False
    paged_prefill: bool = False
    dense_insert: bool = False
    multi_step_decode: bool = False
    logprobs: bool = False
    bucket_warmup: bool = False
    memory_sized_pool: bool = False


class UnsupportedEngineCall(NotImplementedError):
    """A call to an engine whose capabilities do not include it."""

    def __init__(self, engine: object, call: str, capability: str) -> None:
        super().__init__(f"{type(engine).__name__} has no `{call}` (capability `{capability}` is off)")


class PrefillHandle(Protocol):
    """A dispatched prefill batch (`Engine.prefill_async`); both calls may block, from any thread."""

    def wait_first_stage(self) -> None:
        """Return once the batch has left the first pipeline stage: the next batch may enter it."""
        ...

    def result(self) -> PrefillResult:
        """Return once the batch's first tokens are on the host: its result."""
        ...


@dataclasses.dataclass(frozen=True)
class WarmupSpec:
    """What `Engine.warmup` compiles: the serving limits its buckets come from, and which programs.

    One value for every engine, the Ray proxy (which sends it to its actor and repeats it after a restart) and the
    controller's warm-up (`runtime/compilation/deployment.py`), so the limits a warm-up honours are named once."""

    num_blocks: int  # the pool a warm-up without the instance's `pages` makes (and drops)
    block_size: int
    max_decode_batch: int = DEFAULT_LIMITS.max_decode_batch  # decode row buckets up to this (a prefill's: slots)
    max_batch_tokens: int = DEFAULT_LIMITS.max_batch_tokens  # the prefill token cap
    max_seq_len: int | None = None  # the longest sequence (prompt buckets, table widths); None: the model's
    chunk_size: int | None = None  # a colocated step's prompt-token budget: its prompt-row buckets
    prefill: bool = True  # the dense prefill buckets
    decode: bool = True  # the decode step buckets (and the insert of a pulled KV)
    max_prefill_rows: int | None = None  # a prefill instance's buffer slots: no batch has more rows
    decode_steps: int = 1  # > 1: the multi-step loop program of every row bucket x table width too
    logprobs: bool = False  # the logprob programs too
    background: bool = False  # the buckets that hold all others now, the rest on a background thread
    prefix_prefill: bool = False  # a prefix-caching prefill instance's pool programs (insert, gather, slices)


class WarmedPages(Protocol):
    """What a warm-up hands back: the pool it was given, after steps that wrote nothing."""

    @property
    def pages(self) -> KVPages | None: ...


RowLogprobs = tuple[TokenLogprobs, ...] | None  # one per token a row produced; None: the row did not ask


class Engine(Protocol):
    """The engine contract: one model on one instance's devices, in the roles its `capabilities` name.

    Implementations subclass it: the calls without a body are required of every engine, the others raise
    `UnsupportedEngineCall` unless the engine has their capability (and overrides them).
    """

    @property
    def capabilities(self) -> EngineCapabilities: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices it runs on in this process (none for a proxy of an engine in another process)."""
        ...

    # ---- the prefill role (`prefill`) ---------------------------------------------------------------------

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        """Run the prompts, sample each first token, and return each sequence's KV source."""
        raise UnsupportedEngineCall(self, "prefill", "prefill")

    def prefill_async(self, items: Sequence[PrefillItem]) -> PrefillHandle:
        """`async_prefill`: dispatch the batch and return at once (`PrefillHandle`)."""
        raise UnsupportedEngineCall(self, "prefill_async", "async_prefill")

    def prefill_rows(
        self, items: Sequence[PrefillItem], batch: StepBatch, pages: KVPages
    ) -> tuple[PrefillResult, KVPages]:
        """`paged_prefill`: a prefix-caching prefill instance hands the uncached suffixes as prompt rows
        (`StepRow(is_prompt=True)`, block tables from its `PrefixCache`) and `items`, the whole prompts in the
        same order (what a restarted engine, whose pool is gone, computes again in full); the engine runs the
        rows on its pool and returns each prompt's whole KV (positions 0 .. start + len) as the
        `PrefilledSequence` a decode instance pulls."""
        raise UnsupportedEngineCall(self, "prefill_rows", "paged_prefill")

    # ---- the decode role (`decode`): a paged pool and steps over it ---------------------------------------

    def kv_layout(self) -> KVLayout:
        """Where it keeps KV: layers per pipeline stage and each stage's dense-KV sharding."""
        raise UnsupportedEngineCall(self, "kv_layout", "decode")

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        """The paged pool (`decode`, or the pool `prefill_rows` runs on)."""
        raise UnsupportedEngineCall(self, "init_pages", "decode")

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        """Append each row's new tokens (1 for a decode, a prompt chunk for colocated prefill) into the pool
        and sample one token per row."""
        raise UnsupportedEngineCall(self, "decode_step", "decode")

    def decode_step_logprobs(
        self, batch: StepBatch, pages: KVPages
    ) -> tuple[list[int], list[TokenLogprobs | None], KVPages]:
        """`logprobs`: `decode_step` plus, per row, a `TokenLogprobs` (None for a row whose `sampling.logprobs`
        is None)."""
        raise UnsupportedEngineCall(self, "decode_step_logprobs", "logprobs")

    def decode_steps(self, batch: StepBatch, pages: KVPages, num_steps: int) -> tuple[list[list[int]], KVPages]:
        """`multi_step_decode`: up to `num_steps` decode steps of one-token rows in one call -> each row's
        tokens (1..num_steps of them) and the pool. Row r's list ends at its first stop token (its
        `stop_token_ids`, or EOS unless `ignore_eos`) or after `sampling.max_tokens - sample_index` tokens, so
        the tokens equal `num_steps` calls of `decode_step` with the same seeds and sample indices."""
        raise UnsupportedEngineCall(self, "decode_steps", "multi_step_decode")

    def decode_steps_logprobs(
        self, batch: StepBatch, pages: KVPages, num_steps: int
    ) -> tuple[list[list[int]], list[RowLogprobs], KVPages]:
        """`multi_step_decode` and `logprobs`: `decode_steps` with each asking row's logprobs, one per token."""
        raise UnsupportedEngineCall(self, "decode_steps_logprobs", "multi_step_decode + logprobs")

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        """`dense_insert`: write a dense `SequenceKV` pulled into this process into the pool at these blocks.
        A decode instance never calls it itself: its `KVTransfer` (bound to the engine) pulls and writes."""
        raise UnsupportedEngineCall(self, "insert", "dense_insert")

    def kv_blocks_for_memory(self, block_size: int, memory_fraction: float = 0.9, max_blocks: int | None = None) -> int:
        """`memory_sized_pool`: how many KV blocks `memory_fraction` of its devices' memory leaves holds."""
        raise UnsupportedEngineCall(self, "kv_blocks_for_memory", "memory_sized_pool")

    # ---- either role ---------------------------------------------------------------------------------------

    def warmup(self, spec: WarmupSpec, pages: KVPages | None = None) -> WarmedPages:
        """`bucket_warmup`: compile every padded shape `spec`'s limits allow before traffic (`spec.background`:
        the buckets that hold all others now, the rest on a thread while work runs padded up to compiled ones;
        `spec.prefix_prefill`: also what a prefix-caching prefill instance runs on its pool). With the instance's
        `pages` it warms on that pool and returns the pool to keep in its place; otherwise one is made and dropped."""
        raise UnsupportedEngineCall(self, "warmup", "bucket_warmup")

    def step_compiled(self, rows: Sequence[StepRow], block_size: int) -> bool:
        """Whether a `decode_step` of `rows` would run an already compiled program (an engine that compiles
        in the background says False until it has one that holds them; the others: True)."""
        return True

    def kv_copy_compiled(self, kind: KVCopy, padded: int, from_padded: int = 0) -> bool:
        """Whether a KV copy of `padded` positions would run an already compiled program: "insert" (a dense KV
        into its pool), "gather" (out of its pool, `kv_pool.read_sequence`) or "slice" (out of a KV it prefilled
        of `from_padded` positions, `kv_pool.slice_sequence`). An engine that compiles them in the background
        says False until it has; the others: True."""
        return True

    def hold_background_warmup(self) -> None:
        """The next `warmup` with `background` keeps its background compiles until `start_background_warmup()`
        (a caller warming several engines starts them all at the end); an engine without them: no-op."""
        return None

    def start_background_warmup(self) -> None:
        """Start the background compiles `hold_background_warmup` kept waiting; none: no-op."""
        return None

    def stop_background_warmup(self, timeout_s: float = 60.0) -> None:
        """Stop a `warmup` with `background` still compiling (after its current bucket); nothing to stop: no-op."""
        return None

    def background_warmup_done(self, timeout_s: float | None = None) -> bool:
        """Wait up to `timeout_s` for a `warmup` with `background` to finish; whether none runs or waits to start
        now (from then on every `*_compiled` answer is True). An engine without one: True."""
        return True


@dataclasses.dataclass(frozen=True)
class ReadyPrefill:
    """A prefill that is already done (an engine without `async_prefill`): neither wait blocks."""

    value: PrefillResult

    def wait_first_stage(self) -> None:
        return None

    def result(self) -> PrefillResult:
        return self.value


def start_prefill(engine: Engine, items: Sequence[PrefillItem]) -> PrefillHandle:
    """Dispatch `items` on `engine`: asynchronously where it can (`async_prefill`), else run it now."""
    if engine.capabilities.async_prefill:
        return engine.prefill_async(items)
    return ReadyPrefill(engine.prefill(items))


def wants_logprobs(rows: Sequence[StepRow]) -> bool:
    return any(r.sampling.logprobs is not None for r in rows)


def step_tokens(
    engine: Engine, batch: StepBatch, pages: KVPages
) -> tuple[list[int], list[TokenLogprobs | None], KVPages]:
    """One `decode_step`; with a row that asks for logprobs (and an engine that reports them) its logprobs too.

    A batch where no row asks runs the plain step: no logprob computation, no extra transfer.
    """
    if wants_logprobs(batch.rows) and engine.capabilities.logprobs:
        return engine.decode_step_logprobs(batch, pages)
    tokens, pages = engine.decode_step(batch, pages)
    return tokens, [None] * len(tokens), pages


def row_stops(row: StepRow, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The token ids that end `row`'s request (`core.request.stop_token_ids`), for a check on the device."""
    return stop_token_ids(row.sampling, eos_token_ids)


def decode_steps_one_by_one(
    engine: Engine, batch: StepBatch, pages: KVPages, num_steps: int
) -> tuple[list[list[int]], list[RowLogprobs], KVPages]:
    """`Engine.decode_steps` as `num_steps` calls of `step_tokens` (stops checked on the host).

    For engines whose multi-step program does not apply (pipeline parallelism): the same tokens (and,
    for rows that ask, logprobs), one dispatch per step.
    """
    eos = engine.model_config.eos_token_ids
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
        rows = batch.rows
        live = [
            i
            for i in live
            if finish_reason(rows[i].sampling, out[i][-1], rows[i].sample_index + len(out[i]), eos) is None
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
