"""Prefix caching in the simulator: hits, evictions, partial transfers and local prefills.

`PrefixSimulator` is the `Simulator` with a `PrefixCache` (the runtime's class) on every prefill,
decode and colocated instance, deciding with the runtime's policies from `jaxserve/core/scheduling.py`
(`choose_prefill_instance_cached`, `choose_decode_instance_cached`, `prefill_locally`). It only
overrides the simulator's prefix-cache hooks and wraps a few event handlers; the event loop, the
batching, admission and link model are the simulator's own. A request's life with caching:

1. Arrival. If conditional disaggregation is on (`PrefixPolicy.local_prefill_tokens > 0`), the
   decode instance the request would go to (`choose_decode_instance_cached` over the blocks each
   holds) is asked how much of the prompt it lacks; below the threshold the request joins that
   instance's pending queue as a *local prefill* and never visits a prefill instance. Otherwise it
   goes to the prefill instance with the best `overlap_weight × cached_blocks − queue_tokens`
   (queue = uncached tokens still to compute there). When its batch starts, it pins its cached
   prefix there (`PrefixCache.acquire`).
2. Prefill computes only the uncached suffix: a batch costs `prefill_stage_s(Σ new, Σ new·(new +
   2·cached), B)` (the chunked-prefill form of the latency model). When it finishes, the prompt's
   full blocks are named in the prefill cache (`commit`) and unpinned (`release`): the runtime's
   prefill instance copies the prompt's KV out of its pool for the buffer at the end of the step.
3. Decode choice prefers the instance holding the conversation's blocks; admission reserves the
   whole sequence (`admit_decodes` is unchanged and counts no credit for cached blocks), the decode
   cache pins the prompt's cached prefix, and the pull moves only the tokens it lacks
   (`_transfer_tokens`): partial transfers.
4. A local prefill rides in the decode instance's next round as a chunk with the running decodes
   (`chunk_stage_s`, Sarathi-style), and its first token comes at the end of that round.
5. At the end the decode cache names prompt + answer but the last token (whose KV is never
   computed) and releases the request: the next turn of the conversation finds it there. That
   next turn arrives `think_s` later (closed loop: a `_TURN_ARRIVAL` event; only first turns come
   from the arrival array).

Replay. With `sent_at` (one time per request) every request arrives when a load generator really
sent it, instead of `think_s` after the *simulated* end of the previous turn. Closed loop, a
conversation's later turns inherit every difference between the modelled and the real service
times (one slow step shifts all its later turns); under eviction pressure which blocks survive
depends on that interleaving, so comparing with a runtime run on the same trace needs the same
send times (`scripts/bench_prefix_cache.py` reports both).

Colocated. A colocated instance caches as the runtime's does: routing by
`choose_prefill_instance_cached` (cached blocks against waiting prompt tokens), admission pins the
cached prefix (at least one prompt token left to compute) and the prompt's chunks start after it
(`Simulator._coloc_step` cuts the policy's chunks), the prompt is named once prefilled, and at the
end prompt + answer but its last token; nothing is transferred.

Instances evict unreferenced blocks LRU when a reservation needs room. Decode caches hold as many
blocks as the instance's KV capacity (or `decode_pool_blocks`, to mirror a runtime's pool), so
`Simulator`'s free-block count equals the cache's `num_available` (free + evictable) at all times.
Prefill caches hold the prefill instance's KV capacity (or `prefill_pool_blocks`); a prompt whose
reservation does not fit is computed without pinning (no hit, no commit).
With `PrefixPolicy(enabled=False)` every request runs as in `Simulator` (a test checks identical
timestamps), which is the "without caching" arm.

Steady state. A finite set of closed-loop conversations never loads the system at its nominal rate
at the start (conversations still ramping up, caches cold) nor at the end (no new conversations).
So the SLO verdict counts only requests that arrive in the *measurement window*: after the first
`warmup_fraction` of conversations have started and before the last one starts (`measured`). The
run is not stopped early (a verdict over a window is known only at the end); `window_rate` tells
how close the window's real arrival rate came to the nominal one (a check that the set holds
enough conversations for the rate: a conversation lasts its turns × (think + service) seconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxserve.core.blocks import BlockAllocator, OutOfBlocksError
from jaxserve.core.plan import DeploymentPlan
from jaxserve.core.prefix_cache import BlockHash, PrefixCache, block_hashes
from jaxserve.core.scheduling import (
    CachedDecodeLoad,
    CachedPrefillLoad,
    DecodeLoad,
    PendingDecode,
    PrefillLoad,
    PrefixPolicy,
    WaitingPrompt,
    choose_decode_instance_cached,
    choose_prefill_instance_cached,
    prefill_locally,
    prefix_prefill_work,
    prompts_to_defer,
)
from placement.conversations import ConversationSet, SharedPrefixWorkload
from placement.goodput import GoodputSearch
from placement.hardware import ClusterSpec
from placement.latency import LatencyProvider
from placement.simulator import SimOptions, SimResult, Simulator
from placement.slo import SloSpec, attainment

_LOCAL = -2  # `src` of a pending decode that the decode instance prefills itself
_TURN_ARRIVAL = 100  # event kind: a conversation's next turn is sent (payload-free; inst = request)


@dataclasses.dataclass(frozen=True)
class PrefixStats:
    """What caching did over one run (tokens; bytes are KV bytes over all layers)."""

    num_requests: int
    prompt_tokens: int
    computed_tokens: int  # prompt tokens prefilled (on prefill instances and locally)
    transferred_tokens: int  # prompt tokens whose KV crossed a link
    kv_bytes_moved: float
    num_local_prefills: int
    num_prefill_evictions: int
    num_decode_evictions: int
    num_colocated_evictions: int = 0
    num_deferred: int = 0  # times a prefill batch member waited for an identical prompt in flight

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens whose KV was not recomputed."""
        return 1.0 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def transfer_share(self) -> float:
        """Share of prompt tokens whose KV was transferred (1.0 without caching)."""
        return self.transferred_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixSimulator(Simulator):
    """A `Simulator` with a `PrefixCache` on every instance. Construct, then `run()` once."""

    def __init__(
        self,
        plan: DeploymentPlan,
        latency: LatencyProvider,
        cluster: ClusterSpec,
        requests: SharedPrefixWorkload,
        slo: SloSpec | None = None,
        options: SimOptions | None = None,
        policy: PrefixPolicy | None = None,
        warmup_fraction: float = 0.25,
        prefill_pool_blocks: int | None = None,
        decode_pool_blocks: int | None = None,
        sent_at: np.ndarray | None = None,
    ) -> None:
        super().__init__(plan, latency, cluster, requests.workload, slo, options)
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
        self.tracker = None  # the verdict is over the measurement window, known only at the end
        self.replay = sent_at is not None
        if sent_at is not None:
            # A replay of observed send times: every request arrives when it was really sent, as an event.
            if sent_at.shape != (len(requests),) or np.isnan(sent_at).any():
                raise ValueError(f"sent_at: one send time per request ({len(requests)}), none NaN")
            first = np.sort(sent_at[: requests.num_first])
            self.workload = requests.workload.head(0)
            self.arrival_at = np.asarray(sent_at, dtype=np.float64).copy()
            for i in np.argsort(sent_at, kind="stable"):
                self._push(float(sent_at[i]), _TURN_ARRIVAL, int(i))
        else:
            # Closed loop: only first turns arrive from the array; each later turn is an event scheduled
            # `think_s` after the previous turn finishes (`_finished`).
            first = requests.workload.arrival_at[: requests.num_first]
            self.workload = requests.workload.head(requests.num_first)
            self.arrival_at = self.arrival_at.copy()
            self.arrival_at[requests.num_first :] = np.nan
        self.window = (float(first[int(warmup_fraction * (len(first) - 1))]), float(first[-1]))
        if self.options.mode != "full":
            raise ValueError("PrefixSimulator models whole deployments (full mode) only")
        self.policy = policy or PrefixPolicy()
        self.requests = requests
        bs = self.options.limits.block_size
        on = self.policy.enabled
        if decode_pool_blocks is not None:  # a runtime's configured pool instead of the device's KV capacity
            for d in self.decodes:
                d.free_blocks = decode_pool_blocks
            for c in self.colocated:
                c.free_blocks = decode_pool_blocks
        self.prefill_caches = [
            PrefixCache(BlockAllocator(prefill_pool_blocks or max(p.capacity_tokens // bs, 1), bs), enabled=on)
            for p in self.prefills
        ]
        self.decode_caches = [PrefixCache(BlockAllocator(d.free_blocks, bs), enabled=on) for d in self.decodes]
        self.colocated_caches = [PrefixCache(BlockAllocator(c.free_blocks, bs), enabled=on) for c in self.colocated]
        n = len(requests)
        self._computed = self.input_lens.copy()  # prompt tokens each request computes
        self._prior = np.zeros(n, dtype=np.int64)  # cached tokens under what it computes
        self._transferred = np.zeros(n, dtype=np.int64)
        self._local = np.zeros(n, dtype=bool)
        self._names: dict[int, tuple[BlockHash, ...]] = {}
        self._pending_compute = [0] * len(self.prefills)  # uncached tokens queued or running per prefill instance
        self._in_flight: list[dict[int, tuple[int, ...]]] = [{} for _ in self.prefills]  # running prompts
        self._num_deferred = 0  # times a batch member waited for an identical prompt in flight
        self._local_ready: list[list[int]] = [[] for _ in self.decodes]
        self._local_running: list[list[int]] = [[] for _ in self.decodes]

    # ---- results -----------------------------------------------------------------------------
    @property
    def measured(self) -> np.ndarray:
        """[N] bool: requests that arrived inside the measurement window (the ones the verdict counts)."""
        lo, hi = self.window
        with np.errstate(invalid="ignore"):
            return (self.arrival_at >= lo) & (self.arrival_at <= hi)

    @property
    def window_rate(self) -> float:
        """Requests per second that arrived inside the measurement window."""
        lo, hi = self.window
        return float(self.measured.sum()) / (hi - lo) if hi > lo else 0.0

    def _final_verdict(self, slo: SloSpec) -> bool:
        mask = self.measured
        ttft = np.nan_to_num(self.first_token_at[mask] - self.arrival_at[mask], nan=np.inf)
        steps = np.maximum(self.output_lens[mask] - 1, 1)
        tpot = (self.finish_at[mask] - self.first_token_at[mask]) / steps
        tpot = np.nan_to_num(np.where(self.output_lens[mask] > 1, tpot, 0.0), nan=np.inf)
        return attainment(ttft, tpot, slo) >= slo.attainment - 1e-12

    def stats(self) -> PrefixStats:
        started = ~np.isnan(self.first_token_at)
        return PrefixStats(
            num_requests=int(started.sum()),
            prompt_tokens=int(self.input_lens[started].sum()),
            computed_tokens=int(self._computed[started].sum()),
            transferred_tokens=int(self._transferred.sum()),
            kv_bytes_moved=float(self._transferred.sum()) * self.kv_bytes_per_token,
            num_local_prefills=int(self._local[started].sum()),
            num_prefill_evictions=sum(c.stats.num_evictions for c in self.prefill_caches),
            num_decode_evictions=sum(c.stats.num_evictions for c in self.decode_caches),
            num_colocated_evictions=sum(c.stats.num_evictions for c in self.colocated_caches),
            num_deferred=self._num_deferred,
        )

    # ---- helpers -----------------------------------------------------------------------------
    def _prompt(self, i: int) -> np.ndarray:
        return self.requests.prompts[i]

    def _prompt_names(self, i: int) -> tuple[BlockHash, ...]:
        names = self._names.get(i)
        if names is None:
            names = self._names[i] = block_hashes(self._prompt(i), self.options.limits.block_size)
        return names

    def _decode_choice(self, i: int, loads: list[DecodeLoad]) -> int:
        bs, names = self.options.limits.block_size, self._prompt_names(i)
        cands = [
            CachedDecodeLoad(
                c.num_cached_tokens(self._prompt(i), 0, names) // bs, ld.num_running, ld.num_waiting, ld.num_free_blocks
            )
            for c, ld in zip(self.decode_caches, loads, strict=True)
        ]
        return choose_decode_instance_cached(cands, self.policy.max_decode_imbalance)

    def _current_decode_loads(self) -> list[DecodeLoad]:
        # The loads `Simulator._first_token` gives the decode choice.
        return [
            DecodeLoad(d.num_running + len(d.joining) + d.num_transferring, len(d.pending), d.free_blocks)
            for d in self.decodes
        ]

    def _dispatch(self, kind: int, inst: int, payload: object) -> None:
        if kind == _TURN_ARRIVAL:
            self._on_arrival(inst)
        else:
            super()._dispatch(kind, inst, payload)

    def _finished(self, i: int) -> None:
        j = int(self.requests.next_turn[i])
        if j >= 0 and not self.replay:
            self.arrival_at[j] = self.now + float(self.requests.think_s[j])
            self._push(float(self.arrival_at[j]), _TURN_ARRIVAL, j)

    # ---- prefill side ------------------------------------------------------------------------
    def _route_prefill(self, i: int, loads: list[PrefillLoad]) -> int:
        bs, n = self.options.limits.block_size, int(self.input_lens[i])
        prompt, names = self._prompt(i), self._prompt_names(i)
        threshold = self.policy.local_prefill_tokens if self.policy.enabled else 0
        if threshold > 0:
            k = self._decode_choice(i, self._current_decode_loads())
            cached = self.decode_caches[k].num_cached_tokens(prompt, 1, names)
            if prefill_locally(n, cached, threshold):
                self._local[i] = True
                d = self.decodes[k]
                d.pending.append((PendingDecode(str(i), n, int(self.output_lens[i])), i, _LOCAL))
                self._try_admit(k)
                return -1
        cands = [
            CachedPrefillLoad(c.num_cached_tokens(prompt, 1, names) // bs, q, ld.num_queued_requests)
            for c, q, ld in zip(self.prefill_caches, self._pending_compute, loads, strict=True)
        ]
        k = choose_prefill_instance_cached(cands, self.policy.weight(bs))
        self._computed[i] = n - cands[k].num_cached_blocks * bs  # an estimate until the batch starts
        self._pending_compute[k] += int(self._computed[i])
        return k

    def _defer_repeats(self, k: int, batch: list[int]) -> list[int]:
        # The runtime's rule (`prompts_to_defer`): a prompt identical to one in flight here or to an earlier
        # member waits for a later batch, where its blocks are cached.
        if not self.policy.enabled:
            return batch
        keys = [tuple(self._prompt(i).tolist()) for i in batch]
        defer = prompts_to_defer(keys, self._in_flight[k].values(), self.options.limits.block_size)
        if any(defer):
            q = self.prefills[k].queue
            for i, wait in reversed(list(zip(batch, defer, strict=True))):
                if wait:
                    q.appendleft(WaitingPrompt(str(i), self._input_list[i]))
            self._num_deferred += sum(defer)
        kept = []
        for i, key, wait in zip(batch, keys, defer, strict=True):
            if not wait:
                kept.append(i)
                self._in_flight[k][i] = key
        return kept

    def _prefill_stage_s(self, k: int, batch: list[int]) -> float:
        # Called once per batch, as it starts: pin each prompt's cached prefix now (what is cached
        # may have changed since routing), as the runtime's prefill step does when it forms a batch.
        cache = self.prefill_caches[k]
        for i in batch:
            n = int(self.input_lens[i])
            try:
                cached = cache.acquire(str(i), self._prompt(i), n, names=self._prompt_names(i)).num_cached_tokens
            except OutOfBlocksError:  # the pool is pinned by buffered prompts: compute it all, cache nothing
                cached = 0
            self._pending_compute[k] += (n - cached) - int(self._computed[i])
            self._prior[i], self._computed[i] = cached, n - cached
        work = [prefix_prefill_work(int(self.input_lens[i]), int(self._prior[i])) for i in batch]
        return self.prefills[k].model.prefill_stage_s(
            float(sum(w[0] for w in work)), float(sum(w[1] for w in work)), len(batch)
        )

    def _on_prefill_done(self, k: int, batch: list[int]) -> None:
        cache = self.prefill_caches[k]
        for i in batch:
            self._in_flight[k].pop(i, None)
            cache.commit(str(i), self._prompt(i), self._prompt_names(i))
            # The runtime copies the prompt's KV out of the pool for the buffer and unpins at once.
            cache.release(str(i))
            self._pending_compute[k] -= int(self._computed[i])
        super()._on_prefill_done(k, batch)

    def _release_buffer(self, src: int, i: int) -> None:
        self.prefill_caches[src].release(str(i))  # the KV has left (or was never needed): unpin
        super()._release_buffer(src, i)
        if not np.isnan(self.finish_at[i]):  # a one-token request ended at its prefill
            self._finished(i)

    # ---- decode side -------------------------------------------------------------------------
    def _route_decode(self, i: int, loads: list[DecodeLoad]) -> int:
        return self._decode_choice(i, loads)

    def _reserve_decode_blocks(self, k: int, i: int, req: PendingDecode, num_blocks: int) -> int:
        cache = self.decode_caches[k]
        before = cache.num_available
        hit = cache.acquire(
            str(i),
            self._prompt(i),
            req.num_prompt_tokens + req.max_new_tokens,
            min_uncached_tokens=1 if self._local[i] else 0,  # a local prefill needs the last logits
            names=self._prompt_names(i),
        )
        if self._local[i]:
            self._prior[i] = hit.num_cached_tokens  # what the local prefill starts from
        else:
            self._transferred[i] = req.num_prompt_tokens - hit.num_cached_tokens  # a partial pull
        return before - cache.num_available

    def _transfer_tokens(self, k: int, i: int) -> int:
        return int(self._transferred[i])

    def _on_transfer_done(self, k: int, i: int, src: int) -> None:
        self.decode_caches[k].commit(str(i), self._prompt(i), self._prompt_names(i))
        super()._on_transfer_done(k, i, src)

    def _admit_without_transfer(self, k: int, i: int, src: int) -> bool:
        if src != _LOCAL:
            return False
        self._local_ready[k].append(i)
        # Counted like a transfer in flight, so batch room and decode loads see it until it joins.
        self.decodes[k].num_transferring += 1
        return True

    def _decode_has_work(self, k: int) -> bool:
        return bool(self._local_ready[k]) or super()._decode_has_work(k)

    def _decode_round_s(self, k: int) -> float:
        if not self._local_ready[k]:
            return super()._decode_round_s(k)
        d, m = self.decodes[k], self.decodes[k].model
        local = self._local_running[k] = self._local_ready[k]
        self._local_ready[k] = []
        work = [prefix_prefill_work(int(self.input_lens[i]), int(self._prior[i])) for i in local]
        new = sum(w[0] for w in work)
        for i in local:
            self.prefill_start_at[i] = self.now
            self._computed[i] = int(self.input_lens[i]) - int(self._prior[i])
        # A mixed step, as in a colocated instance: every stage in turn, decodes ride along.
        stage = m.chunk_stage_s(float(new), float(sum(w[1] for w in work)), len(local), d.num_running, d.ctx_sum)
        prompt_ctx = sum(int(self.input_lens[i]) for i in local)
        overhead_s = d.overhead.step_s(d.ctx_sum + prompt_ctx, m.pp, True)  # prompt rows pay the prefill extra
        return m.pp * stage + (m.pp - 1) * m.send_s(new + d.num_running) + overhead_s

    def _on_round_done(self, k: int) -> None:
        d, cache = self.decodes[k], self.decode_caches[k]
        local, self._local_running[k] = self._local_running[k], []
        for i in local:
            d.num_transferring -= 1
            self.first_token_at[i] = self.transfer_start_at[i] = self.transfer_end_at[i] = self.now
            cache.commit(str(i), self._prompt(i), self._prompt_names(i))
            ttft_ok = self.slo is None or self.now - self.arrival_at[i] <= self.slo.ttft_s
            if self.tracker is not None:
                self.tracker.record_ttft(ttft_ok)
            if self.output_lens[i] > 1:
                d.joining.append(i)
                continue
            self.decode_start_at[i] = self.finish_at[i] = self.now
            d.free_blocks += self._release_decode_blocks(k, i)
            if self.tracker is not None:
                self.tracker.record_done(bool(ttft_ok), True)
        super()._on_round_done(k)

    def _release_decode_blocks(self, k: int, i: int) -> int:
        return self._release_finished(self.decode_caches[k], i)

    def _release_finished(self, cache: PrefixCache, i: int) -> int:
        """Blocks freed when request i finishes: its prompt and answer stay cached (the last token has no KV)."""
        before = cache.num_available
        answer = self.requests.answers[i]
        cache.commit(str(i), np.concatenate([self._prompt(i), answer[:-1]]))
        cache.release(str(i))
        self._finished(i)
        return cache.num_available - before

    # ---- colocated ---------------------------------------------------------------------------
    def _route_colocated(self, i: int, loads: list[PrefillLoad]) -> int:
        # The runtime's controller: cached blocks of this prompt against waiting prompt tokens.
        bs, prompt, names = self.options.limits.block_size, self._prompt(i), self._prompt_names(i)
        cands = [
            CachedPrefillLoad(
                cache.num_cached_tokens(prompt, 1, names) // bs, ld.num_queued_tokens, ld.num_queued_requests
            )
            for cache, ld in zip(self.colocated_caches, loads, strict=True)
        ]
        return choose_prefill_instance_cached(cands, self.policy.weight(bs))

    def _reserve_colocated_blocks(self, k: int, i: int, num_blocks: int) -> int:
        # Admission pins the cached prefix (a prefill needs the last position's logits: min 1 uncached)
        # and the prompt's chunks start after it (`Simulator._coloc_step` cuts them).
        cache = self.colocated_caches[k]
        before = cache.num_available
        hit = cache.acquire(
            str(i), self._prompt(i), num_blocks * self.options.limits.block_size, names=self._prompt_names(i)
        )
        self._prefilled[i] = self._prior[i] = hit.num_cached_tokens
        self._computed[i] = int(self.input_lens[i]) - hit.num_cached_tokens
        return before - cache.num_available

    def _colocated_prompt_done(self, k: int, i: int) -> None:
        self.colocated_caches[k].commit(str(i), self._prompt(i), self._prompt_names(i))

    def _release_colocated_blocks(self, k: int, i: int) -> int:
        return self._release_finished(self.colocated_caches[k], i)


def simulate_prefix(
    plan: DeploymentPlan,
    latency: LatencyProvider,
    cluster: ClusterSpec,
    requests: SharedPrefixWorkload,
    slo: SloSpec | None = None,
    options: SimOptions | None = None,
    policy: PrefixPolicy | None = None,
) -> tuple[SimResult, PrefixStats]:
    """Simulate `plan` serving `requests` with prefix caching as `policy` says; the result and cache stats."""
    sim = PrefixSimulator(plan, latency, cluster, requests, slo, options, policy)
    result = sim.run()
    return result, sim.stats()


@dataclasses.dataclass(frozen=True)
class PrefixGoodputSearch(GoodputSearch):
    """`GoodputSearch` over a conversation set: each probe replays it at the probed rate with caching.

    `workload` is the set at rate 1 (for the bounds). With caching on, the bounds use each prompt
    minus what an unbounded cache would serve (`SharedPrefixWorkload.ideal_hits`), so they stay
    upper bounds of what any finite cache achieves.
    """

    conversations: ConversationSet | None = None
    policy: PrefixPolicy = dataclasses.field(default_factory=PrefixPolicy)

    def meets(self, rate: float) -> bool:
        assert self.conversations is not None
        sim = PrefixSimulator(
            self.plan, self.latency, self.cluster, self.conversations.at_rate(rate), self.slo, self.options, self.policy
        )
        verdict = sim.run().verdict
        assert verdict is not None
        return verdict

    def _ideal(self) -> GoodputSearch:
        if not self.policy.enabled or self.conversations is None:
            return self
        shared = self.conversations.at_rate(1.0)
        hits = shared.ideal_hits(self.options.limits.block_size)
        uncached = np.maximum(shared.workload.input_lens - hits, 1)
        workload = dataclasses.replace(shared.workload, input_lens=uncached)
        return GoodputSearch(self.plan, self.latency, self.cluster, workload, self.slo, self.options)

    def zero_load_attainment(self) -> float:
        ideal = self._ideal()
        return GoodputSearch.zero_load_attainment(ideal)

    def throughput_bound(self) -> float:
        ideal = self._ideal()
        return GoodputSearch.throughput_bound(ideal)


def prefix_goodput_search(
    plan: DeploymentPlan,
    latency: LatencyProvider,
    cluster: ClusterSpec,
    conversations: ConversationSet,
    slo: SloSpec,
    options: SimOptions | None = None,
    policy: PrefixPolicy | None = None,
) -> PrefixGoodputSearch:
    """The search object `placement.goodput.max_rate` takes, for a conversation workload."""
    return PrefixGoodputSearch(
        plan,
        latency,
        cluster,
        conversations.at_rate(1.0).workload,
        slo,
        options or SimOptions(),
        conversations,
        policy or PrefixPolicy(),
    )


@dataclasses.dataclass(frozen=True)
class CachingRow:
    """One arm of a with/without-caching comparison."""

    name: str
    policy: PrefixPolicy
    goodput_rps: float
    goodput_rps_per_device: float
    rate: float  # the common rate the stats below were measured at
    window_rate: float  # requests/s that really arrived in the measurement window at that rate
    stats: PrefixStats
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p90_s: float
    attainment: float


def compare_caching(
    plan: DeploymentPlan,
    latency: LatencyProvider,
    cluster: ClusterSpec,
    conversations: ConversationSet,
    slo: SloSpec,
    arms: Sequence[tuple[str, PrefixPolicy]],
    options: SimOptions | None = None,
    rate: float | None = None,
    rel_tol: float = 0.02,
    jobs: int = 1,
) -> list[CachingRow]:
    """Goodput of each arm (`max_rate` over the conversation set), then every arm at one common rate.

    The common rate is `rate`, or the first arm's goodput (so hit rate, bytes moved and TTFT are
    compared on identical traffic). Cache stats cover every request; TTFT, TPOT and attainment the
    measurement window. `jobs` > 1 runs the arms' searches in that many processes.
    """
    from concurrent.futures import ProcessPoolExecutor

    from placement.goodput import max_rate

    opts = options or SimOptions()
    searches = [prefix_goodput_search(plan, latency, cluster, conversations, slo, opts, p) for _, p in arms]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            goodputs = list(pool.map(max_rate, searches, [rel_tol] * len(searches)))
    else:
        goodputs = [max_rate(search, rel_tol) for search in searches]
    common = rate if rate is not None else next((g for g in goodputs if g > 0), 1.0)
    shared = conversations.at_rate(common)
    rows = []
    for (name, policy), good in zip(arms, goodputs, strict=True):
        sim = PrefixSimulator(plan, latency, cluster, shared, slo, opts, policy)
        result = sim.run()
        done = result.finished & sim.measured
        rows.append(
            CachingRow(
                name,
                policy,
                good,
                good / plan.num_devices,
                common,
                sim.window_rate,
                sim.stats(),
                float(np.percentile(result.ttft_s[done], 50)),
                float(np.percentile(result.ttft_s[done], 90)),
                float(np.percentile(result.tpot_s[done], 90)),
                float(
                    attainment(
                        np.nan_to_num(result.ttft_s[sim.measured], nan=np.inf),
                        np.nan_to_num(result.tpot_s[sim.measured], nan=np.inf),
                        slo,
                    )
                ),
            )
        )
    return rows
