"""The workload monitor and shift detector, stepped by hand with exact numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxserve.core.workload_monitor import (
    DetectorConfig,
    LengthHistogram,
    MonitorConfig,
    ShiftDetector,
    WorkloadMonitor,
    default_length_edges,
    ks_critical,
    ks_distance,
)


def test_default_edges_are_powers_of_two_and_one_and_a_half_times_them() -> None:
    assert default_length_edges(64) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def test_window_counts_only_completed_slices_and_forgets_old_ones() -> None:
    mon = WorkloadMonitor(MonitorConfig(window_s=120, slice_s=30))
    for t, n in ((0, 5), (10, 100), (20, 100), (35, 1000)):
        mon.record_arrival(t, n)
    w = mon.window(30.0)  # slice 0 done, slice 1 being filled
    assert (w.start_at, w.end_at, w.num_arrivals) == (0.0, 30.0, 3)
    assert w.rate == pytest.approx(0.1)
    # 5 lies in [4, 6) (midpoint 4.5), 100 in [96, 128) (midpoint 111.5)
    assert w.input_lengths.mean() == pytest.approx((4.5 + 2 * 111.5) / 3)
    assert mon.window(60.0).rate == pytest.approx(4 / 60)
    w = mon.window(150.0)  # slices 1..4: slice 0 has left the window
    assert (w.start_at, w.end_at, w.num_arrivals) == (30.0, 150.0, 1)
    assert w.rate == pytest.approx(1 / 120)
    mon.record_arrival(10.0, 7)  # far older than the window: dropped
    assert mon.window(150.0).num_arrivals == 1


def test_slo_attainment_and_step_corrections() -> None:
    mon = WorkloadMonitor(MonitorConfig(window_s=60, slice_s=30, ttft_slo_s=0.5, tpot_slo_s=0.1))
    mon.record_finish(1.0, 10, 0.2, 0.05)
    mon.record_finish(2.0, 20, 0.6, 0.05)  # TTFT miss
    mon.record_finish(3.0, 1, 0.1, None)  # one token: TPOT always met
    mon.record_finish(3.5, 30, None, None)  # latencies unknown: counts for the output lengths only
    mon.record_step(4.0, "p0", "prefill", 0.12, 0.10)
    mon.record_step(5.0, "p0", "prefill", 0.12, 0.10)
    mon.record_step(6.0, "d0", "decode", 0.05, 0.05)
    mon.record_step(7.0, "d1", "decode", 0.03, 0.01)
    w = mon.window(30.0)
    assert (w.num_finished, w.num_judged, w.num_ttft_ok, w.num_tpot_ok, w.num_slo_ok) == (4, 3, 2, 3, 2)
    assert w.attainment == pytest.approx(2 / 3)
    assert w.ttft_mean_s == pytest.approx(0.3)
    assert w.tpot_mean_s == pytest.approx(0.1 / 3)
    assert w.corrections["p0"].factor == pytest.approx(1.2)
    assert w.corrections["p0"].num_steps == 2
    assert w.corrections["d1"].factor == pytest.approx(3.0)
    assert w.role_factor("decode") == pytest.approx(0.08 / 0.06)
    assert w.role_factor("colocated") == 1.0
    # output lengths come from finishes: 10 in [8, 12), 20 in [16, 24), 1 in [1, 2), 30 in [24, 32)
    assert w.output_lengths.counts[default_length_edges().index(8)] == 1
    assert w.output_lengths.max_seen == 30
    snap = mon.snapshot(45.0)
    json.dumps(snap)  # JSON-able
    assert snap["window"]["attainment"] == pytest.approx(2 / 3)  # type: ignore[index]


def test_ks_distance_and_critical_value() -> None:
    edges = default_length_edges()
    a = [0] * len(edges)
    b = [0] * len(edges)
    a[edges.index(96)] = 100
    b[edges.index(96)] = 50
    b[edges.index(768)] = 50
    ha, hb = LengthHistogram(edges, tuple(a)), LengthHistogram(edges, tuple(b))
    assert ks_distance(ha, hb) == pytest.approx(0.5)
    assert ks_distance(ha, ha) == 0.0
    # c(0.01) = sqrt(-ln(0.005) / 2) = 1.62762..., times sqrt(200 / 100^2)
    assert ks_critical(100, 100, 0.01) == pytest.approx(math.sqrt(-math.log(0.005) / 2) * math.sqrt(0.02))
    assert ks_critical(0, 5, 0.01) == math.inf


def test_histogram_sampling_stays_inside_the_bins() -> None:
    edges = default_length_edges(2048)
    counts = [0] * len(edges)
    counts[edges.index(96)] = 3
    counts[-1] = 1  # the open bin [2048, ...): bounded by the largest length seen
    h = LengthHistogram(edges, tuple(counts), max_seen=2100)
    x = h.sample(np.random.default_rng(0), 4000)
    small, big = x[x < 2048], x[x >= 2048]
    assert small.min() >= 96 and small.max() <= 127 and big.max() <= 2100
    assert len(big) / len(x) == pytest.approx(0.25, abs=0.03)
    with pytest.raises(ValueError):
        LengthHistogram(edges, tuple([0] * len(edges))).sample(np.random.default_rng(0), 1)


def _feed(mon: WorkloadMonitor, start: int, end: int, per_s: int, length: int = 100) -> None:
    for t in range(start, end):
        for k in range(per_s):
            mon.record_arrival(t + k / per_s, length)


def _run_slice(mon: WorkloadMonitor, phases: list[tuple[int, int, int, int]], now: int, slice_s: int = 30) -> None:
    """Feed the slice ending at `now` from phases (start, end, arrivals per second, prompt length)."""
    for start, end, per_s, length in phases:
        lo, hi = max(start, now - slice_s), min(end, now)
        if lo < hi:
            _feed(mon, lo, hi, per_s, length)


def test_rate_shift_fires_after_sustain_and_respects_cooldown() -> None:
    mon = WorkloadMonitor(MonitorConfig(window_s=60, slice_s=30))
    det = ShiftDetector(DetectorConfig(rate_change=0.25, min_requests=10, sustain_s=60, cooldown_s=300))
    phases = [(0, 120, 1, 100), (120, 240, 2, 100), (240, 600, 1, 100)]
    fired = []
    for now in range(30, 600, 30):
        _run_slice(mon, phases, now)
        check = det.check(mon.window(float(now)))
        if now == 30:
            assert check.reasons == ("no reference yet",) and det.reference is not None
        if check.fire:
            fired.append(now)
            det.mark_replanned(float(now), mon.window(float(now)))
        if now == 150:  # window 90..150: 30 + 60 arrivals in 60 s = 1.5 rps against 1.0
            assert check.shifted and check.rate_ratio == pytest.approx(1.5) and not check.fire
            assert check.shifted_since == 150
        if now == 330:  # back to 1 rps for 60 s, but the replan at 210 is still cooling down
            assert check.shifted and not check.fire and "cooling down until 510" in check.reasons[-1]
    # up at 150, held 60 s at 210; down at 270, held from 330, cool-down ends at 210 + 300
    assert fired == [210, 510]
    assert det.reference is not None and det.reference.rate == pytest.approx(1.0)


def test_a_blip_shorter_than_sustain_does_not_fire() -> None:
    mon = WorkloadMonitor(MonitorConfig(window_s=30, slice_s=30))
    det = ShiftDetector(DetectorConfig(rate_change=0.25, min_requests=10, sustain_s=30, cooldown_s=0))
    phases = [(0, 60, 1, 100), (60, 90, 2, 100), (90, 180, 1, 100)]  # one slice at double rate
    checks = []
    for now in range(30, 180, 30):
        _run_slice(mon, phases, now)
        checks.append(det.check(mon.window(float(now))))
    assert [c.shifted for c in checks] == [False, False, True, False, False]
    assert not any(c.fire for c in checks)
    assert det.shifted_since is None


def test_length_shift_is_detected_by_ks_at_the_same_rate() -> None:
    mon = WorkloadMonitor(MonitorConfig(window_s=60, slice_s=30))
    det = ShiftDetector(DetectorConfig(min_requests=20, sustain_s=30, cooldown_s=0))
    phases = [(0, 60, 1, 100), (60, 180, 1, 1500)]
    fired = []
    for now in range(30, 180, 30):
        _run_slice(mon, phases, now)
        check = det.check(mon.window(float(now)))
        if check.fire:
            fired.append((now, check))
            det.mark_replanned(float(now), mon.window(float(now)))
    # at 90 the window (30..90) is half 100s, half 1500s: KS 0.5; held 30 s at 120 (KS 1.0)
    assert [n for n, _ in fired] == [120]
    check = fired[0][1]
    assert check.input_ks == pytest.approx(1.0) and check.rate_ratio == pytest.approx(1.0)
    assert check.reasons[0].startswith("prompt lengths moved (KS 1.000")
    json.dumps(det.snapshot())


def _overload_run(capacity: float | None, margin: float | None = 1.1) -> tuple[list[int], dict[int, object]]:
    """10 rps until 60 s, then 11 rps (+10 %: under the 25 % rate trigger). A round at 30 s adopted a plan
    predicted at `capacity` rps and started a 600 s cool-down."""
    mon = WorkloadMonitor(MonitorConfig(window_s=60, slice_s=30))
    det = ShiftDetector(
        DetectorConfig(rate_change=0.25, min_requests=10, sustain_s=60, cooldown_s=600, capacity_margin=margin)
    )
    phases = [(0, 60, 10, 100), (60, 400, 11, 100)]
    fired, checks = [], {}
    for now in range(30, 400, 30):
        _run_slice(mon, phases, now)
        window = mon.window(float(now))
        check = det.check(window)
        checks[now] = check
        if now == 30 or check.fire:
            det.mark_replanned(float(now), window)
            if now == 30:
                det.set_capacity(capacity)
            else:
                fired.append(now)
    return fired, checks


def test_an_overload_of_the_plans_predicted_goodput_fires_through_the_cool_down() -> None:
    # capacity 11.6 covered the reference (10 rps x 1.1 = 11); the window 30..90 holds 300 + 330
    # arrivals (10.5 rps x 1.1 = 11.55 <= 11.6), the window 60..120 11 rps (x 1.1 = 12.1 > 11.6):
    # overloaded from 120, held 60 s at 180, long before the cool-down ends (30 + 600)
    fired, checks = _overload_run(11.6)
    assert fired == [180]
    assert not checks[90].shifted and checks[120].overloaded and checks[120].rate_ratio == pytest.approx(1.1)
    assert checks[150].reasons[-1] == "held 30 s of 60 s"
    assert checks[180].reasons == (
        "rate 11 rps x margin 1.1 exceeds the plan's predicted goodput 11.6 rps",
        "overloaded: the cool-down does not hold this back",
    )
    # after that round the reference is the 11 rps window and nobody reported a better plan:
    # 11.6 < 11 x 1.1, short already when adopted, so it does not fire again
    assert not any(c.fire for t, c in checks.items() if t > 180)
    assert not checks[240].overloaded


@pytest.mark.parametrize(
    ("capacity", "margin"),
    [
        (None, 1.1),  # no prediction known (before the first round)
        (12.5, 1.1),  # 11 x 1.1 = 12.1 <= 12.5: headroom left
        (10.5, 1.1),  # short of the reference's 10 x 1.1 = 11 when adopted
        (11.6, None),  # overload trigger off
    ],
)
def test_no_overload_fire_without_a_covering_prediction_that_the_load_exceeds(
    capacity: float | None, margin: float | None
) -> None:
    fired, checks = _overload_run(capacity, margin)
    assert fired == []
    assert not any(c.overloaded for c in checks.values())
    json.dumps(ShiftDetector().snapshot())


def test_capacity_margin_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity_margin"):
        DetectorConfig(capacity_margin=0.0)


def _mix_run(side: str, before: int, after: int, rate_after: int = 10) -> tuple[list[int], dict[int, object]]:
    """10 rps until 60 s, `rate_after` rps from then on; the prompt (side "input") or output (side
    "output") length is `before` until 60 s, `after` from then on, the other side 100. A round at 30 s
    adopted a plan predicted at 12 rps (the reference, 10 rps x 1.1 = 11, covered) and started a 600 s
    cool-down."""
    mon = WorkloadMonitor(MonitorConfig(window_s=60, slice_s=30))
    det = ShiftDetector(DetectorConfig(rate_change=0.25, min_requests=10, sustain_s=60, cooldown_s=600))
    fired, checks = [], {}
    for now in range(30, 400, 30):
        for t in range(now - 30, now):
            per_s, length = (10, before) if t < 60 else (rate_after, after)
            for k in range(per_s):
                at = t + k / per_s
                mon.record_arrival(at, length if side == "input" else 100)
                mon.record_finish(at, length if side == "output" else 100, None, None)
        window = mon.window(float(now))
        check = det.check(window)
        checks[now] = check
        if now == 30:
            det.mark_replanned(30.0, window)
            det.set_capacity(12.0)
        elif check.fire:
            fired.append(now)
            det.mark_replanned(float(now), window)
    return fired, checks


@pytest.mark.parametrize("side", ["input", "output"])
def test_a_heavier_mix_at_the_same_rate_eats_the_plans_capacity_and_fires_through_the_cool_down(side: str) -> None:
    # lengths 100 -> 130: bins [96, 128) and [128, 192), midpoints 111.5 and 159.5. The rate stays at
    # 10 rps (10 x 1.1 = 11 <= 12: the rate alone never fires), but the window 30..90 is half of each
    # (mean 135.5, load 135.5 / 111.5 = 1.215; 11 x 1.215 = 13.4 > 12) and from 120 all heavy
    # (load 159.5 / 111.5 = 1.431): overloaded from 90, held 60 s at 150, inside the cool-down (30 + 600)
    fired, checks = _mix_run(side, 100, 130)
    assert fired == [150]
    assert checks[60].load_factor == 1.0 and not checks[60].overloaded
    assert checks[90].load_factor == pytest.approx(135.5 / 111.5) and checks[90].overloaded
    assert checks[90].rate_ratio == pytest.approx(1.0)
    assert checks[150].load_factor == pytest.approx(159.5 / 111.5)
    assert checks[150].reasons[-2:] == (
        "rate 10 rps x margin 1.1 x mix load 1.43 exceeds the plan's predicted goodput 12 rps",
        "overloaded: the cool-down does not hold this back",
    )
    # the round at 150 takes the heavy window as its reference: load 1 again, nothing fires
    assert all(checks[t].load_factor == 1.0 and not checks[t].fire for t in range(180, 400, 30))


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize("after", [50, 120])
def test_a_lighter_or_same_bin_mix_leaves_the_capacity_alone(side: str, after: int) -> None:
    # 100 -> 50 (bin [48, 64)): lighter, the factor stays 1 and 10 x 1.1 = 11 <= 12 never fires;
    # 100 -> 120 stays in the bin [96, 128): the histogram sees no change
    fired, checks = _mix_run(side, 100, after)
    assert fired == [] and all(c.load_factor == 1.0 and not c.overloaded for c in checks.values())


def test_a_lighter_mix_does_not_hold_back_a_rate_overload() -> None:
    # 12 rps from 60 s with prompts halved: the factor is max(1, ...), never below 1, so this fires as
    # on the rate alone: the window 30..90 is 11 rps (x 1.1 = 12.1 > 12) from 90, held 60 s at 150
    fired, checks = _mix_run("input", 100, 50, rate_after=12)
    assert fired == [150] and checks[150].load_factor == 1.0
    assert checks[150].reasons[-2] == "rate 12 rps x margin 1.1 exceeds the plan's predicted goodput 12 rps"
