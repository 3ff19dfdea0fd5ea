"""Workloads: requests `(arrival_at, input_len, output_len)`, their arrival processes and length distributions.

Length distributions (fitted to the means in shared/reference/distserve-numbers.md, since the data sets
themselves are not available here):

* `sharegpt` — conversations: both lengths **lognormal with σ = 1.0**. Chat prompts and replies are
  strongly right-skewed (many short turns, a long tail of pasted documents/code); a lognormal with
  σ ≈ 1 has a median about 0.6 of its mean and a P99 about 6× the median, like the published ShareGPT
  histograms. Inputs are clipped to [4, 2047], outputs to [2, 2048 − input] (OPT has 2048 positions).
  The output mean before that cut is set to 230.66 so the mean after it is 200.3.
* `humaneval` — 164 short, similar problems: **lognormal, σ = 0.35 for prompts and 0.5 for
  completions** — narrow, little tail.
* `longbench` — summarisation of long documents capped at 2048 OPT positions: **lognormal σ = 0.5**
  for inputs, clipped to [64, 1920] so the mass piles up near the cap like the truncated real data;
  outputs lognormal σ = 0.6.
* `fixed:IN:OUT` — every request IN prompt tokens and OUT output tokens.

μ of each lognormal is solved (bisection on the closed-form mean of a clipped lognormal) so the
*clipped* mean equals the published mean. Arrivals: Poisson at rate R, or Gamma inter-arrival times
with coefficient of variation `cv` (cv > 1 is burstier than Poisson). The caller owns the
`numpy.random.Generator`. JSONL traces: one object per line with `arrival_at`, `input_len`, `output_len`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

MAX_POSITIONS = 2048


@dataclasses.dataclass(frozen=True)
class ClippedLognormal:
    """A lognormal clipped to [low, high], parameterised by the mean it has after clipping."""

    mean: float
    sigma: float
    low: int
    high: int

    @property
    def mu(self) -> float:
        return _solve_mu(self.mean, self.sigma, self.low, self.high)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        values = rng.lognormal(self.mu, self.sigma, size=n)
        return np.clip(np.rint(values), self.low, self.high).astype(np.int64)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """E[clip(X, low, high)] for X ~ LogNormal(mu, sigma)."""
    a, b = math.log(low), math.log(high)
    inside = math.exp(mu + sigma**2 / 2) * (_phi((b - mu - sigma**2) / sigma) - _phi((a - mu - sigma**2) / sigma))
    return low * _phi((a - mu) / sigma) + inside + high * (1.0 - _phi((b - mu) / sigma))


def _solve_mu(mean: float, sigma: float, low: float, high: float) -> float:
    if not low < mean < high:
        raise ValueError(f"mean {mean} must lie strictly inside [{low}, {high}]")
    lo, hi = math.log(low) - 10 * sigma, math.log(high) + 10 * sigma
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if clipped_lognormal_mean(mid, sigma, low, high) < mean:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Input and output length samplers; output is cut so input + output ≤ max_positions."""

    name: str
    input: ClippedLognormal | int
    output: ClippedLognormal | int
    max_positions: int = MAX_POSITIONS

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        inputs = _draw(self.input, rng, n)
        outputs = _draw(self.output, rng, n)
        outputs = np.minimum(outputs, self.max_positions - inputs)
        if np.any(outputs < 1):
            raise ValueError(
                f"workload {self.name}: input lengths leave no room for output within {self.max_positions}"
            )
        return inputs, outputs


def _draw(spec: ClippedLognormal | int, rng: np.random.Generator, n: int) -> np.ndarray:
    if isinstance(spec, int):
        return np.full(n, spec, dtype=np.int64)
    return spec.sample(rng, n)


LENGTH_DISTRIBUTIONS: dict[str, LengthDistribution] = {
    "sharegpt": LengthDistribution(
        "sharegpt",
        ClippedLognormal(755.5, 1.0, 4, MAX_POSITIONS - 1),
        # 230.66 before the cut input + output <= 2048, which brings the sampled mean to 200.3.
        ClippedLognormal(230.66, 1.0, 2, MAX_POSITIONS),
    ),
    "humaneval": LengthDistribution(
        "humaneval", ClippedLognormal(171.3, 0.35, 16, 1024), ClippedLognormal(98.2, 0.5, 2, 1024)
    ),
    "longbench": LengthDistribution(
        "longbench", ClippedLognormal(1738.3, 0.5, 64, 1920), ClippedLognormal(90.7, 0.6, 2, 128)
    ),
}


def get_length_distribution(name: str, max_positions: int = MAX_POSITIONS) -> LengthDistribution:
    """`sharegpt`, `humaneval`, `longbench` or `fixed:IN:OUT`."""
    if name.startswith("fixed:"):
        parts = name.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"bad fixed workload {name!r}: expected fixed:IN:OUT, e.g. fixed:512:64")
        n_in, n_out = int(parts[1]), int(parts[2])
        if n_in < 1 or n_out < 1 or n_in + n_out > max_positions:
            raise ValueError(f"fixed workload {name!r}: need IN, OUT >= 1 and IN + OUT <= {max_positions}")
        return LengthDistribution(name, n_in, n_out, max_positions)
    if name not in LENGTH_DISTRIBUTIONS:
        raise ValueError(
            f"unknown workload {name!r}; known: {', '.join(LENGTH_DISTRIBUTIONS)}, fixed:IN:OUT, FILE.jsonl"
        )
    return dataclasses.replace(LENGTH_DISTRIBUTIONS[name], max_positions=max_positions)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests as parallel arrays, sorted by arrival. `rate` is the arrival rate the arrivals were drawn at."""

    arrival_at: np.ndarray  # [N] float64, seconds
    input_lens: np.ndarray  # [N] int64
    output_lens: np.ndarray  # [N] int64
    rate: float

    def __post_init__(self) -> None:
        n = len(self.arrival_at)
        if len(self.input_lens) != n or len(self.output_lens) != n:
            raise ValueError("arrival_at, input_lens and output_lens must have the same length")
        if n and (np.any(np.diff(self.arrival_at) < 0) or np.any(self.input_lens < 1) or np.any(self.output_lens < 1)):
            raise ValueError("arrivals must be sorted and lengths >= 1")

    def __len__(self) -> int:
        return len(self.arrival_at)

    def with_rate(self, rate: float) -> Workload:
        """The same requests and the same arrival pattern, time-scaled to another rate."""
        if rate <= 0:
            raise ValueError("rate must be positive")
        return dataclasses.replace(self, arrival_at=self.arrival_at * (self.rate / rate), rate=rate)

    def head(self, n: int) -> Workload:
        return dataclasses.replace(
            self, arrival_at=self.arrival_at[:n], input_lens=self.input_lens[:n], output_lens=self.output_lens[:n]
        )

    def to_jsonl(self, path: str | Path) -> None:
        with Path(path).open("w") as fh:
            for t, i, o in zip(self.arrival_at, self.input_lens, self.output_lens, strict=True):
                fh.write(
                    json.dumps({"arrival_at": round(float(t), 6), "input_len": int(i), "output_len": int(o)}) + "\n"
                )

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Workload:
        arrivals, inputs, outputs = [], [], []
        with Path(path).open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    arrivals.append(float(row["arrival_at"]))
                    inputs.append(int(row["input_len"]))
                    outputs.append(int(row["output_len"]))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{lineno}: bad trace line ({e})") from None
        if not arrivals:
            raise ValueError(f"trace {path} holds no requests")
        order = np.argsort(np.asarray(arrivals), kind="stable")
        arrival_at = np.asarray(arrivals, dtype=np.float64)[order]
        span = float(arrival_at[-1] - arrival_at[0])
        rate = (len(arrival_at) - 1) / span if span > 0 and len(arrival_at) > 1 else 1.0
        return cls(
            arrival_at, np.asarray(inputs, dtype=np.int64)[order], np.asarray(outputs, dtype=np.int64)[order], rate
        )


def arrival_times(rng: np.random.Generator, rate: float, n: int, cv: float = 1.0) -> np.ndarray:
    """n arrival times: Poisson (cv = 1) or Gamma inter-arrivals with the given coefficient of variation."""
    if rate <= 0 or n < 0 or cv <= 0:
        raise ValueError("rate and cv must be positive and n non-negative")
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    return np.cumsum(gaps)


def generate(
    lengths: LengthDistribution | str,
    rate: float,
    num_requests: int,
    rng: np.random.Generator,
    cv: float = 1.0,
) -> Workload:
    """Sample a workload: lengths from the distribution, arrivals at `rate` (Poisson, or Gamma with `cv`)."""
    dist = get_length_distribution(lengths) if isinstance(lengths, str) else lengths
    inputs, outputs = dist.sample(rng, num_requests)
    return Workload(arrival_times(rng, rate, num_requests, cv), inputs, outputs, rate)


def load_workload(
    spec: str,
    rate: float,
    num_requests: int,
    rng: np.random.Generator,
    cv: float = 1.0,
    max_positions: int = MAX_POSITIONS,
) -> Workload:
    """A named distribution / `fixed:IN:OUT` sampled at `rate`, or a JSONL trace (rescaled to `rate`)."""
    if spec.endswith(".jsonl"):
        return Workload.from_jsonl(spec).with_rate(rate)
    return generate(get_length_distribution(spec, max_positions), rate, num_requests, rng, cv)
