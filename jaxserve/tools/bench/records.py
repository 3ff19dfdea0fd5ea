"""Per-request measurements of a bench run and the summary over them.

Definitions (the same as vLLM's `bench serve`, all on the client's monotonic clock):

* **TTFT** — first streamed chunk carrying a token − the moment the request was sent;
* **E2E** — last chunk − sent;
* **TPOT** — (E2E − TTFT) / (output tokens − 1); 0 for a one-token output;
* **ITL** — the gap between successive token-carrying chunks (one per chunk: a chunk holding
  several tokens is one gap, as vLLM counts it).

A request *attains* the SLO when TTFT ≤ ttft_s and TPOT ≤ tpot_s (`placement.slo`, joint mode);
failed requests count as misses. `request_goodput` is vLLM's: requests that attain, per second of
benchmark duration (first send to last completion).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from placement.slo import SloSpec
from placement.slo import attainment as slo_attainment

PERCENTILES = (50, 90, 99)


class ServerTimings(Protocol):
    """A server's own view of one request's timing (`core.request.RequestTimings`, the client's `wire.Timings`)."""

    @property
    def ttft_s(self) -> float | None: ...

    @property
    def tpot_s(self) -> float | None: ...


@dataclasses.dataclass
class RequestRecord:
    """One request: what was asked, when it left, and when each chunk of tokens came back.

    Times are seconds since the start of the run (`scheduled_at` is the workload's arrival time,
    `sent_at` when the request really left; they differ when `--max-concurrency` holds it back
    or the client falls behind).
    """

    index: int
    input_len: int
    output_len: int  # requested (max_tokens, with ignore_eos)
    scheduled_at: float
    sent_at: float = math.nan
    chunk_at: list[float] = dataclasses.field(default_factory=list)  # arrival of each token-carrying chunk
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)  # tokens in each such chunk
    finished_at: float = math.nan
    error: str | None = None
    server_ttft_s: float | None = None  # the server's own view, when it reports one
    server_tpot_s: float | None = None
    cached_tokens: int | None = None  # prompt tokens the server served from a prefix cache (usage)
    kv_transfer_bytes: int | None = None  # KV bytes the server moved for this request
    conversation: int | None = None  # multi-turn workloads: which conversation, which turn
    turn: int | None = None

    def record_chunk(self, at: float, num_tokens: int) -> None:
        """A chunk carrying `num_tokens` new tokens arrived `at` (seconds on the run's clock); one with none counts
        nothing (the final chunk may carry only the finish reason)."""
        if num_tokens:
            self.chunk_at.append(at)
            self.chunk_tokens.append(num_tokens)

    def record_end(self, at: float, finish_reason: str | None, timings: ServerTimings | None) -> None:
        """The final chunk arrived `at` (seconds on the run's clock): an abort is this request's error; `timings`
        are the server's own view of it (its TTFT and TPOT), when it reports them."""
        self.finished_at = at
        if finish_reason == "abort":
            self.error = "aborted by the server"
        if timings is not None:
            self.server_ttft_s = timings.ttft_s
            self.server_tpot_s = timings.tpot_s

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_at) and not math.isnan(self.finished_at)

    @property
    def num_output_tokens(self) -> int:
        return int(sum(self.chunk_tokens))

    @property
    def ttft_s(self) -> float:
        return self.chunk_at[0] - self.sent_at if self.ok else math.nan

    @property
    def e2e_s(self) -> float:
        return self.chunk_at[-1] - self.sent_at if self.ok else math.nan

    @property
    def tpot_s(self) -> float:
        if not self.ok:
            return math.nan
        n = self.num_output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else 0.0

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_at, self.chunk_at[1:], strict=False)] if self.ok else []

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            ok=self.ok,
            num_output_tokens=self.num_output_tokens,
            ttft_s=_finite_or_none(self.ttft_s),
            tpot_s=_finite_or_none(self.tpot_s),
            e2e_s=_finite_or_none(self.e2e_s),
            itl_s=self.itl_s,
        )
        for key in ("sent_at", "finished_at"):
            out[key] = _finite_or_none(out[key])
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in raw.items() if k in names}
        for key in ("sent_at", "finished_at"):
            if kept.get(key) is None:
                kept[key] = math.nan
        return cls(**kept)


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def latency_arrays(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT, TPOT) per request in seconds, +inf for failed requests (they never attain)."""
    ttft = np.array([r.ttft_s if r.ok else math.inf for r in records], dtype=np.float64)
    tpot = np.array([r.tpot_s if r.ok else math.inf for r in records], dtype=np.float64)
    return ttft, tpot


def attainment(records: Sequence[RequestRecord], slo: SloSpec) -> float:
    """Share of all requests meeting the SLO (failed ones are misses)."""
    ttft, tpot = latency_arrays(records)
    return slo_attainment(ttft, tpot, slo)


def tightest_slo_scale(records: Sequence[RequestRecord], slo: SloSpec) -> float:
    """The smallest s such that SLOs × s are met by the target share of these requests.

    Exact, not searched: request i attains at scale s iff s ≥ max(TTFTᵢ/ttft_s, TPOTᵢ/tpot_s),
    so the answer is the ⌈target·N⌉-th smallest of those per-request scales (inf when failures
    leave too few requests). Joint mode only; p90 mode takes the larger of the per-metric answers.
    """
    ttft, tpot = latency_arrays(records)
    need = slo.required(len(records))
    if need == 0:
        return 0.0
    if slo.mode == "joint":
        scales = np.maximum(ttft / slo.ttft_s, tpot / slo.tpot_s)
        return float(np.sort(scales)[need - 1])
    return float(max(np.sort(ttft / slo.ttft_s)[need - 1], np.sort(tpot / slo.tpot_s)[need - 1]))


def attainment_vs_scale(records: Sequence[RequestRecord], slo: SloSpec, scales: Sequence[float]) -> list[float]:
    """Attainment of the same requests at each SLO scale (the paper's SLO-scale axis)."""
    return [attainment(records, slo.scaled(s)) for s in scales]


def _stats(values: Sequence[float]) -> dict[str, float]:
    if len(values) == 0:
        return {"mean": math.nan, "median": math.nan, **{f"p{q}": math.nan for q in PERCENTILES if q != 50}}
    arr = np.asarray(values, dtype=np.float64)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr))}
    for q in PERCENTILES:
        if q != 50:
            out[f"p{q}"] = float(np.percentile(arr, q))
    return out


def summarize(records: Sequence[RequestRecord], slo: SloSpec | None = None) -> dict[str, Any]:
    """Counts, throughput, latency statistics (seconds) and, with `slo`, attainment and request goodput."""
    done = [r for r in records if r.ok]
    sent = [r.sent_at for r in records if not math.isnan(r.sent_at)]
    ends = [r.finished_at for r in records if not math.isnan(r.finished_at)]
    duration = (max(ends) - min(sent)) if sent and ends else 0.0
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "total_input_tokens": int(sum(r.input_len for r in done)),
        "total_output_tokens": int(sum(r.num_output_tokens for r in done)),
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": sum(r.num_output_tokens for r in done) / duration if duration > 0 else 0.0,
        "short_outputs": sum(1 for r in done if r.num_output_tokens != r.output_len),
    }
    out["ttft_s"] = _stats([r.ttft_s for r in done])
    out["tpot_s"] = _stats([r.tpot_s for r in done if r.num_output_tokens > 1])
    out["itl_s"] = _stats([g for r in done for g in r.itl_s])
    out["e2e_s"] = _stats([r.e2e_s for r in done])
    if any(r.cached_tokens is not None for r in done):
        prompt = sum(r.input_len for r in done)
        cached = sum(r.cached_tokens or 0 for r in done)
        out["cached_tokens"] = cached
        out["hit_rate"] = cached / prompt if prompt else 0.0
    if any(r.kv_transfer_bytes is not None for r in done):
        out["kv_transfer_bytes"] = sum(r.kv_transfer_bytes or 0 for r in done)
    if slo is not None:
        ttft, tpot = latency_arrays(records)
        good = int(np.sum((ttft <= slo.ttft_s) & (tpot <= slo.tpot_s)))
        out["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment_target": slo.attainment}
        out["attainment"] = slo_attainment(ttft, tpot, slo)
        out["request_goodput"] = good / duration if duration > 0 else 0.0
        out["tightest_slo_scale"] = tightest_slo_scale(records, slo)
    return out


def format_summary(summary: dict[str, Any], title: str = "") -> str:
    """The summary as a fixed-width table (milliseconds), like vLLM's result block."""
    width = 50
    lines = [f"{(' ' + title + ' ') if title else ''}".center(width, "=")]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:<34}{value:>16}")

    row("Requests (completed / sent)", f"{summary['completed']} / {summary['num_requests']}")
    row("Failed requests", str(summary["failed"]))
    row("Benchmark duration (s)", f"{summary['duration_s']:.2f}")
    row("Request throughput (req/s)", f"{summary['request_throughput']:.3f}")
    row("Output token throughput (tok/s)", f"{summary['output_throughput']:.1f}")
    if "attainment" in summary:
        slo = summary["slo"]
        row(f"SLO attainment (TTFT≤{slo['ttft_s'] * 1e3:g}ms,", "")
        row(f"  TPOT≤{slo['tpot_s'] * 1e3:g}ms)", f"{summary['attainment'] * 100:.1f} %")
        row("Request goodput (req/s)", f"{summary['request_goodput']:.3f}")
        row("Tightest SLO scale at target", f"{summary['tightest_slo_scale']:.3f}")
    if "hit_rate" in summary:
        row("Prefix-cache hit rate (tokens)", f"{summary['hit_rate'] * 100:.1f} %")
    if "kv_transfer_bytes" in summary:
        row("KV bytes moved (MB)", f"{summary['kv_transfer_bytes'] / 1e6:.2f}")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency")):
        lines.append(f" {label} (ms) ".center(width, "-"))
        stats = summary[key]
        for stat in ("mean", "median", "p90", "p99"):
            name = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            row(f"{name} {label}", f"{stats[stat] * 1e3:.2f}")
    lines.append("=" * width)
    return "\n".join(lines)
