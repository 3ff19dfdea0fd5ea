"""Fitting the Appendix-A latency coefficients and the per-step overhead to measured step times (numpy, no JAX).

`jaxserve profile` (the JAX side is `jaxserve/runtime/step_timing.py`) times the real engine at a grid of
batch shapes; this module turns those times into a profile entry `placement/latency.py` reads, in exactly
the terms the simulator's step formulas (`placement/step_time.py`) charge at pp = 1:

* prefill step of prompts `l` (padded to the engine's buckets when `padding` is given):
  `C1·(L·W·Σl + head·B) + C2·3L(h/tp)·Σl²/b + overhead(Σl, prefill)`;
* decode step of `B` rows over `Σctx`: `max(C4, C1·B)·(L·W + head) + C5·3L(h/tp)·Σctx + C6 + overhead(Σctx)`;
* `overhead(n, prefill) = fixed_s + per_ctx_token_s·n (+ prefill_s on a prompt step)` — the profile's
  `step_overhead`, host time charged on the *actual* tokens while the kernel terms see the padded shape.

All of it is one non-negative least squares over the prefill and decode samples together (C1 is shared
by the prefill GEMMs and compute-bound decode steps). The decode formula's `max(C4, C1·B)` roofline is
handled by trying every batch size as the memory/compute split and keeping the best split consistent
with its own C4. Rows are weighted by 1/seconds, so the fit minimises *relative* error: a 2 ms step
and a 200 ms step count alike.

At pp = 1 a per-step constant cannot be told apart from a per-stage one, so the fitted constants go to
`step_overhead` (once per step, as the host work they are): `fixed_s` is the smaller of the prefill and
decode step constants, and the excess goes to `prefill_s` (prompt steps) or `C6` (decode steps); `C3`
is 0. Every term is non-negative, and each phase's constant is reproduced exactly.

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

from jaxserve.runtime.step_samples import DecodeSample, PrefillSample
from models.config import OPTConfig
from placement.latency import DEFAULT_BLOCK_SIZE, allreduce_bytes_per_device, layer_gemm_macs
from placement.padding import EnginePadding

__all__ = [
    "DecodeSample",
    "FitError",
    "InstanceFit",
    "PrefillSample",
    "detect_lm",
    "fit_instance",
    "nnls",
    "profile_entry",
    "samples_from_steps",
]


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


# Columns of the joint fit.
_C1, _C2, _C4, _C5, _PREFILL_CONST, _DECODE_CONST, _PER_CTX, _ALLREDUCE = range(8)


def _prefill_row(
    cfg: OPTConfig, tp: int, lengths: Sequence[int], padded: Sequence[int], block_size: int
) -> list[float]:
    """Features of one prefill step: kernel terms on the `padded` batch, overhead on the actual `lengths`."""
    t = float(sum(padded))
    t2 = float(sum(n * n for n in padded))
    L, h = cfg.num_layers, cfg.hidden_size
    row = [0.0] * 8
    row[_C1] = L * _layer_elems(cfg, tp) * t + _lm_head_macs(cfg, tp, len(padded))
    row[_C2] = L * 3 * (h / tp) * t2 / block_size
    row[_PREFILL_CONST] = 1.0
    row[_PER_CTX] = float(sum(lengths))
    row[_ALLREDUCE] = 2 * L * allreduce_bytes_per_device(cfg, tp, int(t))
    return row


def _decode_row(
    cfg: OPTConfig, tp: int, ctx_sum: float, rows: int, padded_ctx: float, compute_bound: bool
) -> list[float]:
    """Features of one decode step of `rows` (padded) rows: GEMMs on C1·B when compute-bound, else on C4."""
    L, h = cfg.num_layers, cfg.hidden_size
    weights = L * _layer_elems(cfg, tp) + cfg.vocab_size * cfg.embed_dim / tp
    row = [0.0] * 8
    if compute_bound:
        row[_C1] = rows * weights
    else:
        row[_C4] = weights
    row[_C5] = L * 3 * (h / tp) * padded_ctx
    row[_DECODE_CONST] = 1.0
    row[_PER_CTX] = float(ctx_sum)
    row[_ALLREDUCE] = 2 * L * allreduce_bytes_per_device(cfg, tp, rows)
    return row


def _padded_lengths(lengths: Sequence[int], padding: EnginePadding | None) -> Sequence[int]:
    if padding is None:
        return lengths
    t, _, b = padding.prefill(float(sum(lengths)), float(sum(n * n for n in lengths)), len(lengths))
    return [round(t / b)] * b


def _rel_errors(pred: np.ndarray, y: np.ndarray) -> FitError:
    rel = np.abs(pred - y) / y
    return FitError(float(rel.mean()), float(rel.max()), len(y))


@dataclasses.dataclass(frozen=True)
class InstanceFit:
    """C1..C6 (and `allreduce_s_per_byte` at tp > 1), the step overhead, and the fit error per phase."""

    coefficients: dict[str, float]
    overhead: tuple[float, float, float]  # step_overhead: fixed_s, per_ctx_token_s, prefill_s
    prefill_error: FitError
    decode_error: FitError


def fit_instance(
    cfg: OPTConfig,
    tp: int,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    block_size: int = DEFAULT_BLOCK_SIZE,
    link_latency_s: float = 10e-6,
    padding: EnginePadding | None = None,
) -> InstanceFit:
    """Fit one instance's latency model to its prefill and decode step times (the formulas in the module doc).

    With `padding`, the kernel features are those of the padded batch the engine really computes; the
    overhead's per-token term stays on the actual tokens, as `placement/step_time.py` charges it.
    """
    if len(prefill) < 3 or len(decode) < 3:
        raise ValueError("need at least 3 prefill and 3 decode samples")
    cols = [_C1, _C2, _C4, _C5, _PREFILL_CONST, _DECODE_CONST, _PER_CTX] + ([_ALLREDUCE] if tp > 1 else [])
    fixed = 0.0 if tp == 1 else 2 * cfg.num_layers * 2 * (tp - 1) * link_latency_s  # all-reduce latency
    pre_rows = [_prefill_row(cfg, tp, s.lengths, _padded_lengths(s.lengths, padding), block_size) for s in prefill]
    shapes = [(s.ctx_sum, *(padding.decode(s.batch, s.ctx_sum) if padding else (s.batch, s.ctx_sum))) for s in decode]
    y = np.array([s.seconds for s in prefill] + [s.seconds for s in decode])
    w = 1.0 / y
    n_pre = len(prefill)
    best: tuple[bool, float, np.ndarray, np.ndarray] | None = None
    for split in [*sorted({rows for _, rows, _ in shapes}), math.inf]:  # decode rows ≥ split: compute-bound
        dec_rows = [_decode_row(cfg, tp, ctx, rows, pctx, rows >= split) for ctx, rows, pctx in shapes]
        a = np.array(pre_rows + dec_rows)[:, cols]
        coef = nnls(a * w[:, None], (y - fixed) * w)
        pred = a @ coef + fixed
        resid = float(np.sum(((pred - y) * w) ** 2))
        c1, c4 = coef[cols.index(_C1)], coef[cols.index(_C4)]
        consistent = all((c1 * rows >= c4 * (1 - 1e-6)) == (rows >= split) for _, rows, _ in shapes) if c4 > 0 else True
        if best is None or (not consistent, resid) < (best[0], best[1]):
            best = (not consistent, resid, coef, pred)
    assert best is not None
    _, _, coef, pred = best
    got = dict(zip(cols, map(float, coef), strict=True))
    base = min(got[_PREFILL_CONST], got[_DECODE_CONST])
    coefficients = {
        "C1": got[_C1],
        "C2": got[_C2],
        "C3": 0.0,
        "C4": got[_C4],
        "C5": got[_C5],
        "C6": got[_DECODE_CONST] - base,
    }
    if tp > 1:
        coefficients["allreduce_s_per_byte"] = got[_ALLREDUCE]
    return InstanceFit(
        coefficients,
        (base, got[_PER_CTX], got[_PREFILL_CONST] - base),
        _rel_errors(pred[:n_pre], y[:n_pre]),
        _rel_errors(pred[n_pre:], y[n_pre:]),
    )


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
    """One profile entry (the schema in `placement/latency.py`): C1..C6, `step_overhead`, L_m, and the fit
    errors under `fit`.

    With `padding` the coefficients are per padded element; the entry says so under `engine_padding`
    and `LatencyProvider.instance` then charges padded shapes.
    """
    fit = fit_instance(cfg, tp, prefill, decode, block_size, padding=padding)
    entry: dict[str, Any] = {
        "engine": engine,
        "model": cfg.name.lower(),
        "tp": tp,
        **fit.coefficients,
        "step_overhead": list(fit.overhead),
        "block_size": block_size,
        "L_m": l_m if l_m is not None else detect_lm(prefill, saturation),
        "fit": {"prefill": fit.prefill_error.to_dict(), "decode": fit.decode_error.to_dict()},
    }
    if padding is not None:
        entry["engine_padding"] = dataclasses.asdict(padding)
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
