"""Fitting the Appendix-A latency coefficients and the per-step overhead to measured step times (numpy, no JAX).

`jaxserve profile` (the JAX side is `jaxserve/runtime/profiling.py`) times the real engine at a grid of
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

**Bucket costs** (with `padding`, i.e. a bucketed engine; `fit_bucket_costs`): with that step overhead
taken off, each padded bucket gets its own cost (prefill: padded Σl; decode: padded rows) and attention
its C2 / C5 line, fitted within the buckets; the entry's `bucket_costs` then charge instead of C1..C6
(`placement/bucket_latency.py` says why: XLA:CPU's step cost is concave in its rows, no line through it).

The fit error (mean and max relative error per phase) of what the entry charges goes into it under `fit`
(and the Appendix form's own under `fit_appendix` when bucket costs charge), so a profile says how well
it describes the machine it came from.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxserve.core.step_samples import DecodeSample, PrefillSample
from models.config import ModelConfig
from placement.bucket_latency import BucketCosts
from placement.latency import (
    DEFAULT_ATTENTION_TILE,
    StepOverhead,
    allreduce_bytes_per_device,
    attention_factor,
    layer_gemm_macs,
)
from placement.padding import EnginePadding

__all__ = [
    "DecodeSample",
    "FitError",
    "InstanceFit",
    "PrefillSample",
    "detect_lm",
    "fit_bucket_costs",
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


def _layer_elems(cfg: ModelConfig, tp: int) -> float:
    return layer_gemm_macs(cfg, tp, 1)  # (4h² + 2hm)/tp: weight elements per layer = MACs per token


def _lm_head_macs(cfg: ModelConfig, tp: int, batch: int) -> float:
    return batch * cfg.vocab_size * cfg.embed_dim / tp


# Columns of the joint fit.
_C1, _C2, _C4, _C5, _PREFILL_CONST, _DECODE_CONST, _PER_CTX, _ALLREDUCE = range(8)


def _prefill_row(
    cfg: ModelConfig, tp: int, lengths: Sequence[int], padded: Sequence[int], attention_tile: int
) -> list[float]:
    """Features of one prefill step: kernel terms on the `padded` batch, overhead on the actual `lengths`."""
    t = float(sum(padded))
    t2 = float(sum(n * n for n in padded))
    L, q = cfg.num_layers, cfg.num_heads * cfg.head_dim  # q: the query width (OPT: h)
    row = [0.0] * 8
    row[_C1] = L * _layer_elems(cfg, tp) * t + _lm_head_macs(cfg, tp, len(padded))
    row[_C2] = L * attention_factor(cfg, tp) * (q / tp) * t2 / attention_tile  # OPT: L·3(h/tp)
    row[_PREFILL_CONST] = 1.0
    row[_PER_CTX] = float(sum(lengths))
    row[_ALLREDUCE] = 2 * L * allreduce_bytes_per_device(cfg, tp, int(t))
    return row


def _decode_row(
    cfg: ModelConfig, tp: int, ctx_sum: float, rows: int, padded_ctx: float, compute_bound: bool
) -> list[float]:
    """Features of one decode step of `rows` (padded) rows: GEMMs on C1·B when compute-bound, else on C4."""
    L, q = cfg.num_layers, cfg.num_heads * cfg.head_dim  # q: the query width (OPT: h)
    weights = L * _layer_elems(cfg, tp) + cfg.vocab_size * cfg.embed_dim / tp
    row = [0.0] * 8
    if compute_bound:
        row[_C1] = rows * weights
    else:
        row[_C4] = weights
    row[_C5] = L * attention_factor(cfg, tp) * (q / tp) * padded_ctx
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
    cfg: ModelConfig,
    tp: int,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    attention_tile: int = DEFAULT_ATTENTION_TILE,
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
    pre_rows = [_prefill_row(cfg, tp, s.lengths, _padded_lengths(s.lengths, padding), attention_tile) for s in prefill]
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


def _isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares non-decreasing sequence closest to `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2]]
    return [m for m, _, n in blocks for _ in range(int(n))]


def _fit_table(
    buckets: Sequence[int], x: Sequence[float], kernel_s: Sequence[float], seconds: Sequence[float]
) -> tuple[list[tuple[int, float]], float]:
    """Per-bucket constants g and one non-negative slope c with `kernel_s ≈ g[bucket] + c·x`, relative error.

    Weighted least squares (weights 1/seconds, as `fit_instance`): within each bucket the constant is the
    weighted mean, so the slope is the fit of the within-bucket deviations; the constants are then made
    non-decreasing in the bucket (a bigger bucket does not cost less). They may still be negative here.
    """
    w2 = 1.0 / np.asarray(seconds, dtype=np.float64) ** 2
    xs, ys, bs = np.asarray(x, dtype=np.float64), np.asarray(kernel_s, dtype=np.float64), np.asarray(buckets)
    sizes = sorted(set(int(b) for b in bs))
    mean_x = {b: float(np.average(xs[bs == b], weights=w2[bs == b])) for b in sizes}
    mean_y = {b: float(np.average(ys[bs == b], weights=w2[bs == b])) for b in sizes}
    dx = xs - np.array([mean_x[int(b)] for b in bs])
    dy = ys - np.array([mean_y[int(b)] for b in bs])
    denom = float(np.sum(w2 * dx * dx))
    slope = max(0.0, float(np.sum(w2 * dx * dy)) / denom) if denom > 0 else 0.0
    raw = [mean_y[b] - slope * mean_x[b] for b in sizes]
    weight = [float(np.sum(w2[bs == b])) for b in sizes]
    return list(zip(sizes, _isotonic(raw, weight), strict=True)), slope


def fit_bucket_costs(
    cfg: ModelConfig,
    tp: int,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    overhead: StepOverhead,
    padding: EnginePadding,
    attention_tile: int = DEFAULT_ATTENTION_TILE,
) -> tuple[BucketCosts, StepOverhead, FitError, FitError]:
    """`BucketCosts` of a bucketed engine (`placement/bucket_latency.py`), the step overhead they go with, and
    their fit error per phase.

    With the host's `overhead` taken off each step (as the simulator charges it, on the actual tokens), a
    prefill step's rest is its bucket's cost (padded Σl) plus `C2·L·3(h/tp)·Σl²/b` over the padded prompts,
    a decode step's its bucket's cost (padded rows) plus `C5·L·3(h/tp)·Σctx` over what the attention reads.
    A per-step constant cannot be told from a bucket's (every step has a bucket), so where `overhead`'s
    constants leave a bucket a negative cost, that much moves from them into every bucket: `fixed_s` (both
    phases) first, then `prefill_s` (prompt steps). The returned overhead says what is left.
    """
    width = cfg.num_layers * attention_factor(cfg, tp) * (cfg.num_heads * cfg.head_dim) / tp
    pre = [
        padding.prefill(float(sum(s.lengths)), float(sum(n * n for n in s.lengths)), len(s.lengths)) for s in prefill
    ]
    dec = [padding.decode(s.batch, float(s.ctx_sum)) for s in decode]
    pre_host = [overhead.step_s(float(sum(s.lengths)), 1, True) for s in prefill]
    dec_host = [overhead.step_s(float(s.ctx_sum), 1, False) for s in decode]
    pre_x = [width * t2 / attention_tile for _, t2, _ in pre]  # in the Appendix units: the slopes are C2 and C5
    dec_x = [width * ctx for _, ctx in dec]
    pre_b = [round(t) for t, _, _ in pre]
    dec_b = [rows for rows, _ in dec]
    y_pre, y_dec = [s.seconds for s in prefill], [s.seconds for s in decode]
    table_p, c2 = _fit_table(pre_b, pre_x, [y - h for y, h in zip(y_pre, pre_host, strict=True)], y_pre)
    table_d, c5 = _fit_table(dec_b, dec_x, [y - h for y, h in zip(y_dec, dec_host, strict=True)], y_dec)
    short_p, short_d = max(0.0, -min(g for _, g in table_p)), max(0.0, -min(g for _, g in table_d))
    from_fixed = min(overhead.fixed_s, max(short_p, short_d))
    from_prefill = min(overhead.prefill_s, max(0.0, short_p - from_fixed))
    kept = StepOverhead(overhead.fixed_s - from_fixed, overhead.per_ctx_token_s, overhead.prefill_s - from_prefill)
    costs = BucketCosts(
        tuple((b, max(0.0, g + from_fixed + from_prefill)) for b, g in table_p),
        tuple((b, max(0.0, g + from_fixed)) for b, g in table_d),
        c2,
        c5,
    )
    pred_p = [
        kept.step_s(float(sum(s.lengths)), 1, True) + costs.prefill_s(b) + c2 * x
        for s, b, x in zip(prefill, pre_b, pre_x, strict=True)
    ]
    pred_d = [
        kept.step_s(float(s.ctx_sum), 1, False) + costs.decode_s(b) + c5 * x
        for s, b, x in zip(decode, dec_b, dec_x, strict=True)
    ]
    return (
        costs,
        kept,
        _rel_errors(np.array(pred_p), np.array(y_pre)),
        _rel_errors(np.array(pred_d), np.array(y_dec)),
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
    cfg: ModelConfig,
    tp: int,
    engine: str,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    *,
    attention_tile: int = DEFAULT_ATTENTION_TILE,
    l_m: int | None = None,
    saturation: float = 0.9,
    padding: EnginePadding | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    """One profile entry (the schema in `placement/latency.py`): C1..C6, `step_overhead`, L_m, and the fit
    errors under `fit`; with `quantization`, samples of an engine serving its weights at that precision (the
    entry then sits beside the checkpoint precision's, and the planner takes it for instances at it).

    With `padding` the coefficients are per padded element; the entry says so under `engine_padding`
    and `LatencyProvider.instance` then charges padded shapes, from the `bucket_costs` fitted with them.
    """
    fit = fit_instance(cfg, tp, prefill, decode, attention_tile, padding=padding)
    errors = {"prefill": fit.prefill_error.to_dict(), "decode": fit.decode_error.to_dict()}
    coefficients, overhead, buckets = dict(fit.coefficients), StepOverhead(*fit.overhead), None
    if padding is not None:  # a bucketed engine: its buckets' measured costs are what the entry charges
        buckets, kept, pre_err, dec_err = fit_bucket_costs(cfg, tp, prefill, decode, overhead, padding, attention_tile)
        appendix_errors, errors = errors, {"prefill": pre_err.to_dict(), "decode": dec_err.to_dict()}
        # what moved out of the step overhead into the buckets joins the Appendix form's own constants (C3 on a
        # prefill stage, C6 on a decode one), so its predictions stay what they were fitted to
        coefficients["C3"] += (overhead.fixed_s - kept.fixed_s) + (overhead.prefill_s - kept.prefill_s)
        coefficients["C6"] += overhead.fixed_s - kept.fixed_s
        overhead = kept
    entry: dict[str, Any] = {
        "engine": engine,
        "model": cfg.name.lower(),
        "tp": tp,
        **coefficients,
        "step_overhead": [overhead.fixed_s, overhead.per_ctx_token_s, overhead.prefill_s],
        "attention_tile": attention_tile,
        "L_m": l_m if l_m is not None else detect_lm(prefill, saturation),
        "fit": errors,
    }
    if quantization is not None:
        entry["quantization"] = quantization
    if padding is not None:
        entry["engine_padding"] = dataclasses.asdict(padding)
    if buckets is not None:
        entry["bucket_costs"] = buckets.to_dict()
        entry["fit_appendix"] = appendix_errors  # how well C1..C6 alone describe the same samples
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
