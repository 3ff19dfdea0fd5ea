"""The workload monitor: sliding windows of what a deployment is serving, and when it has shifted.

Pure Python + numpy (no JAX, no threads, no clocks): every call takes `now` (seconds on any monotonic
scale), so the runtime feeds it wall-clock times and the simulator feeds it simulated ones.

Inputs, one call each:

* `record_arrival(now, input_len)` — a request entered the controller.
* `record_finish(now, output_len, ttft_s, tpot_s)` — a request finished (output lengths are only
  known then); TTFT/TPOT are judged against the SLOs in `MonitorConfig` (None: not known).
* `record_step(now, instance, role, observed_s, predicted_s)` — one engine step and what the latency
  model predicted for it; the window's Σobserved / Σpredicted per instance (and per role) is the
  correction factor the replanner multiplies the latency model by.

Time is cut into slices of `slice_s`; the window is the last `window_s / slice_s` *completed* slices,
so every statistic changes only at slice boundaries (hand-checkable, and the detector's hysteresis
counts whole slices). The slice being filled shows up only in the snapshot.

`ShiftDetector` compares the window against a reference window (the workload the current plan was
made for): the arrival rate by relative change, and the prompt and output length histograms by a
two-sample Kolmogorov–Smirnov test (the distance between the two histograms' CDFs on their shared
bins must be both large, ≥ `min_ks`, and significant at `ks_alpha`). A shift must hold in every
completed slice for `sustain_s` before it fires, and it never fires within `cooldown_s` of the last
replan (`mark_replanned`, which also makes the current window the new reference). "Hold for
`sustain_s`" means: it fires at the first check at least `sustain_s` after the first check that saw
the shift, with every check in between seeing it too (one that does not resets the clock).

One shift is not held back by the cool-down: *overload*. When the replanner reports the goodput it
predicts for the plan now serving (`set_capacity`), a window whose rate × `capacity_margin` exceeds
that goodput means the plan has used up its headroom; sustained for `sustain_s`, that fires even
while cooling down (a plan that cannot carry the load must not wait out the cool-down). The goodput
was predicted for the reference's length mix, and a mix that drifts at a steady rate (chat replacing
summarisation through the morning) eats the headroom as surely as more requests do, without ever
moving the rate: so the rate is first multiplied by the window's *load factor*, how much heavier its
requests are for the phase they weigh on most, max(1, mean prompt / reference mean prompt, mean
output / reference mean output) — to first order a phase's capacity in requests per second is
inversely proportional to its tokens per request (prefill: prompt tokens; decode: output tokens,
one step each). The factor never drops below 1: a lighter mix does not hold the trigger back. It only
counts when the plan covered its reference window with that margin (capacity ≥ reference rate ×
margin): a plan that was already short when it was adopted — the planner found nothing better —
would get the same answer from another round, so only the ordinary rate trigger, after the
cool-down, asks again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from typing import Literal

import numpy as np

Role = Literal["prefill", "decode", "colocated"]


def default_length_edges(max_len: int = 4096) -> tuple[int, ...]:
    """Bin edges 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x them) up to `max_len`.

    Bin i holds lengths in [edges[i], edges[i+1]); the last edge is the start of an open bin.
    """
    edges = {1, 2, 3}
    p = 4
    while p <= max_len:
        edges.add(p)
        if p * 3 // 2 <= max_len:
            edges.add(p * 3 // 2)
        p *= 2
    return tuple(sorted(edges))


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    window_s: float = 300.0
    slice_s: float = 30.0
    length_edges: tuple[int, ...] = dataclasses.field(default_factory=default_length_edges)
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def __post_init__(self) -> None:
        if self.slice_s <= 0 or self.window_s < self.slice_s:
            raise ValueError("need 0 < slice_s <= window_s")
        ratio = self.window_s / self.slice_s
        if abs(ratio - round(ratio)) > 1e-9:
            raise ValueError("window_s must be a whole number of slices")
        if len(self.length_edges) < 2 or any(b <= a for a, b in itertools.pairwise(self.length_edges)):
            raise ValueError("length_edges must be increasing")

    @property
    def num_slices(self) -> int:
        return round(self.window_s / self.slice_s)


@dataclasses.dataclass(frozen=True)
class LengthHistogram:
    """Counts of lengths per bin of `edges` (bin i: [edges[i], edges[i+1]); the last bin is open)."""

    edges: tuple[int, ...]
    counts: tuple[int, ...]
    max_seen: int = 0  # the largest length recorded (bounds the open last bin when sampling)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def mean(self) -> float:
        """Mean of the bin midpoints weighted by count (the open bin counts at max_seen)."""
        if self.total == 0:
            return 0.0
        mids = [(lo + hi - 1) / 2 for lo, hi in itertools.pairwise(self.edges)] + [float(self.max_seen)]
        return float(np.dot(mids, self.counts) / self.total)

    def cdf(self) -> np.ndarray:
        """P(length < edges[i+1]) for every bin (the last is 1)."""
        c = np.cumsum(np.asarray(self.counts, dtype=np.float64))
        return c / c[-1] if c[-1] > 0 else c

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n lengths: a bin drawn by its count, then an integer uniform inside the bin."""
        if self.total == 0:
            raise ValueError("cannot sample from an empty histogram")
        p = np.asarray(self.counts, dtype=np.float64) / self.total
        bins = rng.choice(len(self.counts), size=n, p=p)
        lo = np.asarray(self.edges, dtype=np.int64)[bins]
        upper = np.asarray([*self.edges[1:], max(self.max_seen + 1, self.edges[-1] + 1)], dtype=np.int64)
        hi = np.maximum(upper[bins], lo + 1)  # exclusive
        return rng.integers(lo, hi)

    def to_dict(self) -> dict[str, object]:
        return {"edges": list(self.edges), "counts": list(self.counts), "max_seen": self.max_seen}


def ks_distance(a: LengthHistogram, b: LengthHistogram) -> float:
    """Largest gap between the two histograms' CDFs at their shared bin edges (0 if either is empty)."""
    if a.edges != b.edges:
        raise ValueError("histograms must share their bins")
    if a.total == 0 or b.total == 0:
        return 0.0
    return float(np.max(np.abs(a.cdf() - b.cdf())))


def ks_critical(n: int, m: int, alpha: float) -> float:
    """The two-sample KS critical distance c(α)·sqrt((n+m)/(n·m)), c(α) = sqrt(-ln(α/2)/2)."""
    if n == 0 or m == 0:
        return math.inf
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


@dataclasses.dataclass
class _Slice:
    index: int
    num_bins: int
    num_arrivals: int = 0
    input_counts: np.ndarray = dataclasses.field(init=False)
    output_counts: np.ndarray = dataclasses.field(init=False)
    input_max: int = 0
    output_max: int = 0
    num_finished: int = 0
    num_judged: int = 0  # finished with known latencies
    num_ttft_ok: int = 0
    num_tpot_ok: int = 0
    num_slo_ok: int = 0
    ttft_sum_s: float = 0.0
    tpot_sum_s: float = 0.0
    # instance -> [role, Σ observed s, Σ predicted s, steps]
    steps: dict[str, tuple[Role, float, float, int]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.input_counts = np.zeros(self.num_bins, dtype=np.int64)
        self.output_counts = np.zeros(self.num_bins, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class StepCorrection:
    """Σ observed / Σ predicted step time over the window (1.0 = the latency model is right)."""

    role: Role
    observed_s: float
    predicted_s: float
    num_steps: int

    @property
    def factor(self) -> float:
        return self.observed_s / self.predicted_s if self.predicted_s > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class WindowStats:
    """The completed slices of the window, aggregated. `span_s` = completed slices × slice_s."""

    start_at: float
    end_at: float
    num_arrivals: int
    input_lengths: LengthHistogram
    output_lengths: LengthHistogram
    num_finished: int
    num_judged: int
    num_ttft_ok: int
    num_tpot_ok: int
    num_slo_ok: int
    ttft_mean_s: float
    tpot_mean_s: float
    corrections: dict[str, StepCorrection]

    @property
    def span_s(self) -> float:
        return self.end_at - self.start_at

    @property
    def rate(self) -> float:
        """Arrivals per second over the window (0 before the first slice completes)."""
        return self.num_arrivals / self.span_s if self.span_s > 0 else 0.0

    @property
    def attainment(self) -> float | None:
        """Share of judged requests meeting both SLOs (None when none was judged)."""
        return self.num_slo_ok / self.num_judged if self.num_judged else None

    def role_factor(self, role: Role) -> float:
        """Σ observed / Σ predicted over every instance of `role` (1.0 when none stepped)."""
        obs = sum(c.observed_s for c in self.corrections.values() if c.role == role)
        pred = sum(c.predicted_s for c in self.corrections.values() if c.role == role)
        return obs / pred if pred > 0 else 1.0

    def to_dict(self) -> dict[str, object]:
        return {
            "start_at": self.start_at,
            "end_at": self.end_at,
            "num_arrivals": self.num_arrivals,
            "rate_rps": self.rate,
            "input_len_mean": self.input_lengths.mean(),
            "output_len_mean": self.output_lengths.mean(),
            "input_lengths": self.input_lengths.to_dict(),
            "output_lengths": self.output_lengths.to_dict(),
            "num_finished": self.num_finished,
            "num_judged": self.num_judged,
            "ttft_attainment": self.num_ttft_ok / self.num_judged if self.num_judged else None,
            "tpot_attainment": self.num_tpot_ok / self.num_judged if self.num_judged else None,
            "attainment": self.attainment,
            "ttft_mean_s": self.ttft_mean_s,
            "tpot_mean_s": self.tpot_mean_s,
            "corrections": {
                name: {"role": c.role, "factor": c.factor, "num_steps": c.num_steps}
                for name, c in sorted(self.corrections.items())
            },
            "role_factors": {r: self.role_factor(r) for r in ("prefill", "decode", "colocated")},
        }


class WorkloadMonitor:
    """Sliding-window statistics of arrivals, lengths, latencies and step-time corrections."""

    def __init__(self, config: MonitorConfig | None = None, start_at: float = 0.0) -> None:
        self.config = config or MonitorConfig()
        self.start_at = start_at
        self._slices: deque[_Slice] = deque()
        self._latest = -1  # index of the newest slice seen

    # ---- inputs --------------------------------------------------------------------------------
    def record_arrival(self, now: float, input_len: int) -> None:
        s = self._slice(now)
        if s is None:
            return
        s.num_arrivals += 1
        s.input_counts[self._bin(input_len)] += 1
        s.input_max = max(s.input_max, int(input_len))

    def record_finish(self, now: float, output_len: int, ttft_s: float | None, tpot_s: float | None) -> None:
        """A finished request. `tpot_s` None: one token (meets any TPOT SLO); `ttft_s` None: latencies
        unknown (the request counts for the output lengths only)."""
        s = self._slice(now)
        if s is None:
            return
        cfg = self.config
        s.num_finished += 1
        s.output_counts[self._bin(output_len)] += 1
        s.output_max = max(s.output_max, int(output_len))
        if ttft_s is None:
            return
        ttft_ok = cfg.ttft_slo_s is None or ttft_s <= cfg.ttft_slo_s
        tpot_ok = cfg.tpot_slo_s is None or tpot_s is None or tpot_s <= cfg.tpot_slo_s
        s.num_judged += 1
        s.num_ttft_ok += ttft_ok
        s.num_tpot_ok += tpot_ok
        s.num_slo_ok += ttft_ok and tpot_ok
        s.ttft_sum_s += ttft_s
        s.tpot_sum_s += tpot_s or 0.0

    def record_step(self, now: float, instance: str, role: Role, observed_s: float, predicted_s: float) -> None:
        s = self._slice(now)
        if s is None:
            return
        _, obs, pred, n = s.steps.get(instance, (role, 0.0, 0.0, 0))
        s.steps[instance] = (role, obs + observed_s, pred + predicted_s, n + 1)

    # ---- outputs -------------------------------------------------------------------------------
    def window(self, now: float) -> WindowStats:
        """The completed slices among the last `num_slices` (at `now`)."""
        cfg = self.config
        current = self._index(now)
        self._expire(current)
        done = [s for s in self._slices if s.index < current]
        first = max(current - cfg.num_slices, 0)
        start_at = self.start_at + first * cfg.slice_s
        end_at = self.start_at + current * cfg.slice_s
        nb = len(cfg.length_edges)
        in_counts = sum((s.input_counts for s in done), np.zeros(nb, dtype=np.int64))
        out_counts = sum((s.output_counts for s in done), np.zeros(nb, dtype=np.int64))
        judged = sum(s.num_judged for s in done)
        steps: dict[str, tuple[Role, float, float, int]] = {}
        for s in done:
            for name, (role, obs, pred, n) in s.steps.items():
                _, o0, p0, n0 = steps.get(name, (role, 0.0, 0.0, 0))
                steps[name] = (role, o0 + obs, p0 + pred, n0 + n)
        return WindowStats(
            start_at=start_at,
            end_at=max(end_at, start_at),
            num_arrivals=sum(s.num_arrivals for s in done),
            input_lengths=LengthHistogram(
                cfg.length_edges, tuple(int(c) for c in in_counts), max((s.input_max for s in done), default=0)
            ),
            output_lengths=LengthHistogram(
                cfg.length_edges, tuple(int(c) for c in out_counts), max((s.output_max for s in done), default=0)
            ),
            num_finished=sum(s.num_finished for s in done),
            num_judged=judged,
            num_ttft_ok=sum(s.num_ttft_ok for s in done),
            num_tpot_ok=sum(s.num_tpot_ok for s in done),
            num_slo_ok=sum(s.num_slo_ok for s in done),
            ttft_mean_s=sum(s.ttft_sum_s for s in done) / judged if judged else 0.0,
            tpot_mean_s=sum(s.tpot_sum_s for s in done) / judged if judged else 0.0,
            corrections={name: StepCorrection(*v) for name, v in steps.items()},
        )

    def is_full(self, now: float) -> bool:
        """Whether the window holds `num_slices` completed slices."""
        return self._index(now) >= self.config.num_slices

    def snapshot(self, now: float) -> dict[str, object]:
        """JSON-able state: config, the window's statistics and the slice being filled."""
        cfg = self.config
        current = self._index(now)
        live = next((s for s in self._slices if s.index == current), None)
        return {
            "now": now,
            "config": {
                "window_s": cfg.window_s,
                "slice_s": cfg.slice_s,
                "ttft_slo_s": cfg.ttft_slo_s,
                "tpot_slo_s": cfg.tpot_slo_s,
            },
            "window": self.window(now).to_dict(),
            "current_slice": {
                "start_at": self.start_at + current * cfg.slice_s,
                "num_arrivals": live.num_arrivals if live else 0,
                "num_finished": live.num_finished if live else 0,
            },
        }

    # ---- slices --------------------------------------------------------------------------------
    def _index(self, now: float) -> int:
        return math.floor((now - self.start_at) / self.config.slice_s + 1e-9)

    def _bin(self, length: int) -> int:
        i = int(np.searchsorted(self.config.length_edges, length, side="right")) - 1
        return max(i, 0)

    def _expire(self, current: int) -> None:
        while self._slices and self._slices[0].index < current - self.config.num_slices:
            self._slices.popleft()

    def _slice(self, now: float) -> _Slice | None:
        """The slice `now` falls in; None when it is already older than the window (a late record)."""
        index = self._index(now)
        if index > self._latest:
            self._latest = index
            self._expire(index)
        if index < self._latest - self.config.num_slices or index < 0:
            return None
        for s in reversed(self._slices):
            if s.index == index:
                return s
            if s.index < index:
                break
        new = _Slice(index, len(self.config.length_edges))
        # keep the deque ordered by index (a late record may open an older slice)
        pos = sum(1 for s in self._slices if s.index < index)
        self._slices.insert(pos, new)
        return new


# ---------------------------------------------------------------------------------------------
# Shift detection
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DetectorConfig:
    rate_change: float = 0.25  # |rate / reference − 1| that counts as a shift
    min_ks: float = 0.15  # KS distance that counts as a shift in a length distribution ...
    ks_alpha: float = 0.01  # ... when also significant at this level
    min_requests: int = 50  # fewer arrivals (or finishes) in the window than this: no verdict on it
    sustain_s: float = 120.0  # a shift must hold this long (in completed slices) before it fires
    cooldown_s: float = 1800.0  # never two replans closer than this ...
    # ... unless the window's rate × this exceeds the current plan's predicted goodput (overload;
    # None: no overload trigger)
    capacity_margin: float | None = 1.1

    def __post_init__(self) -> None:
        if self.rate_change <= 0 or not 0 < self.min_ks < 1 or not 0 < self.ks_alpha < 1:
            raise ValueError("rate_change > 0, 0 < min_ks < 1 and 0 < ks_alpha < 1 required")
        if self.sustain_s < 0 or self.cooldown_s < 0 or self.min_requests < 1:
            raise ValueError("sustain_s, cooldown_s >= 0 and min_requests >= 1 required")
        if self.capacity_margin is not None and self.capacity_margin <= 0:
            raise ValueError("capacity_margin must be > 0 (or None)")


@dataclasses.dataclass(frozen=True)
class ShiftCheck:
    """One comparison of the window with the reference: what differs, and whether it fires now."""

    at: float
    shifted: bool
    reasons: tuple[str, ...]
    rate_ratio: float | None
    input_ks: float | None
    output_ks: float | None
    shifted_since: float | None
    fire: bool
    overloaded: bool = False  # the rate × capacity_margin × load_factor exceeds the plan's predicted goodput
    load_factor: float = 1.0  # the window's requests against the reference's (`ShiftDetector.load_factor`)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class ShiftDetector:
    """Fires when the window has differed from the reference for `sustain_s`, at most once per cool-down
    (an overload of the plan's predicted goodput excepted; see the module docstring).

    Call `check(window)` after each completed slice (repeating it within a slice changes nothing).
    The first window checked with at least `min_requests` arrivals becomes the reference unless
    `set_reference` gave one.
    """

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()
        self.reference: WindowStats | None = None
        self.capacity_rps: float | None = None  # the serving plan's predicted goodput (None: unknown)
        self.last_replan_at: float | None = None
        self.shifted_since: float | None = None
        self.last_check: ShiftCheck | None = None
        self._last_checked_end: float | None = None
        self._overloaded_since: float | None = None

    def set_reference(self, window: WindowStats) -> None:
        self.reference = window
        self.shifted_since = None
        self._overloaded_since = None

    def set_capacity(self, goodput_rps: float | None) -> None:
        """The goodput the replanner predicts for the plan now serving (the plan a round kept or
        switched to); None: unknown, no overload trigger."""
        self.capacity_rps = goodput_rps

    def load_factor(self, window: WindowStats) -> float:
        """How much heavier a request of the window is than one of the reference, for the phase it
        weighs on most: max(1, prompt mean ratio, output mean ratio) (see the module docstring).

        A side is judged only when both windows hold `min_requests` of it (arrivals for prompts,
        finishes for outputs); 1.0 without a reference.
        """
        cfg, ref = self.config, self.reference
        if ref is None:
            return 1.0
        factor = 1.0
        sides = (
            (window.input_lengths, ref.input_lengths, window.num_arrivals, ref.num_arrivals),
            (window.output_lengths, ref.output_lengths, window.num_finished, ref.num_finished),
        )
        for now, then, n_now, n_then in sides:
            if n_now >= cfg.min_requests and n_then >= cfg.min_requests and then.mean() > 0:
                factor = max(factor, now.mean() / then.mean())
        return factor

    def overloaded(self, window: WindowStats) -> str | None:
        """Why the window overloads the serving plan (None when it does not, or cannot be judged)."""
        cfg, ref, cap = self.config, self.reference, self.capacity_rps
        margin = cfg.capacity_margin
        if margin is None or cap is None or ref is None or window.num_arrivals < cfg.min_requests:
            return None
        if cap < ref.rate * margin:  # short already when adopted: another round would say the same
            return None
        load = self.load_factor(window)
        if window.rate * margin * load <= cap:
            return None
        mix = "" if load == 1.0 else f" x mix load {load:.3g}"
        return f"rate {window.rate:.3g} rps x margin {margin:g}{mix} exceeds the plan's predicted goodput {cap:.3g} rps"

    def mark_replanned(self, now: float, window: WindowStats) -> None:
        """A replan ran (whether or not it switched): start the cool-down; `window` is the new reference."""
        self.last_replan_at = now
        self.set_reference(window)

    def compare(self, window: WindowStats) -> tuple[list[str], float | None, float | None, float | None]:
        """(reasons, rate ratio, input KS, output KS) of the window against the reference."""
        cfg, ref = self.config, self.reference
        assert ref is not None
        reasons: list[str] = []
        ratio = in_ks = out_ks = None
        if window.num_arrivals >= cfg.min_requests and ref.num_arrivals >= cfg.min_requests and ref.rate > 0:
            ratio = window.rate / ref.rate
            if abs(ratio - 1) >= cfg.rate_change:
                reasons.append(f"rate {window.rate:.3g} rps is {ratio:.2f}x the reference {ref.rate:.3g} rps")
            in_ks = self._lengths_moved("prompt", window.input_lengths, ref.input_lengths, reasons)
        if window.num_finished >= cfg.min_requests and ref.num_finished >= cfg.min_requests:
            out_ks = self._lengths_moved("output", window.output_lengths, ref.output_lengths, reasons)
        return reasons, ratio, in_ks, out_ks

    def _lengths_moved(self, what: str, now: LengthHistogram, ref: LengthHistogram, reasons: list[str]) -> float:
        """The KS distance of `now` from `ref`; a reason is appended when it clears the bar (the test's critical
        value at `ks_alpha`, at least `min_ks`)."""
        ks = ks_distance(now, ref)
        bar = max(self.config.min_ks, ks_critical(now.total, ref.total, self.config.ks_alpha))
        if ks >= bar:
            reasons.append(
                f"{what} lengths moved (KS {ks:.3f} >= {bar:.3f}; mean {ref.mean():.0f} -> {now.mean():.0f})"
            )
        return ks

    def check(self, window: WindowStats) -> ShiftCheck:
        cfg = self.config
        now = window.end_at
        if self._last_checked_end == now and self.last_check is not None:
            return self.last_check  # same completed slices: same answer
        self._last_checked_end = now
        if self.reference is None:
            if window.num_arrivals >= cfg.min_requests:
                self.set_reference(window)
            check = ShiftCheck(now, False, ("no reference yet",), None, None, None, None, False)
            self.last_check = check
            return check
        reasons, ratio, in_ks, out_ks = self.compare(window)
        overload = self.overloaded(window)
        if overload is not None:
            reasons.append(overload)
        shifted = bool(reasons)
        if not shifted:
            self.shifted_since = None
        elif self.shifted_since is None:
            self.shifted_since = now  # the end of the first window that showed it
        if overload is None:
            self._overloaded_since = None
        elif self._overloaded_since is None:
            self._overloaded_since = now
        fire = False
        if shifted:
            assert self.shifted_since is not None
            held = now - self.shifted_since
            cooling = self.last_replan_at is not None and now - self.last_replan_at < cfg.cooldown_s
            overload_held = self._overloaded_since is not None and now - self._overloaded_since >= cfg.sustain_s
            if held < cfg.sustain_s:
                reasons.append(f"held {held:g} s of {cfg.sustain_s:g} s")
            elif cooling and not overload_held:
                assert self.last_replan_at is not None
                reasons.append(f"cooling down until {self.last_replan_at + cfg.cooldown_s:g}")
            else:
                if cooling:
                    reasons.append("overloaded: the cool-down does not hold this back")
                fire = True
        check = ShiftCheck(
            now,
            shifted,
            tuple(reasons),
            ratio,
            in_ks,
            out_ks,
            self.shifted_since,
            fire,
            overload is not None,
            self.load_factor(window),
        )
        self.last_check = check
        return check

    def snapshot(self) -> dict[str, object]:
        return {
            "config": dataclasses.asdict(self.config),
            "reference": self.reference.to_dict() if self.reference is not None else None,
            "capacity_rps": self.capacity_rps,
            "last_replan_at": self.last_replan_at,
            "shifted_since": self.shifted_since,
            "last_check": self.last_check.to_dict() if self.last_check is not None else None,
        }
