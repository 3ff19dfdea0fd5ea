"""What each simulated instance holds between events: a prefill pipe, a decode batch, a colocated engine.

The event loop (`placement/simulator.py`) owns these records and changes them; they hold no behaviour but
small helpers of placement (the nodes of an instance's stages, the slowest link between them) and of
coalesced steps (`cut_after`).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import deque

import numpy as np

from jaxserve.core.plan import InstanceSpec
from jaxserve.core.scheduling import ColocatedRequest, PendingDecode, WaitingPrompt
from placement.hardware import ClusterSpec
from placement.latency import StageLatency, StepOverhead


# ---------------------------------------------------------------------------------------------
# Instance state
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PrefillState:
    model: StageLatency
    overhead: StepOverhead
    max_batch_tokens: int
    capacity_tokens: int
    nodes: tuple[int, ...]
    stage_free_at: list[float]
    queue: deque[WaitingPrompt] = dataclasses.field(default_factory=deque)
    queued_tokens: int = 0
    inflight_tokens: int = 0
    inflight_requests: int = 0
    buffer_tokens: int = 0
    buffer_requests: int = 0


@dataclasses.dataclass
class DecodeState:
    model: StageLatency
    overhead: StepOverhead
    free_blocks: int
    nodes: tuple[int, ...]
    pending: deque[tuple[PendingDecode, int, int]] = dataclasses.field(default_factory=deque)  # (req, idx, src)
    num_transferring: int = 0
    joining: list[int] = dataclasses.field(default_factory=list)
    # The running batch as aggregates: a round's time depends only on its size and total context, and
    # every running request gains one context token per round, so a round costs O(1) plus O(finished).
    num_running: int = 0
    ctx_sum: int = 0
    rounds_done: int = 0
    finish_heap: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (last round, request)
    busy: bool = False
    # Rounds run as one event (`Simulator._start_round`): when each of the scheduled rounds ends, and the
    # generation of the one event that ends them (a cut reschedules it; the old one is then stale).
    round_ends: list[float] = dataclasses.field(default_factory=list)
    generation: int = 0


@dataclasses.dataclass
class ColocatedState:
    model: StageLatency
    overhead: StepOverhead
    free_blocks: int
    chunk_size: int | None
    max_batch_tokens: int  # prefill-priority step budget: SimOptions' if set, else the profile's L_m
    admitted: list[int] = dataclasses.field(default_factory=list)  # arrival order
    # The policy's view of each request, rebuilt only when it changes (admission, prefill progress).
    records: dict[int, ColocatedRequest] = dataclasses.field(default_factory=dict)
    waiting: deque[int] = dataclasses.field(default_factory=deque)
    waiting_tokens: int = 0
    busy: bool = False
    # The policy is a pure function of the records, the waiting head and the free blocks, none of which a
    # decode-only step changes (the records carry no generated-token count). So after a decode-only step
    # the next step is the same decode until an arrival, an admission or a completion: remember it as
    # (requests, their total context) and skip the policy until then. Exact, and most steps of a loaded
    # instance are such steps.
    steady: tuple[np.ndarray, int] | None = None
    # Steady steps run as one event until the next finish or arrival (as a decode instance's rounds):
    # when each scheduled step ends, the requests they decode, and the generation of the event.
    step_ends: list[float] = dataclasses.field(default_factory=list)
    step_decodes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    generation: int = 0


def cut_after(ends: list[float], now: float) -> float | None:
    """Steps scheduled as one event, ending at `ends`: keep them up to the one running at `now` and return
    its end, where the event must now fire; None when that is the last one anyway (nothing to move)."""
    j = bisect.bisect_right(ends, now)  # the step in progress ends at ends[j]
    if j >= len(ends) - 1:
        return None
    del ends[j + 1 :]
    return ends[j]


def instance_nodes(inst: InstanceSpec, cluster: ClusterSpec) -> tuple[int, ...]:
    if inst.nodes is not None:
        return inst.nodes
    assert inst.devices is not None
    return tuple(cluster.node_of(inst.stage_devices(s)[0]) for s in range(inst.pp))


def stage_link(nodes: tuple[int, ...], cluster: ClusterSpec) -> float:
    """The slowest link between adjacent stages."""
    if len(nodes) < 2:
        return cluster.nvlink_bandwidth
    return min(cluster.bandwidth_between_nodes(a, b) for a, b in itertools.pairwise(nodes))
