"""Fitting the Appendix-A latency coefficients to measured step times (pure numpy, no JAX).

`jaxserve profile` (the JAX side is `jaxserve/runtime/step_timing.py`) times the real engine at a grid of
batch shapes; this module turns those times into a profile entry `placement/latency.py` reads:

* **prefill** samples `(prompt lengths, seconds)` fit `C1` (s per multiply-add), `C2` (s per
  attention element, the `3(h/tp)·Σl²/b` term) and `C3` (s per batch) — the prefill formula of
  `AppendixModel` is linear in them, so the fit is a non-negative least squares over its three
  features. Rows are weighted by 1/seconds, so the fit minimises *relative* error: a 2 ms step and
  a 200 ms step count alike.
* **decode** samples `(batch, Σ context, seconds)` fit `C4` (s per weight element read), `C5`
  (s per KV element read) and `C6` (s per step). The decode formula's `max(C4, C1·B)` roofline is
  handled by fixing `C1` from the prefill fit and iterating: rows whose GEMMs are compute-bound
  under the current `C4` take `C1·B` as a known term instead of the `C4` feature.
* **tp > 1** adds `allreduce_s_per_byte`, fitted on the all-reduce bytes the model charges.
* **L_m** — the prompt-token budget beyond which prefill stops gaining from batching: the smallest
  measured batch total whose throughput (tokens/s) reaches `saturation` (90 %) of the best measured.

The fit error (mean and max relative error per phase) goes into the profile entry under `fit`, so a
profile says how well the formula describes the machine it came from.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from models.config import OPTConfig
from placement.latency import DEFAULT_BLOCK_SIZE, allreduce_bytes_per_device, layer_gemm_macs
from placement.padding import EnginePadding


@dataclasses.dataclass(frozen=True)
class PrefillSample:
    lengths: tuple[int, ...]  # prompt lengths in the batch
    seconds: float


@dataclasses.dataclass(frozen=True)
class DecodeSample:
    batch: int
    ctx_sum: int  # Σ context tokens the step attends over
    seconds: float


@dataclasses.dataclass(frozen=True)
class FitError:
    mean_rel: float
    max_rel: float
    num_samples: int

    def to_dict(self) -> dict[str, float]:
        return {"mean_rel_error": self.mean_rel, "max_rel_error": self.max_rel, "num_samples": self.num_samples}


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best of every column subset's solution.

    Exact for NNLS (the optimum is the unconstrained optimum on its support), and cheap for ≤ 5 columns.
    Columns are scaled to unit norm first: the Appendix features span ~1e-10 to 1e9, and an unscaled
    `lstsq` then depends on the BLAS kernel (its rank cut-off drops the small columns on some kernels).
    """
    n = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    a = a / scale
    best: tuple[float, np.ndarray] = (math.inf, np.zeros(n))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            if np.linalg.matrix_rank(sub, tol=1e-9) < k:
                continue  # collinear columns: a smaller subset spans the same fit, deterministically
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            resid = float(np.sum((sub @ coef - y) ** 2))
            # A larger subset must improve beyond rounding, so ties do not depend on the BLAS kernel.
            if resid < best[0] * (1 - 1e-9) - 1e-30 * float(y @ y):
                full = np.zeros(n)
                full[list(cols)] = coef
                best = (resid, full)
    return best[1] / scale


def _layer_elems(cfg: OPTConfig, tp: int) -> float:
    return layer_gemm_macs(cfg, tp, 1)  # (4h² + 2hm)/tp: weight elements per layer = MACs per token


def _lm_head_macs(cfg: OPTConfig, tp: int, batch: int) -> float:
    return batch * cfg.vocab_size * cfg.embed_dim / tp


def _allreduce_latency_s(cfg: OPTConfig, tp: int, link_latency_s: float) -> float:
    return 0.0 if tp == 1 else 2 * cfg.num_layers * 2 * (tp - 1) * link_latency_s


def prefill_features(
    cfg: OPTConfig, tp: int, lengths: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE
) -> list[float]:
    """[C1, C2, C3, allreduce_s_per_byte] features of one prefill batch (the AppendixModel formula, pp = 1)."""
    t = float(sum(lengths))
    t2 = float(sum(n * n for n in lengths))
    L, h = cfg.num_layers, cfg.hidden_size
    return [
        L * _layer_elems(cfg, tp) * t + _lm_head_macs(cfg, tp, len(lengths)),
        L * 3 * (h / tp) * t2 / block_size,
        1.0,
        2 * L * allreduce_bytes_per_device(cfg, tp, int(t)),
    ]


def decode_features(
    cfg: OPTConfig, tp: int, batch: int, ctx_sum: float, c1: float, compute_bound: bool
) -> tuple[list[float], float]:
    """([C4, C5, C6, allreduce_s_per_byte] features, known seconds) of one decode step.

    A compute-bound step (the formula's `max(C4, C1·B)` taken by `C1·B`) charges its GEMMs as known
    seconds from `c1`; a memory-bound one has the weight elements as its C4 feature.
    """
    L, h = cfg.num_layers, cfg.hidden_size
    weights = L * _layer_elems(cfg, tp)
    head = cfg.vocab_size * cfg.embed_dim / tp
    c4_feature, known = (0.0, c1 * batch * (weights + head)) if compute_bound else (weights + head, 0.0)
    return [c4_feature, L * 3 * (h / tp) * ctx_sum, 1.0, 2 * L * allreduce_bytes_per_device(cfg, tp, batch)], known


def _padded_lengths(lengths: Sequence[int], padding: EnginePadding | None) -> Sequence[int]:
    if padding is None:
        return lengths
    t, _, b = padding.prefill(float(sum(lengths)), float(sum(n * n for n in lengths)), len(lengths))
    return [round(t / b)] * b


def _rel_errors(pred: np.ndarray, y: np.ndarray) -> FitError:
    rel = np.abs(pred - y) / y
    return FitError(float(rel.mean()), float(rel.max()), len(y))


@dataclasses.dataclass(frozen=True)
class PhaseFit:
    coefficients: dict[str, float]
    error: FitError


def fit_prefill(
    cfg: OPTConfig,
    tp: int,
    samples: Sequence[PrefillSample],
    block_size: int = DEFAULT_BLOCK_SIZE,
    link_latency_s: float = 10e-6,
    padding: EnginePadding | None = None,
) -> PhaseFit:
    """C1, C2, C3 (and allreduce_s_per_byte at tp > 1) from prefill step times.

    With `padding`, the features are those of the padded batch the engine really computes.
    """
    if len(samples) < 3:
        raise ValueError("need at least 3 prefill samples")
    cols = 4 if tp > 1 else 3
    a = np.array([prefill_features(cfg, tp, _padded_lengths(s.lengths, padding), block_size)[:cols] for s in samples])
    y = np.array([s.seconds for s in samples]) - _allreduce_latency_s(cfg, tp, link_latency_s)
    w = 1.0 / np.array([s.seconds for s in samples])
    coef = nnls(a * w[:, None], y * w)
    pred = a @ coef + _allreduce_latency_s(cfg, tp, link_latency_s)
    names = ["C1", "C2", "C3", "allreduce_s_per_byte"][:cols]
    return PhaseFit(
        dict(zip(names, map(float, coef), strict=True)), _rel_errors(pred, np.array([s.seconds for s in samples]))
    )


def fit_decode(
    cfg: OPTConfig,
    tp: int,
    samples: Sequence[DecodeSample],
    c1: float,
    link_latency_s: float = 10e-6,
    padding: EnginePadding | None = None,
) -> PhaseFit:
    """C4, C5, C6 (and allreduce_s_per_byte at tp > 1) from decode step times, with C1 fixed.

    The roofline `max(C4, C1·B)` splits the batches at some size: below it steps are memory-bound,
    at or above it compute-bound. Every split point is fitted; the best one that is consistent with
    its own C4 (C1·B ≤ C4 below, ≥ above) wins.
    """
    if len(samples) < 3:
        raise ValueError("need at least 3 decode samples")
    cols = 4 if tp > 1 else 3
    y_all = np.array([s.seconds for s in samples])
    w = 1.0 / y_all
    shapes = [padding.decode(s.batch, s.ctx_sum) if padding else (s.batch, s.ctx_sum) for s in samples]
    batches = sorted({b for b, _ in shapes})
    fixed = _allreduce_latency_s(cfg, tp, link_latency_s)
    best: tuple[bool, float, np.ndarray, np.ndarray] | None = None
    for split in [*batches, math.inf]:  # batches ≥ split are compute-bound
        rows = [decode_features(cfg, tp, b, ctx, c1, b >= split) for b, ctx in shapes]
        a = np.array([f[:cols] for f, _ in rows])
        known = np.array([k for _, k in rows])
        coef = nnls(a * w[:, None], (y_all - known - fixed) * w)
        pred = a @ coef + known + fixed
        resid = float(np.sum(((pred - y_all) * w) ** 2))
        c4 = coef[0]
        consistent = all((c1 * b >= c4 * (1 - 1e-6)) == (b >= split) for b, _ in shapes) if c4 > 0 else True
        key = (not consistent, resid)
        if best is None or key < (best[0], best[1]):
            best = (not consistent, resid, coef, pred)
    assert best is not None
    names = ["C4", "C5", "C6", "allreduce_s_per_byte"][:cols]
    return PhaseFit(dict(zip(names, map(float, best[2]), strict=True)), _rel_errors(best[3], y_all))


def detect_lm(samples: Sequence[PrefillSample], saturation: float = 0.9) -> int:
    """L_m: the smallest measured batch total (tokens) whose throughput is ≥ `saturation` × the best."""
    if not samples:
        raise ValueError("no prefill samples")
    totals = np.array([sum(s.lengths) for s in samples], dtype=np.float64)
    throughput = totals / np.array([s.seconds for s in samples])
    # Throughput at a total: the best over batches of that total (a batch shape, not a total, can be slow).
    best_at: dict[float, float] = {}
    for t, tput in zip(totals, throughput, strict=True):
        best_at[t] = max(best_at.get(t, 0.0), float(tput))
    peak = max(best_at.values())
    return int(min(t for t, tput in best_at.items() if tput >= saturation * peak))


def profile_entry(
    cfg: OPTConfig,
    tp: int,
    engine: str,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    l_m: int | None = None,
    saturation: float = 0.9,
    padding: EnginePadding | None = None,
) -> dict[str, Any]:
    """One profile entry (the schema in `placement/latency.py`) with its fit errors under `fit`.

    With `padding` the coefficients are per padded element; the entry says so under `engine_padding`
    and `LatencyProvider.instance` then charges padded shapes.
    """
    pf = fit_prefill(cfg, tp, prefill, block_size, padding=padding)
    df = fit_decode(cfg, tp, decode, pf.coefficients["C1"], padding=padding)
    entry: dict[str, Any] = {
        "engine": engine,
        "model": cfg.name.lower(),
        "tp": tp,
        "C1": pf.coefficients["C1"],
        "C2": pf.coefficients["C2"],
        "C3": pf.coefficients["C3"],
        "C4": df.coefficients["C4"],
        "C5": df.coefficients["C5"],
        "C6": df.coefficients["C6"],
        "block_size": block_size,
        "L_m": l_m if l_m is not None else detect_lm(prefill, saturation),
        "fit": {"prefill": pf.error.to_dict(), "decode": df.error.to_dict()},
    }
    if padding is not None:
        entry["engine_padding"] = dataclasses.asdict(padding)
    if tp > 1:
        # One all-reduce cost per byte for the instance: the prefill fit sees the large messages.
        entry["allreduce_s_per_byte"] = pf.coefficients.get("allreduce_s_per_byte", 0.0)
    return entry


def samples_from_steps(steps: Sequence[Mapping[str, Any]]) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """Prefill and decode samples from a server's step records (`GET /debug/steps`; mixed steps skipped)."""
    prefill = [
        PrefillSample(tuple(int(n) for n in s["prompt_lengths"]), float(s["seconds"]))
        for s in steps
        if s["kind"] == "prefill"
    ]
    decode = [
        DecodeSample(int(s["batch"]), int(s["ctx_sum"]), float(s["seconds"])) for s in steps if s["kind"] == "decode"
    ]
    return prefill, decode
