"""The latency contract of one instance: what the simulator and the step-cost formula ask of a latency model.

Every latency form implements it: the Appendix-A and folded forms (`placement/latency.py`), the bucketed
engine's measured costs (`placement/bucket_latency.py`) and the padding wrapper (`placement/padding.py`);
the simulator and `placement/step_time.py` read only this."""

from __future__ import annotations

from typing import Protocol


class StageLatency(Protocol):
    """What the simulator needs from one instance's latency model (seconds; batch statistics as scalars).

    Prefill batches are described by `num_tokens = Σ lᵢ`, `sum_sq = Σ lᵢ²` and the number of prompts;
    decode micro-batches by their size and `ctx_sum = Σ ctxᵢ`. A chunked step adds decodes to a prefill
    step: `sum_sq` is then Σ cᵢ·(cᵢ + 2pᵢ) for chunk cᵢ after pᵢ done tokens (what Σlᵢ² grows by).
    """

    @property
    def pp(self) -> int: ...

    def prefill_stage_s(self, num_tokens: float, sum_sq: float, batch: int) -> float: ...

    def decode_stage_s(self, batch: int, ctx_sum: float) -> float: ...

    def chunk_stage_s(
        self, num_tokens: float, sum_sq: float, batch: int, decode_batch: int, decode_ctx_sum: float
    ) -> float: ...

    def send_s(self, num_tokens: int) -> float: ...
