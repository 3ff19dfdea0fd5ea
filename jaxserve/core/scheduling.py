"""Scheduling policies, written once and used by both the runtime and the simulator.

Every function here is a pure decision over plain data: no threads, queues,
clocks or device arrays. A policy returns the decision itself (which requests,
how many blocks each reserves; like vLLM's scheduler output), and its users
apply it as given instead of recomputing it. The runtime's worker loops call them with the state of
real instances; `placement/simulator.py` calls them with simulated state. That
is what lets the simulator predict the engine: a change here is a change to
both.

The policies (DistServe section 3 and its baselines):

* **Prefill batching** (`form_prefill_batch`): first come, first served; take
  prompts from the head of the queue while their total length stays within
  `L_m` (`max_batch_tokens`, the length beyond which prefill stops gaining from
  batching). A prompt longer than `L_m` runs alone. The batch never exceeds the
  free slots of the prefill instance's KV buffer (`prefill_buffer_free_slots`:
  prefilled sequences wait there until a decode instance pulls them; a full
  buffer stops prefill, which is the backpressure from a saturated decode side).
* **Prefill dispatch** (`choose_prefill_instance`): shortest queue, measured in
  prompt tokens not yet prefilled (requests as the tie-break, then index).
* **Decode choice** (`choose_decode_instance`): least loaded: fewest sequences
  running or waiting to be pulled, then most free KV blocks, then index.
* **Decode admission** (`admit_decodes` -> `DecodeAdmission`): a decode instance
  pulls waiting KV in FCFS order while it has batch room and free blocks for the
  whole sequence (prompt + max new tokens); each admitted request comes with the
  blocks to reserve (`BlockReservation`). The head of the line is never skipped, so a long
  request cannot starve; reserving the whole sequence up front means a running
  sequence never has to be preempted.
* **Colocated load** (`colocated_load`): what dispatch compares between
  colocated instances: requests not yet admitted and their prompt tokens. A
  partially prefilled request holds its reservation, so it counts as running.
* **Colocated, prefill priority** (`schedule_colocated`, chunk_size=None): the
  vLLM continuous-batching rule. When waiting prompts can be admitted, the step
  runs only their prefills (up to `max_batch_tokens`); otherwise it decodes
  every running sequence.
* **Colocated, chunked prefill** (`schedule_colocated`, chunk_size=N): the
  Sarathi rule. Each step has a budget of N tokens: every running decode takes
  one (decodes are never held back, even past the budget), the rest goes to
  prompt chunks, oldest first, continuing a partially prefilled prompt before
  admitting a new one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-max(num_tokens, 0) // block_size)


def kv_tokens_reserved(num_prompt_tokens: int, max_new_tokens: int) -> int:
    """KV slots a sequence may ever use: its prompt plus every token it may generate."""
    return num_prompt_tokens + max_new_tokens


# ---------------------------------------------------------------------------
# Disaggregated: prefill side
# ---------------------------------------------------------------------------


def prefill_buffer_free_slots(capacity: int, num_buffered: int, num_in_flight: int) -> int:
    """Sequences the next prefill batch may hold: buffer slots not taken by buffered or running ones."""
    return max(capacity - num_buffered - num_in_flight, 0)


@dataclasses.dataclass(frozen=True)
class WaitingPrompt:
    """A request in a prefill queue, in arrival order."""

    request_id: str
    num_prompt_tokens: int


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """The next prefill batch: the ids taken from the head of the queue, in order, and their prompt tokens."""

    request_ids: tuple[str, ...] = ()
    num_tokens: int = 0

    def __len__(self) -> int:
        return len(self.request_ids)


def form_prefill_batch(
    queue: Sequence[WaitingPrompt], max_batch_tokens: int, max_batch_size: int | None = None
) -> PrefillBatch:
    """The next prefill batch: a prefix of `queue`.

    FCFS; the total prompt length stays within `max_batch_tokens` (L_m) except
    that a head prompt longer than L_m runs alone. `max_batch_size` caps the
    count (the free slots of the prefill KV buffer); an empty batch means the
    instance must wait.
    """
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    limit = len(queue) if max_batch_size is None else min(len(queue), max_batch_size)
    taken = 0
    total = 0
    while taken < limit:
        n = queue[taken].num_prompt_tokens
        if taken > 0 and total + n > max_batch_tokens:
            break
        total += n
        taken += 1
        if total >= max_batch_tokens:
            break
    return PrefillBatch(tuple(queue[i].request_id for i in range(taken)), total)


@dataclasses.dataclass(frozen=True)
class PrefillLoad:
    """What a prefill instance has not finished: queued plus running prompts."""

    num_queued_tokens: int
    num_queued_requests: int


def choose_prefill_instance(loads: Sequence[PrefillLoad]) -> int:
    """Index of the prefill instance with the shortest queue (tokens, then requests, then index)."""
    if not loads:
        raise ValueError("no prefill instances to choose from")
    return min(range(len(loads)), key=lambda i: (loads[i].num_queued_tokens, loads[i].num_queued_requests, i))


# ---------------------------------------------------------------------------
# Disaggregated: decode side
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeLoad:
    """A decode instance's load: running sequences, ones assigned but not yet pulled, free blocks."""

    num_running: int
    num_waiting: int
    num_free_blocks: int


def choose_decode_instance(loads: Sequence[DecodeLoad]) -> int:
    """Index of the least-loaded decode instance (fewest sequences, then most free blocks, then index)."""
    if not loads:
        raise ValueError("no decode instances to choose from")
    return min(
        range(len(loads)),
        key=lambda i: (loads[i].num_running + loads[i].num_waiting, -loads[i].num_free_blocks, i),
    )


@dataclasses.dataclass(frozen=True)
class PendingDecode:
    """A finished prefill waiting to be pulled by its decode instance, in arrival order."""

    request_id: str
    num_prompt_tokens: int
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class BlockReservation:
    """An admitted request and the KV blocks to reserve for it now (its whole sequence)."""

    request_id: str
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class DecodeAdmission:
    """The requests a decode instance pulls now (a prefix of its pending queue) and their reservations."""

    admitted: tuple[BlockReservation, ...] = ()

    def __len__(self) -> int:
        return len(self.admitted)

    @property
    def num_blocks(self) -> int:
        return sum(r.num_blocks for r in self.admitted)


def admit_decodes(
    pending: Sequence[PendingDecode],
    *,
    num_free_blocks: int,
    num_running: int,
    max_batch_size: int,
    block_size: int,
) -> DecodeAdmission:
    """The requests from the head of `pending` the decode instance pulls now, with their block reservations.

    FCFS without skipping: stop at the first request that lacks batch room or
    free blocks for its whole sequence (`kv_tokens_reserved`).
    """
    admitted: list[BlockReservation] = []
    free = num_free_blocks
    room = max_batch_size - num_running
    for req in pending:
        if len(admitted) >= room:
            break
        need = blocks_for(kv_tokens_reserved(req.num_prompt_tokens, req.max_new_tokens), block_size)
        if need > free:
            break
        free -= need
        admitted.append(BlockReservation(req.request_id, need))
    return DecodeAdmission(tuple(admitted))


# ---------------------------------------------------------------------------
# Colocated baselines
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ColocatedRequest:
    """A request inside a colocated instance.

    `num_prefilled` counts prompt tokens whose KV exists; `admitted` says the
    request holds its KV reservation (it is prefilling or decoding).
    """

    request_id: str
    num_prompt_tokens: int
    max_new_tokens: int
    num_prefilled: int = 0
    admitted: bool = False

    @property
    def is_decoding(self) -> bool:
        return self.admitted and self.num_prefilled >= self.num_prompt_tokens


def colocated_load(requests: Sequence[ColocatedRequest]) -> PrefillLoad:
    """A colocated instance's load for dispatch: requests not yet admitted and their prompt tokens.

    An admitted request (even one whose prompt is only partly prefilled) holds its reservation and
    is running, not waiting.
    """
    waiting = [r for r in requests if not r.admitted]
    return PrefillLoad(sum(r.num_prompt_tokens for r in waiting), len(waiting))


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Prefill prompt tokens [start, start + num_tokens) of a request in this step."""

    request_id: str
    start: int
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class ColocatedStep:
    """One colocated engine step: requests admitted now (with their blocks), prompt chunks to run, decodes."""

    admit: tuple[BlockReservation, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[str, ...] = ()

    @property
    def is_idle(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill) + len(self.decode)


def schedule_colocated(
    requests: Sequence[ColocatedRequest],
    *,
    num_free_blocks: int,
    block_size: int,
    max_batch_size: int,
    max_batch_tokens: int,
    chunk_size: int | None = None,
) -> ColocatedStep:
    """The next step of a colocated instance.

    `requests` lists every unfinished request in arrival order, admitted or
    not. Without `chunk_size` this is vLLM's prefill-priority rule; with it,
    Sarathi's chunked prefill with piggybacked decodes (`chunk_size` tokens a
    step).
    """
    decoding = [r for r in requests if r.is_decoding]
    prefilling = [r for r in requests if r.admitted and not r.is_decoding]
    waiting = [r for r in requests if not r.admitted]
    if chunk_size is None:
        return _prefill_priority_step(
            decoding, prefilling, waiting, num_free_blocks, block_size, max_batch_size, max_batch_tokens
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _chunked_step(decoding, prefilling, waiting, num_free_blocks, block_size, max_batch_size, chunk_size)


def _admissible(
    waiting: Sequence[ColocatedRequest], num_free_blocks: int, block_size: int, room: int
) -> list[tuple[ColocatedRequest, BlockReservation]]:
    """The FCFS prefix of `waiting` that fits in the free blocks and the batch room, with reservations."""
    pending = [PendingDecode(r.request_id, r.num_prompt_tokens, r.max_new_tokens) for r in waiting]
    decision = admit_decodes(
        pending, num_free_blocks=num_free_blocks, num_running=0, max_batch_size=room, block_size=block_size
    )
    return list(zip(waiting, decision.admitted, strict=False))


def _prefill_priority_step(
    decoding: list[ColocatedRequest],
    prefilling: list[ColocatedRequest],
    waiting: list[ColocatedRequest],
    num_free_blocks: int,
    block_size: int,
    max_batch_size: int,
    max_batch_tokens: int,
) -> ColocatedStep:
    room = max_batch_size - len(decoding) - len(prefilling)
    admissible = _admissible(waiting, num_free_blocks, block_size, room)
    candidates = [r for r, _ in admissible]
    # Prompts already admitted (left over from a token-capped step) go first.
    queue = [WaitingPrompt(r.request_id, r.num_prompt_tokens - r.num_prefilled) for r in prefilling + candidates]
    n = len(form_prefill_batch(queue, max_batch_tokens))
    if n:
        chosen = (prefilling + candidates)[:n]
        admit = tuple(res for _, res in admissible[: max(n - len(prefilling), 0)])
        chunks = tuple(
            PrefillChunk(r.request_id, r.num_prefilled, r.num_prompt_tokens - r.num_prefilled) for r in chosen
        )
        return ColocatedStep(admit=admit, prefill=chunks)
    return ColocatedStep(decode=tuple(r.request_id for r in decoding))


def _chunked_step(
    decoding: list[ColocatedRequest],
    prefilling: list[ColocatedRequest],
    waiting: list[ColocatedRequest],
    num_free_blocks: int,
    block_size: int,
    max_batch_size: int,
    chunk_size: int,
) -> ColocatedStep:
    # Decodes always run (one token each); prompts share what is left of the budget.
    decode = tuple(r.request_id for r in decoding)
    budget = chunk_size - len(decode)
    chunks: list[PrefillChunk] = []
    for r in prefilling:
        if budget <= 0:
            break
        n = min(budget, r.num_prompt_tokens - r.num_prefilled)
        chunks.append(PrefillChunk(r.request_id, r.num_prefilled, n))
        budget -= n
    admit: list[BlockReservation] = []
    if budget > 0:
        room = max_batch_size - len(decoding) - len(prefilling)
        for r, reservation in _admissible(waiting, num_free_blocks, block_size, room):
            if budget <= 0:
                break
            n = min(budget, r.num_prompt_tokens)
            admit.append(reservation)
            chunks.append(PrefillChunk(r.request_id, 0, n))
            budget -= n
    return ColocatedStep(admit=tuple(admit), prefill=tuple(chunks), decode=decode)


# ---------------------------------------------------------------------------
# Prefix caching: cache-aware routing and conditional disaggregation
# ---------------------------------------------------------------------------
#
# Used with `jaxserve/core/prefix_cache.py` (each instance's cache answers "how many leading
# blocks of this prompt do you hold" without side effects). With no cached blocks anywhere every
# rule below reduces to the cache-blind policy above, so caching off means exactly the old routing.


@dataclasses.dataclass(frozen=True)
class PrefixPolicy:
    """Knobs of prefix-cache-aware scheduling.

    `overlap_weight`: prompt tokens of queue a cached block is worth in prefill routing (None:
    `block_size`, i.e. a cached block saves exactly its tokens of prefill work).
    `local_prefill_tokens`: conditional disaggregation threshold; a prompt whose part uncached on
    its decode instance is *shorter* than this is prefilled there and nothing is transferred
    (0: always disaggregate).
    `max_decode_imbalance`: how many more sequences (running + waiting) the decode instance holding
    the conversation may have than the least-loaded one and still be preferred.
    """

    enabled: bool = True
    overlap_weight: float | None = None
    local_prefill_tokens: int = 0
    max_decode_imbalance: int = 8

    def weight(self, block_size: int) -> float:
        return float(block_size) if self.overlap_weight is None else self.overlap_weight


NO_PREFIX_CACHING = PrefixPolicy(enabled=False)  # an instance config's default (a controller passes its own)
DEFAULT_PREFIX_CACHING = PrefixPolicy()  # the server's default (`ControllerConfig.prefix_policy`): on


@dataclasses.dataclass(frozen=True)
class CachedPrefillLoad:
    """A prefill instance as cache-aware routing sees it.

    `num_cached_blocks`: leading blocks of *this* prompt the instance's cache holds.
    `num_queued_tokens`: tokens it still has to compute for queued and running prompts (their
    uncached parts).
    """

    num_cached_blocks: int
    num_queued_tokens: int
    num_queued_requests: int


def prefill_routing_score(load: CachedPrefillLoad, overlap_weight: float) -> float:
    """The documented routing cost, as a score to maximise: `overlap_weight × cached_blocks − queue_tokens`."""
    return overlap_weight * load.num_cached_blocks - load.num_queued_tokens


def choose_prefill_instance_cached(loads: Sequence[CachedPrefillLoad], overlap_weight: float) -> int:
    """Index of the prefill instance with the highest `prefill_routing_score`.

    Ties: fewer queued requests, then lower index. With `overlap_weight = block_size` the score is
    minus the tokens the instance must compute before this prompt's first token (its queue plus this
    prompt's uncached part) up to a constant, so the prompt goes where it finishes earliest in
    tokens of work. With no cached blocks anywhere it is `choose_prefill_instance`.
    """
    if not loads:
        raise ValueError("no prefill instances to choose from")
    return min(
        range(len(loads)),
        key=lambda i: (-prefill_routing_score(loads[i], overlap_weight), loads[i].num_queued_requests, i),
    )


@dataclasses.dataclass(frozen=True)
class CachedDecodeLoad:
    """A decode instance's load plus how many leading blocks of this request's prompt it holds."""

    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_free_blocks: int


def choose_decode_instance_cached(loads: Sequence[CachedDecodeLoad], max_imbalance: int) -> int:
    """Prefer the decode instance holding most of the conversation, unless it is much busier.

    Candidates are the instances whose sequences (running + waiting) exceed the least-loaded
    instance's by at most `max_imbalance`; among them the most cached blocks wins, then
    `choose_decode_instance`'s order (fewest sequences, most free blocks, index). With no cached
    blocks anywhere it is `choose_decode_instance`.
    """
    if not loads:
        raise ValueError("no decode instances to choose from")
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
    seqs = [ld.num_running + ld.num_waiting for ld in loads]
    least = min(seqs)
    candidates = [i for i in range(len(loads)) if seqs[i] <= least + max_imbalance]
    return min(candidates, key=lambda i: (-loads[i].num_cached_blocks, seqs[i], -loads[i].num_free_blocks, i))


def prefill_locally(num_prompt_tokens: int, num_cached_tokens: int, threshold_tokens: int) -> bool:
    """Conditional disaggregation: the decode instance prefills the prompt itself (no transfer).

    True when the part of the prompt its cache lacks is shorter than `threshold_tokens`
    (`PrefixPolicy.local_prefill_tokens`; 0 never does).
    """
    if num_cached_tokens < 0 or num_cached_tokens > num_prompt_tokens:
        raise ValueError(f"cached tokens {num_cached_tokens} outside [0, {num_prompt_tokens}]")
    return num_prompt_tokens - num_cached_tokens < threshold_tokens


def prompts_to_defer(
    batch: Sequence[tuple[int, ...]],
    in_flight: Iterable[tuple[int, ...]],
    block_size: int,
    *,
    salts: Sequence[str | None] | None = None,
    in_flight_salts: Iterable[str | None] | None = None,
) -> list[bool]:
    """Which members of a caching prefill batch wait for a later batch instead of running now.

    A prompt longer than one block that is identical to a prompt in flight on the instance (computing,
    its blocks not named in the cache yet) or to an earlier member of the batch waits: once the first one
    commits its blocks, the repeat finds them cached and computes only its last, partial block, instead
    of computing (and transferring) the whole prompt a second time. The samples of an `n` > 1 request and
    a client's retries are such repeats. A prompt of at most one block has no full block to share and
    never waits. The runtime's prefill instance and the simulator's (`placement/prefix_sim.py`) both
    apply this rule.

    `salts` / `in_flight_salts`: each prompt's cache salt (`GenerateRequest.cache_salt`; None: unsalted).
    Only a repeat under the same salt waits: under another it would find none of those blocks, and its
    wait would tell its client that another tenant is computing that very prompt.
    """
    flight = list(in_flight)
    flight_salts = list(in_flight_salts) if in_flight_salts is not None else [None] * len(flight)
    batch_salts = list(salts) if salts is not None else [None] * len(batch)
    if len(flight_salts) != len(flight) or len(batch_salts) != len(batch):
        raise ValueError("one salt per prompt")
    seen = {(salt, p) for p, salt in zip(flight, flight_salts, strict=True) if len(p) > block_size}
    defer = []
    for prompt, salt in zip(batch, batch_salts, strict=True):
        wait = len(prompt) > block_size and (salt, prompt) in seen
        defer.append(wait)
        if not wait:
            seen.add((salt, prompt))
    return defer


def prefix_prefill_work(num_tokens: int, num_cached_tokens: int) -> tuple[int, int]:
    """(tokens to compute, their attention work Σ over new positions of context length, in token²).

    Prefilling positions c..n−1 on top of c cached ones costs n − c GEMM tokens and attention
    (n − c)·(n + c) (each new token attends to the prefix and to the new tokens before it, counted
    as the latency model's `sum_sq` for a chunk: chunk × (chunk + 2 × prior)).
    """
    new = num_tokens - num_cached_tokens
    return new, new * (new + 2 * num_cached_tokens)
