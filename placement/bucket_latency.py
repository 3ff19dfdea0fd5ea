"""Latency of a bucketed engine from what each of its buckets measured (numpy-free, no JAX).

`ModelEngine` runs every step in a padded bucket: prefill in a power-of-two number of prompt tokens, decode in
a power-of-two number of rows (`placement/padding.py`). The Appendix-A form charges a step's GEMMs as a line
in its tokens (`C1·t`, or `max(C4, C1·B)` for decode), which is the GPU's story: on a CPU core a GEMM of a few
rows runs far below its peak, and a step's cost grows concavely with its rows (opt-mini on one core, decode:
4.2 ms at 2 rows, 8.0 at 16, 10.1 at 32, 10.5 at 64) until it turns compute-bound. No line through those
points predicts them: fitted as `max(C4, C1·B)` they missed their own grid by 12-15 % on average and the
shapes between by up to 25 %.

`BucketCosts` keeps, per measured bucket, the seconds of a step's work that scales with its bucket and not
with attention: the layers' GEMMs, the LM head, the engine's per-step kernel constant (all-reduces included
at tp > 1) — what the Appendix form writes `L·C1·W·t + C1·V·h·B + 2L·AR(t) + C3` for prefill and
`L·max(C4, C1·B)·W + C4·V·h + 2L·AR(B) + C6` for decode. Attention stays the Appendix form's line in Σl²
(C2) and Σctx (C5), fitted with the tables and kept with them; the host's step overhead stays
`StepOverhead`. `BucketModel` charges that; it sits under `PaddedModel`, so the token counts it sees are
already the engine's buckets.

Between measured buckets the cost is interpolated linearly; below the smallest it is the smallest's (a
bucket's cost never falls with fewer tokens); beyond the largest the last segment is continued (at least
the largest's cost): a step that large is compute-bound, linear in its tokens. A pipeline stage
(`pp > 1`) is charged 1/pp of the whole model's bucket cost, as the folded form does.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Table = tuple[tuple[int, float], ...]


def _table(points: Sequence[Sequence[float]], what: str) -> Table:
    rows = sorted((int(n), float(s)) for n, s in points)
    if not rows:
        raise ValueError(f"{what}: needs at least one [tokens, seconds] point")
    if any(n < 1 or not math.isfinite(s) or s < 0 for n, s in rows):
        raise ValueError(f"{what}: tokens must be >= 1 and seconds finite and >= 0, got {rows}")
    if len({n for n, _ in rows}) != len(rows):
        raise ValueError(f"{what}: one point per bucket, got {rows}")
    return tuple(rows)


def _lookup(table: Table, n: float) -> float:
    sizes = [m for m, _ in table]
    i = bisect.bisect_left(sizes, n)
    if i < len(table) and sizes[i] == n:
        return table[i][1]
    if i == 0:
        return table[0][1]
    if i == len(table):
        if len(table) == 1:
            return table[-1][1] * n / table[-1][0]  # one point: proportional, the compute-bound limit
        (m0, s0), (m1, s1) = table[-2], table[-1]
        return max(s1, s1 + (s1 - s0) / (m1 - m0) * (n - m1))
    (m0, s0), (m1, s1) = table[i - 1], table[i]
    return s0 + (s1 - s0) * (n - m0) / (m1 - m0)


@dataclasses.dataclass(frozen=True)
class BucketCosts:
    """Seconds of a whole-model step's non-attention work per measured bucket (prefill: padded prompt tokens;
    decode: padded rows). See the module doc."""

    prefill: Table
    decode: Table
    C2: float  # attention, the Appendix form's units (s per element of L·3(h/tp)·Σl²/b) ...
    C5: float  # ... and (s per element of L·3(h/tp)·Σctx), fitted with the tables

    def prefill_s(self, tokens: float) -> float:
        return _lookup(self.prefill, tokens)

    def decode_s(self, rows: float) -> float:
        return _lookup(self.decode, rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": [[n, s] for n, s in self.prefill],
            "decode": [[n, s] for n, s in self.decode],
            "C2": self.C2,
            "C5": self.C5,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> BucketCosts:
        if not isinstance(raw, Mapping) or set(raw) != {"prefill", "decode", "C2", "C5"}:
            raise ValueError(
                "bucket_costs is {'prefill': [[tokens, s], ...], 'decode': [[rows, s], ...], 'C2': x, 'C5': y}"
            )
        c2, c5 = float(raw["C2"]), float(raw["C5"])
        if not (math.isfinite(c2) and math.isfinite(c5) and c2 >= 0 and c5 >= 0):
            raise ValueError(f"bucket_costs: C2 and C5 must be finite and >= 0, got {c2}, {c5}")
        return cls(_table(raw["prefill"], "bucket_costs.prefill"), _table(raw["decode"], "bucket_costs.decode"), c2, c5)


@dataclasses.dataclass(frozen=True)
class BucketModel:
    """A `StageLatency`: bucket costs for the GEMM side of a step, the Appendix form's C2/C5 lines for attention.

    `prefill_attention_s` and `decode_attention_s` are whole-model seconds per unit of Σl² and of Σctx (the
    Appendix form's `L·C2·3(h/tp)/b` and `L·C5·3(h/tp)`); `send` is the stage-to-stage activation send.
    """

    costs: BucketCosts
    prefill_attention_s: float
    decode_attention_s: float
    send: Callable[[int], float]
    stages: int = 1

    @property
    def pp(self) -> int:
        return self.stages

    def prefill_stage_s(self, num_tokens: float, sum_sq: float, batch: int) -> float:
        if batch == 0:
            return 0.0
        return (self.costs.prefill_s(num_tokens) + self.prefill_attention_s * sum_sq) / self.stages

    def decode_stage_s(self, batch: int, ctx_sum: float) -> float:
        return self.decode_stage_fn(batch)(ctx_sum)

    def decode_stage_fn(self, batch: int) -> Callable[[float], float]:
        """`decode_stage_s(batch, ·)` with the bucket's cost looked up once."""
        if batch == 0:
            return lambda ctx_sum: 0.0
        fixed, attn, pp = self.costs.decode_s(batch), self.decode_attention_s, self.stages
        return lambda ctx_sum: (fixed + attn * ctx_sum) / pp

    def chunk_stage_s(
        self, num_tokens: float, sum_sq: float, batch: int, decode_batch: int, decode_ctx_sum: float
    ) -> float:
        # The engine runs a mixed step as two sub-batches (see `PaddedModel.chunk_stage_s`): the prompt chunks
        # and the decodes riding along, each in its own bucket.
        return self.prefill_stage_s(num_tokens, sum_sq, batch) + self.decode_stage_s(decode_batch, decode_ctx_sum)

    def send_s(self, num_tokens: int) -> float:
        return self.send(num_tokens)
