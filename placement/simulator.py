"""Discrete-event simulation of a deployment over a workload: per-request TTFT, TPOT and phase breakdown.

The simulator owns its clock, event heap and sequence counter; events are plain tuples
`(at, seq, kind, instance, payload)` ordered by time, then by the order they were scheduled (seq),
so two runs over the same workload are identical. Arrivals come from the workload's sorted arrays
and are processed after heap events at the same instant. Durations come only from the latency model
(`placement/latency.py`); every decision comes from `jaxserve/core/scheduling.py`, the runtime's own policies:

* disaggregated — a request goes to the prefill instance chosen by `choose_prefill_instance`; the
  instance starts a batch (`form_prefill_batch`, FCFS up to L_m tokens, limited by free room in its KV
  buffer) whenever its first pipeline stage is free. Stage 0 is busy for the step's host work and
  the batch's stage time, every later stage for the stage time; batches follow each other down the
  pipe (stage k of batch i starts when stage k−1 of batch i, plus the send, and stage k of batch i−1
  are both done), so a pp-stage instance overlaps pp batches and a batch alone takes
  `prefill_step_s`. The runtime does the same: `PrefillInstance` dispatches the next batch as soon as
  the engine's first stage is free (`async_prefill`; docs/simulator-fidelity.md). At the last
  stage the first token exists (TTFT) and the KV waits in the prefill buffer. The request is assigned to
  `choose_decode_instance`'s pick; that instance pulls it when `admit_decodes` allows (batch room and
  KV blocks for prompt + output), the KV crosses the link between the two instances (NVLink inside a
  node, the network across nodes; transfers on one link go one at a time), and the request joins the
  running batch at the next round boundary. A decode round emits one token for every running request
  and takes `pipeline_decode_round_s` of the batch size and total context. Those two aggregates are
  all a round needs, and every request gains exactly one token a round, so the batch is kept as
  (count, context sum, heap of last rounds): a round is O(1) work plus O(requests finishing), with no
  per-request loop at all (cheaper than a numpy pass over the batch, which this replaced). Rounds that
  nothing can change (until the next finish, cut by a join) are one event (`Simulator.coalesce`).
* colocated — `schedule_colocated` picks each step (vLLM prefill priority, or Sarathi chunks with
  piggybacked decodes when the instance has `chunk_size`). After a decode-only step the policy's answer
  cannot change until an arrival, admission or finish, so those repeated steps are one event too.

Modes for the per-phase searches of Algorithm 1: `prefill` (requests leave after their first token)
and `decode` (requests enter the decode instances at arrival, as if prefill took no time).

With an `SloSpec`, the run stops as soon as the verdict (target attainment met or missed) can no
longer change; unfinished requests then have NaN latencies.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import numpy as np

from jaxserve.core.plan import DeploymentPlan, InstanceSpec
from jaxserve.core.scheduling import (
    ColocatedRequest,
    DecodeLoad,
    PendingDecode,
    PrefillLoad,
    WaitingPrompt,
    admit_decodes,
    blocks_for,
    choose_decode_instance,
    choose_prefill_instance,
    form_prefill_batch,
    kv_tokens_reserved,
    prefill_buffer_free_slots,
    schedule_colocated,
)
from models.config import kv_heads_per_device
from placement.hardware import ClusterSpec
from placement.latency import (
    DeploymentKind,
    LatencyProvider,
    StageLatency,
    StepOverhead,
    kv_capacity_tokens,
)
from placement.sim_instances import ColocatedState, DecodeState, PrefillState, cut_after, instance_nodes, stage_link
from placement.sim_types import PHASES, SimMode, SimOptions, SimResult
from placement.step_time import decode_round_fn, decode_step_s, mixed_step_s

__all__ = ["PHASES", "SimMode", "SimOptions", "SimResult", "Simulator", "simulate"]
from placement.slo import SloSpec, VerdictTracker
from placement.workload import Workload

# Event kinds (the heap orders by time and then by scheduling order, never by kind).
_PREFILL_STAGE_FREE = 0
_PREFILL_DONE = 1
_TRANSFER_DONE = 2
_DECODE_ROUND_DONE = 3
_COLOC_STEP_DONE = 4

# Most decode rounds (or colocated decode-only steps) scheduled as one event: a join or an arrival cuts
# them, and beyond a few dozen the saving is spent.
_MAX_BATCHED_ROUNDS = 64


# ---------------------------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------------------------
class Simulator:
    """One run of one deployment over one workload. Construct, then `run()` once."""

    # Run what nothing can change as one event: decode rounds up to the next finish or join, a colocated
    # instance's repeated decode-only steps (the policy not asked again). The same timeline either way,
    # to the bit (`tests/test_simulator_events.py` compares with one event per round and a policy call
    # per step, what this flag off gives); only the work differs.
    coalesce: bool = True

    def __init__(
        self,
        plan: DeploymentPlan,
        latency: LatencyProvider,
        cluster: ClusterSpec,
        workload: Workload,
        slo: SloSpec | None = None,
        options: SimOptions | None = None,
    ) -> None:
        self.options = options or SimOptions()
        self.cluster = cluster
        self.latency = latency
        self.cfg = latency.cfg
        self.plan = (
            plan
            if plan.instances[0].devices is not None or plan.instances[0].nodes is not None
            else plan.assign_devices()
        )
        self.workload = workload
        self.slo = slo
        n = len(workload)
        self.arrival_at = workload.arrival_at
        self.input_lens = workload.input_lens
        self.output_lens = workload.output_lens
        # Python ints of the same lengths: the event handlers read one or a few at a time, where indexing a
        # numpy array (and summing a small slice of one) costs more than the arithmetic it feeds.
        self._input_list: list[int] = workload.input_lens.tolist()
        self._output_list: list[int] = workload.output_lens.tolist()
        self._arrival_list: list[float] = workload.arrival_at.tolist()
        nan = np.full(n, np.nan)
        self.prefill_start_at = nan.copy()
        self.first_token_at = nan.copy()
        self.transfer_start_at = nan.copy()
        self.transfer_end_at = nan.copy()
        self.decode_start_at = nan.copy()
        self.finish_at = nan.copy()
        self._prefilled = np.zeros(n, dtype=np.int64)  # colocated: prompt tokens with KV
        self._generated = np.zeros(n, dtype=np.int64)  # colocated: tokens emitted so far
        self.tracker = VerdictTracker(n, slo) if slo is not None and self.options.stop_early else None
        self._heap: list[tuple[float, int, int, int, object]] = []
        self._seq = 0
        self.now = 0.0
        self._next_arrival_at = math.inf  # of the request after the one being handled (`run`)
        self._round_fns: dict[tuple[int, int, int], Callable[[float], float]] = {}
        self.kv_bytes_per_token = self.cfg.kv_bytes_per_token
        # Decode rounds run as one event until the next finish unless a subclass changes what a round does
        # (the prefix cache's local prefills ride in rounds): then one event per round.
        cls = type(self)
        self._batch_rounds = self.coalesce and all(
            getattr(cls, name) is getattr(Simulator, name)
            for name in ("_decode_round_s", "_on_round_done", "_start_round")
        )
        engine: DeploymentKind = "colocated" if self.plan.kind == "colocated" else "disagg"
        # running sequences per decode / colocated instance: the profile's engine's cap, else the limit
        self.max_decode_batch = self.options.decode_batch_cap(latency.profile_decode_batch(engine))
        if self.plan.kind == "colocated":
            self.colocated = [
                ColocatedState(
                    model=latency.instance(
                        "colocated", i.tp, i.pp, stage_link(instance_nodes(i, cluster), cluster), i.quantization
                    ),
                    overhead=latency.step_overhead("colocated", i.tp, i.quantization),
                    free_blocks=self._kv_blocks(i),
                    chunk_size=i.chunk_size,
                    max_batch_tokens=self._token_cap("colocated", i.tp),
                )
                for i in self.plan.instances
            ]
            self.prefills: list[PrefillState] = []
            self.decodes: list[DecodeState] = []
        else:
            self.colocated = []
            self.prefills = [
                PrefillState(
                    model=latency.instance(
                        "disagg", i.tp, i.pp, stage_link(instance_nodes(i, cluster), cluster), i.quantization
                    ),
                    overhead=latency.step_overhead("disagg", i.tp, i.quantization),
                    max_batch_tokens=self._token_cap("disagg", i.tp),
                    capacity_tokens=kv_capacity_tokens(self.cfg, cluster.device, i.tp, i.pp, i.quantization),
                    nodes=instance_nodes(i, cluster),
                    stage_free_at=[0.0] * i.pp,
                )
                for i in self.plan.of_role("prefill")
            ]
            self.decodes = [
                DecodeState(
                    model=latency.instance(
                        "disagg", i.tp, i.pp, stage_link(instance_nodes(i, cluster), cluster), i.quantization
                    ),
                    overhead=latency.step_overhead("disagg", i.tp, i.quantization),
                    free_blocks=self._kv_blocks(i),
                    nodes=instance_nodes(i, cluster),
                )
                for i in self.plan.of_role("decode")
            ]
            self._link_free_at: dict[tuple[int, int], float] = {}
            prefill_specs = self.plan.of_role("prefill")
            decode_specs = self.plan.of_role("decode")
            self._link_s_per_byte = {
                (p, d): self._transfer_s_per_byte(
                    prefill_specs[p], self.prefills[p].nodes, decode_specs[d], self.decodes[d].nodes
                )
                for p in range(len(self.prefills))
                for d in range(len(self.decodes))
            }

    def _kv_blocks(self, inst: InstanceSpec) -> int:
        """KV blocks of a decode / colocated instance: the limit when set, else what its memory holds."""
        limits = self.options.limits
        if limits.num_kv_blocks is not None:
            return limits.num_kv_blocks
        return (
            kv_capacity_tokens(self.cfg, self.cluster.device, inst.tp, inst.pp, inst.quantization) // limits.block_size
        )

    def _token_cap(self, kind: DeploymentKind, tp: int) -> int:
        """Most prompt tokens one prefill step batches: the profile's engine cap or the limit (`SimOptions.token_cap`)."""
        return self.options.token_cap(self.latency.profile_token_cap(kind, tp))

    # ---- events ------------------------------------------------------------------------------
    def _push(self, at: float, kind: int, inst: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, inst, payload))

    def run(self) -> SimResult:
        n = len(self.workload)
        next_arrival = 0
        num_events = 0
        verdict: bool | None = None
        heap = self._heap
        arrivals = self.arrival_at.tolist()  # Python floats: the loop compares one per event
        tracker = self.tracker
        arrivals.append(math.inf)
        while next_arrival < n or heap:
            if heap and (next_arrival >= n or heap[0][0] <= arrivals[next_arrival]):
                at, _, kind, inst, payload = heapq.heappop(heap)
                self.now = at
                self._next_arrival_at = arrivals[next_arrival]
                self._dispatch(kind, inst, payload)
            else:
                self.now = arrivals[next_arrival]
                self._next_arrival_at = arrivals[next_arrival + 1]
                self._on_arrival(next_arrival)
                next_arrival += 1
            num_events += 1
            if tracker is not None:
                verdict = tracker.verdict()
                if verdict is not None:
                    break
        if verdict is None and self.slo is not None:
            verdict = self._final_verdict(self.slo)
        return SimResult(
            arrival_at=self.arrival_at,
            output_lens=self.output_lens,
            prefill_start_at=self.prefill_start_at,
            first_token_at=self.first_token_at,
            transfer_start_at=self.transfer_start_at,
            transfer_end_at=self.transfer_end_at,
            decode_start_at=self.decode_start_at,
            finish_at=self.finish_at,
            verdict=verdict,
            num_events=num_events,
        )

    def _final_verdict(self, slo: SloSpec) -> bool:
        result = SimResult(
            self.arrival_at, self.output_lens, self.prefill_start_at, self.first_token_at, self.transfer_start_at,
            self.transfer_end_at, self.decode_start_at, self.finish_at,
        )  # fmt: skip
        return result.attainment(slo) >= slo.attainment - 1e-12

    def _dispatch(self, kind: int, inst: int, payload: object) -> None:
        if kind == _PREFILL_STAGE_FREE:
            self._try_start_prefill(inst)
        elif kind == _PREFILL_DONE:
            assert isinstance(payload, list)
            self._on_prefill_done(inst, payload)
        elif kind == _TRANSFER_DONE:
            assert isinstance(payload, tuple)
            self._on_transfer_done(inst, *payload)
        elif kind == _DECODE_ROUND_DONE:
            assert isinstance(payload, int)
            self._on_rounds_done(inst, payload)
        elif kind == _COLOC_STEP_DONE:
            assert isinstance(payload, tuple)
            self._on_coloc_step_done(inst, payload)

    def _on_arrival(self, i: int) -> None:
        if self.colocated:
            loads = [PrefillLoad(c.waiting_tokens, len(c.waiting)) for c in self.colocated]
            k = self._route_colocated(i, loads)  # prefix-cache hook
            c = self.colocated[k]
            c.waiting.append(i)
            c.records[i] = ColocatedRequest(str(i), self._input_list[i], self._output_list[i])
            c.waiting_tokens += self._input_list[i]
            c.steady = None
            if c.busy:
                self._cut_steps(k)
            else:
                self._coloc_step(k)
            return
        if self.options.mode == "decode":
            self.first_token_at[i] = self.prefill_start_at[i] = self.now
            self._first_token(i)
            return
        loads = [
            PrefillLoad(p.queued_tokens + p.inflight_tokens, len(p.queue) + p.inflight_requests) for p in self.prefills
        ]
        k = self._route_prefill(i, loads)  # prefix-cache hook; -1: no prefill instance (local prefill)
        if k < 0:
            return
        p = self.prefills[k]
        p.queue.append(WaitingPrompt(str(i), self._input_list[i]))
        p.queued_tokens += self._input_list[i]
        self._try_start_prefill(k)

    # ---- prefill -----------------------------------------------------------------------------
    def _try_start_prefill(self, k: int) -> None:
        p = self.prefills[k]
        if not p.queue or p.stage_free_at[0] > self.now:
            return
        # Backpressure: the batch must fit in what is left of the KV buffer, in memory and in slots.
        room = p.capacity_tokens - p.buffer_tokens - p.inflight_tokens
        slots = self.options.limits.prefill_buffer_slots if self.options.bounded_prefill_buffer else None
        free = len(p.queue)
        if slots is not None and self.options.mode != "prefill":  # prefill-only runs never buffer
            free = prefill_buffer_free_slots(slots, p.buffer_requests, p.inflight_requests)
        fit = taken = 0
        for w in p.queue:
            if w.num_prompt_tokens > room:
                break
            room -= w.num_prompt_tokens
            taken += w.num_prompt_tokens
            fit += 1
            if taken >= p.max_batch_tokens:  # the batch ends here at the latest (form_prefill_batch's cap)
                break
        n = len(form_prefill_batch(p.queue, p.max_batch_tokens, min(fit, free)))
        if n == 0:
            return
        batch = self._defer_repeats(k, [int(p.queue.popleft().request_id) for _ in range(n)])  # prefix-cache hook
        if not batch:
            return
        n = len(batch)
        lengths = self._input_list
        total = sum(lengths[i] for i in batch)
        p.queued_tokens -= total
        p.inflight_tokens += total
        p.inflight_requests += n
        self.prefill_start_at[batch] = self.now
        stage_s = self._prefill_stage_s(k, batch)  # prefix-cache hook
        send_s = p.model.send_s(total) if p.model.pp > 1 else 0.0
        host_s = p.overhead.step_s(total, p.model.pp, True)  # on the first stage, once per step
        t = self.now
        for s in range(p.model.pp):
            start = max(t, p.stage_free_at[s])
            # the host work delays the batch itself too: alone it is done after `prefill_step_s`
            p.stage_free_at[s] = start + stage_s + (host_s if s == 0 else 0.0)
            t = p.stage_free_at[s] + send_s
        self._push(p.stage_free_at[-1], _PREFILL_DONE, k, batch)
        if p.model.pp > 1:  # the next batch may enter then (the runtime's watcher wakes its loop then)
            self._push(p.stage_free_at[0], _PREFILL_STAGE_FREE, k)

    def _on_prefill_done(self, k: int, batch: list[int]) -> None:
        p = self.prefills[k]
        lengths = self._input_list
        total = sum(lengths[i] for i in batch)
        p.inflight_tokens -= total
        p.inflight_requests -= len(batch)
        for i in batch:
            self.first_token_at[i] = self.now
            if self.options.mode == "prefill":
                self._first_token(i, finish_now=True)
            else:
                p.buffer_tokens += self._input_list[i]
                p.buffer_requests += 1
                self._first_token(i, src=k)
        if p.model.pp == 1:
            self._try_start_prefill(k)

    def _first_token(self, i: int, src: int = -1, finish_now: bool = False) -> None:
        ttft_ok = self.slo is None or self.now - self._arrival_list[i] <= self.slo.ttft_s
        if self.tracker is not None:
            self.tracker.record_ttft(ttft_ok)
        if finish_now or self._output_list[i] == 1:
            self.finish_at[i] = self.now
            if self.tracker is not None:
                self.tracker.record_done(ttft_ok, True)
            if src >= 0:
                self._release_buffer(src, i)
            return
        loads = [
            DecodeLoad(d.num_running + len(d.joining) + d.num_transferring, len(d.pending), d.free_blocks)
            for d in self.decodes
        ]
        k = self._route_decode(i, loads)  # prefix-cache hook
        d = self.decodes[k]
        d.pending.append((PendingDecode(str(i), self._input_list[i], self._output_list[i]), i, src))
        self._try_admit(k)

    def _release_buffer(self, src: int, i: int) -> None:
        p = self.prefills[src]
        p.buffer_tokens -= self._input_list[i]
        p.buffer_requests -= 1
        self._try_start_prefill(src)

    # ---- decode ------------------------------------------------------------------------------
    def _try_admit(self, k: int) -> None:
        d = self.decodes[k]
        if not d.pending:
            return
        num_running = d.num_running + len(d.joining) + d.num_transferring
        room = self.max_decode_batch - num_running
        if room <= 0:
            return
        head = [d.pending[j][0] for j in range(min(room, len(d.pending)))]
        admission = admit_decodes(
            head,
            num_free_blocks=d.free_blocks,
            num_running=num_running,
            max_batch_size=self.max_decode_batch,
            block_size=self.options.limits.block_size,
        )
        for reservation in admission.admitted:
            req, i, src = d.pending.popleft()
            d.free_blocks -= self._reserve_decode_blocks(k, i, req, reservation.num_blocks)  # prefix-cache hook
            self.transfer_start_at[i] = self.now
            if self._admit_without_transfer(k, i, src):  # prefix-cache hook: local prefill
                continue
            if src < 0:  # decode-only mode: the KV is already there
                self.transfer_end_at[i] = self.now
                d.joining.append(i)
                self._cut_rounds(k)
                continue
            link = (src, k)
            start = max(self.now, self._link_free_at.get(link, 0.0))
            end = (
                start
                + self.cluster.link_latency_s
                + self._transfer_tokens(k, i) * self.kv_bytes_per_token * self._link_s_per_byte[link]
            )
            self._link_free_at[link] = end
            d.num_transferring += 1
            self._push(end, _TRANSFER_DONE, k, (i, src))
        if not d.busy and self._decode_has_work(k):  # prefix-cache hook
            self._start_round(k)

    def _transfer_s_per_byte(
        self, p_spec: InstanceSpec, p_nodes: tuple[int, ...], d_spec: InstanceSpec, d_nodes: tuple[int, ...]
    ) -> float:
        """Seconds per KV byte between two instances.

        Inside a node (every prefill stage on the node of the matching decode stage, or all on one
        node) each of the min(#devices) device pairs moves its share over NVLink in parallel; across
        nodes the whole KV crosses the inter-node network. A decode instance whose tp replicates the K/V
        heads (tp a multiple of them, `models.config.kv_heads_split`) needs every head on each device of a
        stage: inside a node that is `copies` times the bytes over the same links; across nodes the KV
        crosses once (the copies inside the receiving node are not charged).
        """
        same = (len(p_nodes) == len(d_nodes) and p_nodes == d_nodes) or len(set(p_nodes) | set(d_nodes)) == 1
        if same:
            pairs = min(p_spec.num_devices, d_spec.num_devices)
            copies = d_spec.tp * kv_heads_per_device(self.cfg, d_spec.tp) // self.cfg.kv_heads  # 1 when split
            return copies / (pairs * self.cluster.nvlink_bandwidth)
        return 1.0 / self.cluster.inter_node_bandwidth

    def _on_transfer_done(self, k: int, i: int, src: int) -> None:
        d = self.decodes[k]
        d.num_transferring -= 1
        self.transfer_end_at[i] = self.now
        d.joining.append(i)
        self._cut_rounds(k)
        self._release_buffer(src, i)  # the KV has left the prefill instance's buffer
        if not d.busy:
            self._start_round(k)

    def _round_fn(self, model: StageLatency, overhead: StepOverhead, batch: int) -> Callable[[float], float]:
        """`decode_step_s` of an instance's model at one batch size, as a function of the context (cached)."""
        key = (id(model), id(overhead), batch)
        fn = self._round_fns.get(key)
        if fn is None:
            fn = self._round_fns[key] = decode_round_fn(model, overhead, batch)
        return fn

    def _cut_rounds(self, k: int) -> None:
        """A request joins decode instance `k`: it enters at the end of the round now running, so the
        rounds scheduled as one event stop there."""
        d = self.decodes[k]
        end = cut_after(d.round_ends, self.now)
        if end is not None:
            d.generation += 1
            self._push(end, _DECODE_ROUND_DONE, k, d.generation)

    def _start_round(self, k: int) -> None:
        d = self.decodes[k]
        for j in d.joining:
            # Request j runs rounds rounds_done .. rounds_done + out - 2 (its first token came from
            # prefill), with context input + 1 in its first round.
            self.decode_start_at[j] = self.now
            heapq.heappush(d.finish_heap, (d.rounds_done + self._output_list[j] - 2, j))
            d.num_running += 1
            d.ctx_sum += self._input_list[j] + 1
        d.joining = []
        if not self._batch_rounds:
            round_s = self._decode_round_s(k)  # prefix-cache hook
            if d.num_running == 0 and round_s <= 0.0:
                d.busy = False
                return
            ends = [self.now + round_s]
        else:
            # Until the next request finishes nothing but a join changes a round (its size is fixed and
            # every request gains one token of context), so the rounds up to that one are scheduled as
            # one event, their ends computed as one-event-per-round would (each end = previous end + its
            # round); a join cuts them at the round it lands in (`_cut_rounds`). At most _MAX_BATCHED_ROUNDS.
            # Joins come with arrivals (decode mode) or after them (transfers), so computing rounds past the
            # next arrival would mostly be wasted on a cut: stop at the first round that ends after it.
            if d.num_running == 0:
                d.busy = False
                return
            round_s_at = self._round_fn(d.model, d.overhead, d.num_running)  # = _decode_round_s at this size
            ends = [self.now + round_s_at(d.ctx_sum)]
            more = min(d.finish_heap[0][0] - d.rounds_done, _MAX_BATCHED_ROUNDS - 1)
            ctx = d.ctx_sum
            horizon = self._next_arrival_at
            for _ in range(more):
                if ends[-1] > horizon:
                    break
                ctx += d.num_running
                ends.append(ends[-1] + round_s_at(ctx))
        d.busy = True
        d.round_ends = ends
        d.generation += 1
        self._push(ends[-1], _DECODE_ROUND_DONE, k, d.generation)

    def _on_rounds_done(self, k: int, generation: int) -> None:
        d = self.decodes[k]
        if generation != d.generation:
            return  # rescheduled by a join (`_cut_rounds`)
        silent = len(d.round_ends) - 1  # rounds before the last one scheduled: nobody finished in them
        d.round_ends = []
        d.ctx_sum += silent * d.num_running
        d.rounds_done += silent
        self._on_round_done(k)

    def _on_round_done(self, k: int) -> None:
        d = self.decodes[k]
        d.ctx_sum += d.num_running  # every running request gained a token
        finished = False
        while d.finish_heap and d.finish_heap[0][0] == d.rounds_done:
            _, j = heapq.heappop(d.finish_heap)
            finished = True
            n_in, n_out = self._input_list[j], self._output_list[j]
            self.finish_at[j] = self.now
            d.num_running -= 1
            d.ctx_sum -= n_in + n_out
            d.free_blocks += self._release_decode_blocks(k, j)  # prefix-cache hook
            if self.tracker is not None:
                assert self.slo is not None
                ttft_ok = self.first_token_at[j] - self.arrival_at[j] <= self.slo.ttft_s
                tpot_ok = (self.now - self.first_token_at[j]) / (n_out - 1) <= self.slo.tpot_s
                self.tracker.record_done(bool(ttft_ok), bool(tpot_ok))
        d.rounds_done += 1
        if finished:
            self._try_admit(k)
        self._start_round(k)

    # ---- prefix-cache hooks (>>> placement/prefix_sim.py overrides these; defaults: no cache) ----
    def _route_prefill(self, i: int, loads: list[PrefillLoad]) -> int:
        return choose_prefill_instance(loads)

    def _defer_repeats(self, k: int, batch: list[int]) -> list[int]:
        """The members of prefill instance `k`'s next batch that run now; the rest go back to its queue head."""
        return batch

    def _prefill_stage_s(self, k: int, batch: list[int]) -> float:
        lengths = [self._input_list[i] for i in batch]
        return self.prefills[k].model.prefill_stage_s(
            float(sum(lengths)), float(sum(n * n for n in lengths)), len(batch)
        )

    def _route_decode(self, i: int, loads: list[DecodeLoad]) -> int:
        return choose_decode_instance(loads)

    def _reserve_decode_blocks(self, k: int, i: int, req: PendingDecode, num_blocks: int) -> int:
        """Blocks taken from decode instance `k`'s pool for request `i` (the admission decided `num_blocks`)."""
        return num_blocks

    def _release_decode_blocks(self, k: int, i: int) -> int:
        n_tokens = kv_tokens_reserved(self._input_list[i], self._output_list[i])
        return blocks_for(n_tokens, self.options.limits.block_size)

    def _admit_without_transfer(self, k: int, i: int, src: int) -> bool:
        return False

    def _transfer_tokens(self, k: int, i: int) -> int:
        return self._input_list[i]

    def _decode_has_work(self, k: int) -> bool:
        return bool(self.decodes[k].joining)

    def _decode_round_s(self, k: int) -> float:
        d = self.decodes[k]
        return decode_step_s(d.model, d.overhead, d.num_running, d.ctx_sum)

    def _route_colocated(self, i: int, loads: list[PrefillLoad]) -> int:
        return choose_prefill_instance(loads)

    def _reserve_colocated_blocks(self, k: int, i: int, num_blocks: int) -> int:
        """Blocks taken from colocated instance `k`'s pool for request `i`; may set `_prefilled[i]` (a hit)."""
        return num_blocks

    def _colocated_prompt_done(self, k: int, i: int) -> None:
        return None

    def _release_colocated_blocks(self, k: int, i: int) -> int:
        n_tokens = kv_tokens_reserved(self._input_list[i], self._output_list[i])
        return blocks_for(n_tokens, self.options.limits.block_size)

    # <<< prefix-cache hooks ----------------------------------------------------------------------

    # ---- colocated ---------------------------------------------------------------------------
    def _coloc_step(self, k: int) -> None:
        c = self.colocated[k]
        if c.steady is not None and self.coalesce:  # nothing the policy saw changed since a decode-only step
            # The same decode step repeats until a request finishes or one arrives: schedule those steps
            # as one event (ends computed as step-by-step would), cut by an arrival (`_cut_steps`).
            steady_idx, ctx = c.steady
            n = len(steady_idx)
            c.busy = True
            round_s_at = self._round_fn(c.model, c.overhead, n)  # a step of decodes only
            ends = [self.now + round_s_at(float(ctx))]
            first_finish = int((self.output_lens[steady_idx] - self._generated[steady_idx]).min())
            horizon = self._next_arrival_at
            for _ in range(min(first_finish, _MAX_BATCHED_ROUNDS) - 1):
                if ends[-1] > horizon:
                    break
                ctx += n
                ends.append(ends[-1] + round_s_at(float(ctx)))
            c.step_ends, c.step_decodes = ends, steady_idx
            c.generation += 1
            self._push(ends[-1], _COLOC_STEP_DONE, k, ((), steady_idx, c.generation))
            return
        opts = self.options
        budget = max(c.max_batch_tokens, c.chunk_size or 0)
        head = list(itertools.islice(c.waiting, min(budget, self.max_decode_batch)))
        records = c.records
        reqs = [records[i] for i in c.admitted] + [records[i] for i in head]
        step = schedule_colocated(
            reqs,
            num_free_blocks=c.free_blocks,
            block_size=opts.limits.block_size,
            max_batch_size=self.max_decode_batch,
            max_batch_tokens=c.max_batch_tokens,
            chunk_size=c.chunk_size,
        )
        if step.is_idle:
            c.busy = False
            return
        for reservation in step.admit:
            i = c.waiting.popleft()  # admission is an FCFS prefix of the waiting queue
            assert str(i) == reservation.request_id
            c.waiting_tokens -= self._input_list[i]
            c.admitted.append(i)
            c.free_blocks -= self._reserve_colocated_blocks(k, i, reservation.num_blocks)  # prefix-cache hook
            r = c.records[i]  # (what dataclasses.replace builds, without its per-call introspection)
            c.records[i] = ColocatedRequest(
                r.request_id, r.num_prompt_tokens, r.max_new_tokens, int(self._prefilled[i]), True
            )
            self.prefill_start_at[i] = self.now
        decode_idx = np.asarray([int(r) for r in step.decode], dtype=np.int64)
        decode_ctx = (
            self.input_lens[decode_idx] + self._generated[decode_idx]
            if len(decode_idx)
            else np.zeros(0, dtype=np.int64)
        )
        # A chunk starts after what is already prefilled: the policy cut it before a cache hit on
        # admission (this step) skipped the cached prefix, as the runtime's colocated instance does.
        # Without caching `_prefilled` equals every chunk's start, and nothing changes.
        cut = []
        for ch in step.prefill:
            i = int(ch.request_id)
            start = max(ch.start, int(self._prefilled[i]))
            if start < ch.start + ch.num_tokens:
                cut.append((i, start, ch.start + ch.num_tokens - start))
        chunks = [n for _, _, n in cut]
        priors = [start for _, start, _ in cut]
        ctx_total = int(decode_ctx.sum())
        dt = mixed_step_s(c.model, c.overhead, chunks, priors, len(decode_idx), float(ctx_total))
        c.busy = True
        if not step.admit and not step.prefill:
            c.steady = (decode_idx, ctx_total)
        c.step_ends, c.step_decodes = [self.now + dt], decode_idx
        c.generation += 1
        self._push(c.step_ends[0], _COLOC_STEP_DONE, k, (tuple((i, n) for i, _, n in cut), decode_idx, c.generation))

    def _cut_steps(self, k: int) -> None:
        """A request arrives at colocated instance `k`: the policy decides again after the step now
        running, so steady steps scheduled as one event stop there."""
        c = self.colocated[k]
        end = cut_after(c.step_ends, self.now)
        if end is not None:
            c.generation += 1
            self._push(end, _COLOC_STEP_DONE, k, ((), c.step_decodes, c.generation))

    def _on_coloc_step_done(self, k: int, payload: tuple) -> None:
        c = self.colocated[k]
        chunks, decode_idx, generation = payload
        if generation != c.generation:
            return  # rescheduled by an arrival (`_cut_steps`)
        silent = len(c.step_ends) - 1  # steady steps before the last: every request gained a token, none finished
        c.step_ends = []
        if silent:
            self._generated[decode_idx] += silent
            if c.steady is not None:
                c.steady = (c.steady[0], c.steady[1] + silent * len(decode_idx))
        done: list[int] = []
        for i, num in chunks:
            self._prefilled[i] += num
            r = c.records[i]
            c.records[i] = ColocatedRequest(
                r.request_id, r.num_prompt_tokens, r.max_new_tokens, int(self._prefilled[i]), r.admitted
            )
            if self._prefilled[i] >= self.input_lens[i]:
                self._colocated_prompt_done(k, i)  # prefix-cache hook
                self.first_token_at[i] = self.decode_start_at[i] = self.now
                self.transfer_start_at[i] = self.transfer_end_at[i] = self.now
                self._generated[i] = 1
                ttft_ok = self.slo is None or self.now - self._arrival_list[i] <= self.slo.ttft_s
                if self.tracker is not None:
                    self.tracker.record_ttft(ttft_ok)
                if self._output_list[i] == 1:
                    done.append(i)
        if len(decode_idx):
            self._generated[decode_idx] += 1
            finished = decode_idx[self._generated[decode_idx] >= self.output_lens[decode_idx]]
            done.extend(int(i) for i in finished)
        if chunks or done:
            c.steady = None
        elif c.steady is not None:  # every request of the decode-only step gained a token of context
            c.steady = (c.steady[0], c.steady[1] + len(decode_idx))
        for i in done:
            self.finish_at[i] = self.now
            c.admitted.remove(i)
            del c.records[i]
            c.free_blocks += self._release_colocated_blocks(k, i)  # prefix-cache hook
            if self.tracker is not None:
                assert self.slo is not None
                ttft_ok = self.first_token_at[i] - self.arrival_at[i] <= self.slo.ttft_s
                tpot = (self.now - self.first_token_at[i]) / max(self._output_list[i] - 1, 1)
                self.tracker.record_done(bool(ttft_ok), bool(tpot <= self.slo.tpot_s or self._output_list[i] == 1))
        self._coloc_step(k)


def simulate(
    plan: DeploymentPlan,
    latency: LatencyProvider,
    cluster: ClusterSpec,
    workload: Workload,
    slo: SloSpec | None = None,
    options: SimOptions | None = None,
) -> SimResult:
    """Simulate `plan` serving `workload`; with `slo`, stop once the verdict is certain."""
    return Simulator(plan, latency, cluster, workload, slo, options).run()
