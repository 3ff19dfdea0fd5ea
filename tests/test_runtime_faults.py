"""Failures cost one request, never an instance: failed pulls, dead instances, cancels in the hand-off gap.

Embedded backend over the hand-computable fake engine (every stream is checked
token by token against `reference_tokens`), plus one seeded-sampling re-route
on the tiny OPT.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import jax
import pytest

from jaxserve.core.errors import EngineDeadError
from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.core.request import FinishReason, GenerateRequest, RequestTimings, SamplingParams
from jaxserve.core.scheduling import PrefillLoad
from jaxserve.runtime.colocated_instance import ColocatedConfig, ColocatedInstance
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import (
    Engine,
    KVPages,
    PrefilledSequence,
    PrefillItem,
    PrefillResult,
    StepBatch,
)
from jaxserve.runtime.engines.fake import FakeEngine, fake_engine_factory, reference_tokens
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.kv_connectors.base import KVTransferError, PullFailureConfig, TransferState
from jaxserve.runtime.kv_connectors.in_process import InProcessHandle, InProcessTransfer
from jaxserve.runtime.worker import FaultKind, LiveRequest, Worker
from models.config import get_config

CFG = get_config("opt-tiny")  # vocab 512, 256 positions
V = CFG.vocab_size


def _req(rid: str, prompt: Sequence[int], max_tokens: int = 8, **kw: object) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))  # type: ignore[arg-type]


LIMITS = ServingLimits(block_size=8, num_kv_blocks=64)


def _controller(
    spec: str, factory=None, transfer=None, cls=Controller, limits: ServingLimits = LIMITS, **overrides
) -> Controller:
    config = ControllerConfig(limits=limits, **overrides)
    plan = parse_deployment(spec)
    c = cls(build_engines(plan, factory or fake_engine_factory(CFG)), plan, config, transfer=transfer)
    c.start()
    return c


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


# ---- transfers whose outcome the test controls ------------------------------------------------


class _FailedHandle:
    """A pull that failed (the KV never arrived)."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def num_bytes(self) -> int:
        return 0

    @property
    def seconds(self) -> float | None:
        return 0.0

    def poll(self) -> TransferState:
        return TransferState.FAILED

    def wait(self, timeout_s: float | None = None) -> TransferState:
        return TransferState.FAILED

    def insert(self, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        raise AssertionError("a failed pull must never be inserted")


class _FlakyTransfer:
    """The in-process transfer, except that the pulls numbered in `fail_on` (1-based) fail."""

    def __init__(self, engine: Engine, fail_on: set[int]) -> None:
        self.inner = InProcessTransfer(engine)
        self.fail_on = fail_on
        self.num_started = 0

    def start(self, seq: PrefilledSequence) -> InProcessHandle | _FailedHandle:
        self.num_started += 1
        if self.num_started in self.fail_on:
            return _FailedHandle(seq.request_id)
        return self.inner.start(seq)


class _GatedHandle:
    """An in-process pull that stays PENDING until the test opens the gate."""

    def __init__(self, inner: InProcessHandle, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    @property
    def request_id(self) -> str:
        return self.inner.request_id

    @property
    def num_bytes(self) -> int:
        return self.inner.num_bytes

    @property
    def seconds(self) -> float | None:
        return self.inner.seconds

    def poll(self) -> TransferState:
        return self.inner.poll() if self.gate.is_set() else TransferState.PENDING

    def wait(self, timeout_s: float | None = None) -> TransferState:
        self.gate.wait(timeout_s)
        return self.poll()

    def insert(self, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        return self.inner.insert(num_tokens, pages, block_table)


class _GatedTransfer:
    def __init__(self, engine: Engine, gated: set[str], gate: threading.Event) -> None:
        self.inner = InProcessTransfer(engine)
        self.gated, self.gate = gated, gate

    def start(self, seq: PrefilledSequence) -> InProcessHandle | _GatedHandle:
        handle = self.inner.start(seq)
        return _GatedHandle(handle, self.gate) if seq.request_id in self.gated else handle


# ---- 1. a failed pull costs exactly that request's pull --------------------------------------


@pytest.mark.parametrize(
    ("retries", "policy"), [(1, "recompute"), (0, "recompute"), (0, "fail")], ids=["retry", "recompute", "fail"]
)
def test_a_failed_pull_costs_one_request_never_the_decode_instance(retries: int, policy: str) -> None:
    transfers: list[_FlakyTransfer] = []

    def make(engine: Engine) -> _FlakyTransfer:
        transfers.append(_FlakyTransfer(engine, fail_on={2}))
        return transfers[-1]

    c = _controller(
        "disagg:prefill=tp1,decode=tp1",
        transfer=make,
        pull_failure=PullFailureConfig(num_retries=retries, on_failure=policy),
    )
    try:
        long_prompt, victim_prompt, other_prompt = (5, 6, 7), (8, 9, 10, 11), (12, 13)
        long = c.submit(_req("long", long_prompt, max_tokens=200))
        _wait_for(lambda: c.decode_instances[0].num_running == 1)  # its pull (the first) is done
        victim = c.submit(_req("victim", victim_prompt, max_tokens=20))  # the second pull fails
        other = c.submit(_req("other", other_prompt, max_tokens=20))
        if policy == "fail":
            with pytest.raises(KVTransferError, match="victim"):
                victim.collect(timeout_s=30)
        else:
            assert victim.collect(timeout_s=30)[0] == reference_tokens(victim_prompt, 20, V)
        assert other.collect(timeout_s=30)[0] == reference_tokens(other_prompt, 20, V)
        assert long.collect(timeout_s=60)[0] == reference_tokens(long_prompt, 200, V)
        # the instance is alive and takes new work
        assert c.decode_instances[0].error is None and all(s.alive for s in c.stats().instances)
        assert c.submit(_req("new", (3, 4), max_tokens=5)).collect(30)[0] == reference_tokens((3, 4), 5, V)
        faults = c.stats().faults
        assert faults.num_failed_pulls == 1
        assert (faults.num_pull_retries, faults.num_recomputed) == {
            "retry": (1, 0), "recompute": (0, 1), "fail": (0, 0)
        }[("retry" if retries else policy)]  # fmt: skip
        assert c.decode_instances[0].cache.num_available == 64  # the failed pull's blocks came back
        assert c.prefill_instances[0].buffer_used == 0
    finally:
        c.shutdown(drain_timeout_s=0)


class _LostOnceOpenHandle(_GatedHandle):
    """PENDING until the test opens the gate, then FAILED: its holder went away meanwhile."""

    def poll(self) -> TransferState:
        return TransferState.FAILED if self.gate.is_set() else TransferState.PENDING


class _LosingTransfer(_GatedTransfer):
    """The in-process transfer, except that the first pull of each request in `gated` fails once the gate opens."""

    def start(self, seq: PrefilledSequence) -> InProcessHandle | _LostOnceOpenHandle:
        if seq.request_id not in self.gated:
            return self.inner.start(seq)
        self.gated.discard(seq.request_id)  # its first pull only: a second one (after a re-route) succeeds
        return _LostOnceOpenHandle(self.inner.start(seq), self.gate)


def test_a_pull_from_a_prefill_instance_retired_by_force_is_prefilled_again_whatever_the_policy() -> None:
    # A switch retires a prefill instance by force (its drain timed out) while a decode instance still pulls a
    # KV it held: the pull fails. Under on_failure="fail" that failed the stream, though the request did
    # nothing wrong and a live prefill instance remains; now it is prefilled again there, as when the holder dies.
    gate = threading.Event()
    c = _controller(
        "disagg:prefill=2xtp1,decode=tp1",
        transfer=lambda engine: _LosingTransfer(engine, {"held"}, gate),
        pull_failure=PullFailureConfig(num_retries=0, on_failure="fail"),
    )
    try:
        held = c.submit(_req("held", (5, 6, 7), max_tokens=10))
        _wait_for(lambda: c.decode_instances[0].num_pulling == 1)  # its pull is in flight, the gate shut
        (holder,) = [p for p in c.prefill_instances if p.get("held") is not None]
        (other,) = [p for p in c.prefill_instances if p is not holder]
        c.switch_steps.route([other.name, c.decode_instances[0].name])  # what a switch does: the holder retires
        c.switch_steps.retire_drained(force=True)  # its drain timed out: stopped, its buffer dropped
        assert not holder.alive and holder.error is None
        gate.set()  # the pull now fails
        assert held.collect(timeout_s=30)[0] == reference_tokens((5, 6, 7), 10, V)
        assert c.stats().faults.num_rerouted_requests >= 1
        assert c.decode_instances[0].cache.num_available == 64 and other.buffer_used == 0
    finally:
        gate.set()
        c.shutdown(drain_timeout_s=0)


# ---- 6. pulls overlap decoding -----------------------------------------------------------------


def test_a_slow_pull_does_not_stall_the_running_streams() -> None:
    gate = threading.Event()

    def make(engine: Engine) -> _GatedTransfer:
        return _GatedTransfer(engine, {"slow"}, gate)

    c = _controller("disagg:prefill=tp1,decode=tp1", transfer=make)
    try:
        running = c.submit(_req("running", (5, 6, 7), max_tokens=120))
        first = running.next_chunk(timeout_s=30)
        assert first is not None
        slow = c.submit(_req("slow", (8, 9), max_tokens=10))
        _wait_for(lambda: c.decode_instances[0].num_pulling == 1)  # admitted, pull in flight, gate shut
        steps_before = c.decode_instances[0].engine.num_decode_calls  # type: ignore[attr-defined]
        got = [*first.token_ids]
        while len(got) < 40:  # the running stream keeps getting tokens while the pull hangs
            chunk = running.next_chunk(timeout_s=10)
            assert chunk is not None
            got.extend(chunk.token_ids)
        assert c.decode_instances[0].num_pulling == 1 and not slow.finished
        assert c.decode_instances[0].engine.num_decode_calls >= steps_before + 30  # type: ignore[attr-defined]
        gate.set()  # the pull completes: it joins the batch at the next step boundary
        assert slow.collect(timeout_s=30)[0] == reference_tokens((8, 9), 10, V)
        rest, last = running.collect(timeout_s=30)
        assert got + rest == reference_tokens((5, 6, 7), 120, V) and last.finish_reason == "length"
    finally:
        gate.set()
        c.shutdown(drain_timeout_s=0)


# ---- 3. a cancel between the prefill result and the decode hand-off ------------------------------


class _CancelOnFirstToken(Controller):
    """Cancels request "zombie" the moment its first token is emitted: after its prefill, before its hand-off."""

    def emit(self, live: LiveRequest, token_ids: tuple[int, ...], finish_reason: FinishReason | None) -> None:
        super().emit(live, token_ids, finish_reason)
        if live.request_id == "zombie" and len(live.output_ids) == 1:
            self.cancel("zombie")


def test_cancel_between_prefill_and_decode_hand_off_drops_the_request_at_once() -> None:
    # 20 blocks of 8: "long" reserves 16 (4 + 120 tokens); "zombie" would need 8 (never fits while long runs);
    # "small" needs 1. A zombie at the head of the decode queue would hold "small" back until long ends.
    c = _controller(
        "disagg:prefill=tp1,decode=tp1", cls=_CancelOnFirstToken, limits=dataclasses.replace(LIMITS, num_kv_blocks=20)
    )
    try:
        long = c.submit(_req("long", (5, 6, 7, 8), max_tokens=120))
        _wait_for(lambda: c.decode_instances[0].num_running == 1)
        zombie = c.submit(_req("zombie", (9, 10, 11, 12), max_tokens=60))
        ids, last = zombie.collect(timeout_s=30)
        assert last.finish_reason == "abort" and len(ids) == 1
        small = c.submit(_req("small", (3, 4), max_tokens=4))
        assert small.collect(timeout_s=30)[0] == reference_tokens((3, 4), 4, V)
        assert not long.finished  # small did not wait for long to end
        assert c.decode_instances[0].num_waiting == 0
        assert long.collect(timeout_s=60)[0] == reference_tokens((5, 6, 7, 8), 120, V)
        assert c.prefill_instances[0].buffer_used == 0 and c.decode_instances[0].cache.num_available == 20
        assert c.stats().num_live_requests == 0
    finally:
        c.shutdown(drain_timeout_s=0)


# ---- 2. a dead instance's requests move to live ones -----------------------------------------------


class _DyingEngine(FakeEngine):
    """Raises on its `die_at`-th decode step or prefill call (1-based); counts as dead from then on."""

    die_at_decode: int | None = None
    die_at_prefill: int | None = None

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        if self.die_at_decode is not None and self.num_decode_calls + 1 >= self.die_at_decode:
            raise RuntimeError("device lost")
        return super().decode_step(batch, pages)

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        if self.die_at_prefill is not None and self.num_prefill_calls + 1 >= self.die_at_prefill:
            raise RuntimeError("device lost")
        return super().prefill(items)


def _dying_factory(name_role: str, **die: int):
    counts: dict[str, int] = {}

    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> FakeEngine:
        i = counts.get(spec.role, 0)
        counts[spec.role] = i + 1
        if f"{spec.role}-{i}" == name_role:
            engine = _DyingEngine(CFG, devices, tp=spec.tp, pp=spec.pp)
            for k, v in die.items():
                setattr(engine, k, v)
            return engine
        return FakeEngine(CFG, devices, tp=spec.tp, pp=spec.pp)

    return factory


PROMPTS = [tuple(range(3 + i, 9 + 2 * i)) for i in range(8)]


def _stream_all(c: Controller, n_tokens: int = 40) -> list[list[int]]:
    streams = [c.submit(_req(f"s{i}", p, max_tokens=n_tokens)) for i, p in enumerate(PROMPTS)]
    return [s.collect(timeout_s=60)[0] for s in streams]


def test_dead_decode_instance_requests_continue_on_a_live_one_token_identical() -> None:
    c = _controller("disagg:prefill=tp1,decode=2xtp1", factory=_dying_factory("decode-0", die_at_decode=12))
    try:
        got = _stream_all(c)
        assert got == [reference_tokens(p, 40, V) for p in PROMPTS]  # nothing lost, nothing repeated
        dead = c.decode_instances[0]
        assert dead.error is not None and c.decode_instances[1].error is None
        assert c.stats().faults.num_rerouted_requests > 0
        assert c.submit(_req("after", (7, 7), max_tokens=6)).collect(30)[0] == reference_tokens((7, 7), 6, V)
        assert c.decode_instances[1].cache.num_available == 64 and c.stats().num_live_requests == 0
    finally:
        c.shutdown(drain_timeout_s=0)


def test_dead_prefill_instance_requests_go_to_the_live_one_token_identical() -> None:
    c = _controller(
        "disagg:prefill=2xtp1,decode=tp1",
        factory=_dying_factory("prefill-0", die_at_prefill=2),
        limits=dataclasses.replace(LIMITS, max_batch_tokens=8),
    )
    try:
        got = _stream_all(c)
        assert got == [reference_tokens(p, 40, V) for p in PROMPTS]
        assert c.prefill_instances[0].error is not None and c.prefill_instances[1].error is None
        assert c.stats().faults.num_rerouted_requests > 0
        assert c.submit(_req("after", (7, 7), max_tokens=6)).collect(30)[0] == reference_tokens((7, 7), 6, V)
    finally:
        c.shutdown(drain_timeout_s=0)


def test_dead_colocated_instance_requests_continue_on_the_other_token_identical() -> None:
    c = _controller("colocated:2xtp1,chunk=8", factory=_dying_factory("colocated-0", die_at_decode=15))
    try:
        got = _stream_all(c)
        assert got == [reference_tokens(p, 40, V) for p in PROMPTS]
        assert c.colocated_instances[0].error is not None
        assert c.stats().faults.num_rerouted_requests > 0
    finally:
        c.shutdown(drain_timeout_s=0)


def test_when_nothing_is_left_the_requests_fail_instead_of_hanging() -> None:
    c = _controller("disagg:prefill=tp1,decode=tp1", factory=_dying_factory("decode-0", die_at_decode=3))
    try:
        stream = c.submit(_req("x", (5, 6, 7), max_tokens=10))
        with pytest.raises(EngineDeadError, match="decode-0"):
            stream.collect(timeout_s=30)
        with pytest.raises(EngineDeadError):
            c.submit(_req("y", (5, 6, 7)))
        assert not c.stats().instances[1].alive
    finally:
        c.shutdown(drain_timeout_s=0)


# ---- 7. the colocated load counts a partly prefilled request as running --------------------------


class _Sink:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def emit(self, live: LiveRequest, token_ids: tuple[int, ...], finish_reason: FinishReason | None) -> None:
        self.tokens.setdefault(live.request_id, []).extend(token_ids)

    def fail(self, live: LiveRequest, error: BaseException) -> None:
        raise AssertionError(error)

    def recompute(self, live: LiveRequest) -> None:
        raise AssertionError("nothing to recompute")

    def on_instance_dead(self, instance: Worker, held: Sequence[LiveRequest]) -> None:
        raise AssertionError(instance.error)

    def count_fault(self, kind: FaultKind, n: int = 1) -> None:
        raise AssertionError(kind)


def test_colocated_load_counts_a_partly_prefilled_request_as_running() -> None:
    engine = FakeEngine(CFG, jax.devices()[:1])
    inst = ColocatedInstance(
        "colocated-0",
        engine,
        ColocatedConfig(limits=ServingLimits(block_size=8, num_kv_blocks=64, max_decode_batch=8, chunk_size=4)),
        _Sink(),
    )
    for rid, prompt in (("a", tuple(range(3, 13))), ("b", (20, 21, 22, 23, 24, 25))):
        live = LiveRequest(_req(rid, prompt, max_tokens=3), seed=0, timings=RequestTimings(arrival_at=0.0))
        inst.enqueue(live)
    assert inst.load() == PrefillLoad(16, 2)
    assert inst.step()  # chunk budget 4: "a" is admitted and 4 of its 10 prompt tokens are prefilled
    assert inst.load() == PrefillLoad(6, 1)  # "a" runs (holds its blocks); only "b" waits
    s = inst.stats()
    assert (s.num_waiting, s.num_running) == (1, 1)


# ---- seeded sampling continues from the same sample positions after a move (tiny OPT) -----------


class _OPTDyingOnDecode:
    """An OPT engine (both roles) whose decode steps fail from the `die_at`-th one on."""

    def __init__(self, inner: object, die_at: int | None) -> None:
        self.inner, self.die_at, self.num_decode_calls = inner, die_at, 0

    def __getattr__(self, name: str) -> object:  # capabilities, devices, kv_layout, prefill, init_pages, insert
        return getattr(self.inner, name)

    @property
    def model_config(self):
        return self.inner.model_config  # type: ignore[attr-defined]

    def kv_layout(self):
        return self.inner.kv_layout()  # type: ignore[attr-defined]

    def prefill(self, items):
        return self.inner.prefill(items)  # type: ignore[attr-defined]

    def init_pages(self, num_blocks: int, block_size: int):
        return self.inner.init_pages(num_blocks, block_size)  # type: ignore[attr-defined]

    def insert(self, kv, num_tokens, pages, block_table):
        return self.inner.insert(kv, num_tokens, pages, block_table)  # type: ignore[attr-defined]

    def decode_step(self, batch: StepBatch, pages: KVPages):
        self.num_decode_calls += 1
        if self.die_at is not None and self.num_decode_calls >= self.die_at:
            raise RuntimeError("device lost")
        return self.inner.decode_step(batch, pages)  # type: ignore[attr-defined]


def test_seeded_sampling_continues_from_the_same_positions_after_a_move(tmp_path) -> None:
    from jaxserve.runtime.engines.model import model_engine_factory
    from jaxserve.testing.hf import make_hf_checkpoint

    checkpoint = str(make_hf_checkpoint(tmp_path / "opt-tiny-hf", CFG, seed=3))
    base = model_engine_factory(checkpoint)
    plan = parse_deployment("disagg:prefill=tp1,decode=2xtp1")
    config = ControllerConfig(limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64))
    prompts = [(2, 100, 31, 7, 8), (2, 5, 6), (2, 300, 301, 302, 17, 9, 44)]

    def run(die_at: int | None) -> tuple[list[list[int]], Controller]:
        counts: dict[str, int] = {}

        def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> object:
            i = counts.get(spec.role, 0)
            counts[spec.role] = i + 1
            engine = base(spec, devices)
            return _OPTDyingOnDecode(engine, die_at) if f"{spec.role}-{i}" == "decode-0" else engine

        c = Controller(build_engines(plan, factory), plan, config)  # type: ignore[arg-type]
        c.start()
        try:
            streams = [
                c.submit(
                    GenerateRequest(
                        f"r{i}", p, SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i, ignore_eos=True)
                    )
                )
                for i, p in enumerate(prompts)
            ]
            return [s.collect(timeout_s=120)[0] for s in streams], c
        finally:
            c.shutdown(drain_timeout_s=0)

    reference, _ = run(None)
    moved, c = run(die_at=5)
    assert c.decode_instances[0].error is not None and c.stats().faults.num_rerouted_requests > 0
    assert moved == reference
