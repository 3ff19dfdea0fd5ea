"""The timed engine charges exactly the simulator's step formulas for each step's real shape (clock injected)."""

from __future__ import annotations

import jax
import pytest

from jaxserve.core.request import SamplingParams
from jaxserve.core.step_cost import LinkCost
from jaxserve.runtime.engines.contract import PrefillItem, StepBatch, StepRow
from jaxserve.runtime.engines.timed import MIN_TOKEN, TimedEngine, random_token
from jaxserve.runtime.kv_connectors.base import TransferState
from jaxserve.runtime.kv_connectors.timed import TimedTransfer
from models.config import get_config
from placement.hardware import get_device
from placement.latency import LatencyProvider, StepOverhead, load_profile
from placement.step_time import ModelStepCost

CFG = get_config("opt-13b", "float16")
LP = LatencyProvider(CFG, get_device("a100-80gb"), load_profile("a100-80gb-distserve"))
FOLDED = LP.profile.folded[("disagg", "opt-13b", 1)]  # type: ignore[union-attr]
COLOC = LP.profile.folded[("colocated", "opt-13b", 1)]  # type: ignore[union-attr]
OVERHEAD = StepOverhead(0.002, 1e-7, 0.001)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def _engine(kind: str = "disagg", pp: int = 1, slack: float = 0.005) -> tuple[TimedEngine, FakeClock]:
    clock = FakeClock()
    model = LP.instance(kind, 1, pp)  # type: ignore[arg-type]
    engine = TimedEngine(
        CFG, jax.devices()[:pp], ModelStepCost(model, OVERHEAD), pp=pp, host_slack_s=slack, clock=clock,
        sleep=clock.sleep,
    )  # fmt: skip
    return engine, clock


def _row(rid: str, n: int, start: int, prompt: bool) -> StepRow:
    return StepRow(rid, (7,) * n, start, (0,), SamplingParams(), seed=1, sample_index=1, is_prompt=prompt)


def test_prefill_sleeps_the_folded_formula_plus_overhead() -> None:
    engine, clock = _engine()
    items = [PrefillItem(f"r{i}", (5,) * n, SamplingParams(), seed=i) for i, n in enumerate((100, 50))]
    result = engine.prefill(items)
    a, b, c = FOLDED.prefill
    expected = (a + b * 150 + c * (100**2 + 50**2)) / 1000 + 0.002 + 150 * 1e-7 + 0.001
    assert clock.slept == [pytest.approx(expected, rel=1e-12)]
    assert [s.num_tokens for s in result.sequences] == [100, 50]


def test_decode_and_mixed_steps() -> None:
    engine, clock = _engine("colocated")
    pages = engine.init_pages(8, 16)
    # Two decodes at positions 99 and 9: they attend over 100 and 10 tokens.
    tokens, _ = engine.decode_step(StepBatch((_row("a", 1, 99, False), _row("b", 1, 9, False))), pages)
    a, b, c = COLOC.decode_small
    assert clock.slept[-1] == pytest.approx((a + b * 110 + c * 2) / 1000 + 0.002 + 110e-7, rel=1e-12)
    assert all(t >= MIN_TOKEN for t in tokens)
    # A 32-token chunk after 64 prompt tokens, with one decode at position 19 riding along. The device was free
    # long ago, so the step starts at the call.
    clock.now += 1.0
    engine.decode_step(StepBatch((_row("c", 32, 64, True), _row("a", 1, 19, False))), pages)
    pa, pb, pc = COLOC.prefill
    b_ctx = COLOC.decode_small[1]
    kernel = (pa + pb * (32 + 1) + pc * 32 * (32 + 2 * 64) + b_ctx * 20) / 1000
    assert clock.slept[-1] == pytest.approx(kernel + 0.002 + (20 + 96) * 1e-7 + 0.001, rel=1e-12)


def test_back_to_back_steps_hide_the_host_time_between_them() -> None:
    engine, clock = _engine(slack=0.005)
    item = [PrefillItem("r", (5,) * 64, SamplingParams(), seed=0)]
    engine.prefill(item)
    step = clock.slept[-1]
    clock.now += 0.003  # the runtime's host time before the next call: within the slack, absorbed
    engine.prefill(item)
    assert clock.slept[-1] == pytest.approx(step - 0.003, rel=1e-9)
    clock.now += 0.050  # idle for longer than the slack: the step starts at the call
    engine.prefill(item)
    assert clock.slept[-1] == pytest.approx(step, rel=1e-9)


def test_a_prefill_starts_at_its_last_prompts_arrival_or_stage_0s_end_not_at_the_late_call() -> None:
    """A prompt that reached an idle instance starts its modelled time at its arrival, however late the host
    woke to call the engine (the simulator starts it there); one that waited behind a batch starts when stage 0
    freed. A batch starts no earlier than its last prompt's arrival, and never later than the call."""
    engine, clock = _engine(slack=0.005)

    def item(rid: str, arrived_at: float | None) -> PrefillItem:
        return PrefillItem(rid, (5,) * 64, SamplingParams(), seed=0, arrived_at=arrived_at)

    engine.prefill([item("a", clock.now)])
    step = clock.slept[-1]
    clock.now += 1.0  # idle; then a prompt arrives and the host calls 15 ms later
    engine.prefill([item("b", clock.now - 0.015)])
    assert clock.slept[-1] == pytest.approx(step - 0.015, rel=1e-9)
    # Two prompts batched after the first arrived: the batch could not start before the second one.
    clock.now += 1.0
    engine.prefill([item("c", clock.now - 0.015), item("d", clock.now - 0.005)])
    two = engine.charged_s[-1][1]
    assert clock.slept[-1] == pytest.approx(two - 0.005, rel=1e-9)
    # Both waited behind that batch: they start at its end, though the host calls 15 ms after it.
    ended = clock.now
    clock.now += 0.015
    engine.prefill([item("e", ended - 0.050), item("f", ended - 0.040)])
    assert clock.slept[-1] == pytest.approx(two - 0.015, rel=1e-9)
    # An item without an arrival (a caller that does not say): the slack alone, as before.
    clock.now += 0.020
    engine.prefill([item("g", None)])
    assert clock.slept[-1] == pytest.approx(step, rel=1e-9)
    # An arrival long past (a request moved off a lost instance keeps its first arrival) moves the start back by
    # at most the batch's own stage-0 time: its modelled end is the call, not 10 s ago.
    clock.now += 1.0
    engine.prefill([item("h", clock.now - 10.0)])
    assert engine._stage_free_at[0] == pytest.approx(clock.now, rel=1e-12)


def test_a_step_after_one_that_left_rows_running_starts_at_its_end_however_late_the_host() -> None:
    """The instance had work when the device freed (rows still running): a host late by more than the slack
    (this machine's sleep wakes up to 17 ms late under load) must not push the next step, up to the previous
    step's length (the host prepares a step while the device runs the one before), whichever rows it runs (a
    colocated instance's prompt step runs none of them). After a step that ended every row, the slack alone."""
    engine, clock = _engine("colocated", slack=0.005)
    pages = engine.init_pages(8, 16)
    ab = StepBatch((_row("a", 1, 99, False), _row("b", 1, 9, False)))
    engine.decode_step(ab, pages)
    step = clock.slept[-1]
    assert step > 0.020
    clock.now += 0.020  # woke 20 ms late: beyond the slack, within the step's length
    engine.decode_step(ab, pages)
    assert clock.slept[-1] == pytest.approx(step - 0.020, rel=1e-9)
    clock.now += 0.020  # a prompt step, a and b waiting: the device had work when it freed
    engine.decode_step(StepBatch((_row("c", 32, 0, True),)), pages)
    prompt_step = engine.charged_s[-1][1]
    assert clock.slept[-1] == pytest.approx(prompt_step - 0.020, rel=1e-9)
    # a step whose rows all end (max_tokens reached by the token sampled now): nothing left when it ends
    last = SamplingParams(max_tokens=2)
    ending = StepBatch(tuple(StepRow(r, (7,), 9, (0,), last, seed=1, sample_index=1) for r in ("a", "b")))
    engine.decode_step(ending, pages)
    clock.now += 0.020  # the same lateness, but the device was idle: new rows start at the call
    engine.decode_step(StepBatch((_row("d", 1, 99, False), _row("e", 1, 9, False))), pages)
    assert clock.slept[-1] == pytest.approx(step, rel=1e-9)
    clock.now += step + 0.001  # later than a whole step after one that left rows: a real device idled too
    engine.decode_step(StepBatch((_row("d", 1, 99, False), _row("e", 1, 9, False))), pages)
    assert clock.slept[-1] == pytest.approx(step, rel=1e-9)


def test_tokens_are_seeded_and_never_special() -> None:
    assert random_token(3, 5, 100) == random_token(3, 5, 100) != random_token(4, 5, 100)
    assert min(random_token(s, i, 10) for s in range(50) for i in range(20)) >= MIN_TOKEN


def test_multi_step_call_sleeps_the_rounds_it_ran_and_ends_rows_exactly() -> None:
    """`decode_steps`: the tokens of single steps, rows cut at max_tokens, one sleep of every round's time."""
    engine, clock = _engine("colocated")
    pages = engine.init_pages(8, 16)
    a_row = StepRow("a", (7,), 99, (0,), SamplingParams(max_tokens=3), seed=1, sample_index=1)  # 2 tokens left
    b_row = StepRow("b", (7,), 9, (0,), SamplingParams(max_tokens=20), seed=2, sample_index=1)
    lists, _ = engine.decode_steps(StepBatch((a_row, b_row)), pages, 4)
    assert lists == [
        [random_token(1, k, CFG.vocab_size) for k in (1, 2)],
        [random_token(2, k, CFG.vocab_size) for k in (1, 2, 3, 4)],
    ]
    a, b, c = COLOC.decode_small
    # rounds 0 and 1: both rows (contexts 100 + 10, then 101 + 11); rounds 2 and 3: b alone (12, then 13)
    rounds = [(2, 110), (2, 112), (1, 12), (1, 13)]
    expected = sum((a + b * ctx + c * n) / 1000 + 0.002 + ctx * 1e-7 for n, ctx in rounds)
    assert clock.slept == [pytest.approx(expected, rel=1e-12)]
    # A stop token id met mid-call ends the row on it.
    stop = random_token(2, 2, CFG.vocab_size)
    b_stop = StepRow("b", (7,), 9, (0,), SamplingParams(max_tokens=20, stop_token_ids=(stop,)), seed=2, sample_index=1)
    lists, _ = engine.decode_steps(StepBatch((b_stop,)), pages, 4)
    assert lists == [[random_token(2, 1, CFG.vocab_size), stop]]


def test_timed_transfer_charges_the_link_from_the_pulls_start_not_the_decode_device() -> None:
    """As the simulator charges a pull: its link time runs from its start while the decode device steps; pulls
    into one instance cross the link one after another; inserting a crossed pull costs the device nothing."""
    clock = FakeClock()
    cost = ModelStepCost(LP.instance("disagg", 1, 1), OVERHEAD)
    decode = TimedEngine(
        CFG, jax.devices()[:1], cost, link=LinkCost(latency_s=1e-3, s_per_token=1e-5), clock=clock, sleep=clock.sleep
    )
    prefill = TimedEngine(CFG, jax.devices()[1:2], cost, clock=clock, sleep=clock.sleep)
    seqs = prefill.prefill([PrefillItem(f"r{i}", (5,) * n, SamplingParams(), seed=i) for i, n in enumerate((100, 300))])
    pages = decode.init_pages(8, 16)
    transfer = TimedTransfer(decode)
    t0 = clock.now
    first, second = (transfer.start(s) for s in seqs.sequences)
    assert first.poll() is TransferState.PENDING and first.seconds is None
    clock.now = t0 + 1e-3 + 100 * 1e-5 - 1e-9
    assert first.poll() is TransferState.PENDING
    clock.now = t0 + 1e-3 + 100 * 1e-5
    slept = len(clock.slept)
    assert first.wait() is TransferState.DONE and len(clock.slept) == slept  # crossed: no sleep left
    assert first.poll() is TransferState.DONE and first.seconds == pytest.approx(2e-3)
    assert second.poll() is TransferState.PENDING  # it waits for the link behind the first
    charged = list(decode.charged_s)
    assert first.insert(100, pages, (0,) * 7) is pages and decode.charged_s == charged  # nothing on the device
    slept = len(clock.slept)
    assert second.insert(300, pages, (0,) * 19) is pages  # waits out the rest of its link time
    assert sum(clock.slept[slept:]) == pytest.approx(1e-3 + 300 * 1e-5)
    assert clock.now == pytest.approx(t0 + 2e-3 + 1e-3 + 300 * 1e-5) and second.seconds == pytest.approx(4e-3)
    with pytest.raises(TypeError, match="TimedEngine"):
        TimedTransfer(object())  # type: ignore[arg-type]


def test_the_timed_engine_lays_its_kv_as_the_fake_engine_does() -> None:
    """Both hand-computable engines build one `StageGrid`: the same stage layers, devices and head sharding for the
    same grid (so the runtime's transfer regroups their KV alike), and the same refusal of a wrong device count."""
    from jaxserve.runtime.engines.fake import FakeEngine

    devices = jax.devices()[:4]
    cost = ModelStepCost(LP.instance("disagg", 2, 2), OVERHEAD)  # type: ignore[arg-type]
    timed, fake = (
        TimedEngine(CFG, devices, cost, tp=2, pp=2).kv_layout(),
        FakeEngine(CFG, devices, tp=2, pp=2).kv_layout(),
    )
    assert timed.stage_layers == fake.stage_layers == (CFG.num_layers // 2, CFG.num_layers // 2)
    for t, f in zip(timed.shardings, fake.shardings, strict=True):
        assert t.mesh.devices.tolist() == f.mesh.devices.tolist() and t.spec == f.spec  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="tp2pp2 needs 4 devices, got 3"):
        TimedEngine(CFG, devices[:3], cost, tp=2, pp=2)
    with pytest.raises(ValueError, match="tp2pp2 needs 4 devices, got 3"):
        FakeEngine(CFG, devices[:3], tp=2, pp=2)
