"""The engine's shape padding as a latency term: what `ModelEngine` really computes for a batch.

`jaxserve/runtime/engines/model.py` pads every step to a bucket so XLA compiles a handful of programs: prefill
rows to the next power of two and prompt tokens to the next power of two ≥ 16; decode rows to the
next power of two ≥ 2 and each row's block table to the next power of two of the blocks it has
filled. The Appendix-A formula charges actual tokens and context, so an engine step of 5 decode rows
costs what 8 rows cost while the formula says 5. `EnginePadding` maps a batch's actual statistics to
the padded ones (rules mirrored here, without importing JAX; `tests/test_profile_fit.py` checks them
against `ModelEngine.step_shape` and `models.paged_attention`); `PaddedModel` wraps an instance's
latency model with it, so the simulator charges what the engine computes.

Which table columns a decode step's attention reads depends on the engine's attention: the one-gather
form (`xla_gather`, an accelerator's default) reads the whole padded table, the chunked loop (`xla`,
the CPU default) reads chunks of `attention_chunk_bytes` over the batch (`kv_column_bytes` per row and
table column; over a head-major pool rounded down to a power of two of columns and at most
`attention_chunk_max_columns`) up to the chunk holding the last filled position, so a table's empty
columns cost nothing; the CPU kernel (`cpu_kernel`, the CPU default where it builds) reads each row's filled
positions and nothing else (`attention_exact`). With `attention_chunk_bytes = 0` (and in profiles written before it existed) the whole
padded table is charged.

Coefficients used this way must be fitted in the same padded terms (`profile_fit`'s `padding=`,
which `jaxserve profile` uses by default); such a profile entry says so under `engine_padding`, and
`LatencyProvider.instance` then wraps its models. Prefill batches are described by Σl, Σl² and B
only, so each prompt is taken at the RMS length; a decode batch by B and Σctx, so each row at the
mean context.
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.core.limits import DEFAULT_LIMITS
from placement.stage_latency import StageLatency


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two ≥ max(n, minimum) (`jaxserve.runtime.engines.contract.bucket` without a cap)."""
    size = max(minimum, 1)
    while size < n:
        size *= 2
    return size


@dataclasses.dataclass(frozen=True)
class EnginePadding:
    min_prompt_tokens: int = 16
    block_size: int = DEFAULT_LIMITS.block_size
    min_table_blocks: int = 1
    min_decode_rows: int = 2
    attention_chunk_bytes: int = 0  # > 0: decode attention reads only the filled chunks of this many bytes
    kv_column_bytes: int = 0  # bytes of K one row's table column holds (block_size · heads · head_dim · itemsize)
    attention_chunk_pow2: bool = False  # a chunk's column count is rounded down to a power of two (head-major pool)
    attention_chunk_max_columns: int = 0  # > 0: and at most this many columns
    attention_chunk_min_columns: int = 1  # and at least this many (before the table's width caps it)
    attention_exact: bool = False  # decode attention reads each row's filled positions only (the CPU kernel)

    def prefill(self, num_tokens: float, sum_sq: float, batch: int) -> tuple[float, float, int]:
        """(Σl, Σl², B) of the padded prefill batch."""
        if batch == 0:
            return num_tokens, sum_sq, batch
        rows = bucket(batch)
        per = bucket(math.ceil(math.sqrt(sum_sq / batch) - 1e-9), self.min_prompt_tokens)
        return float(rows * per), float(rows * per * per), rows

    def decode(self, batch: int, ctx_sum: float) -> tuple[int, float]:
        """(rows, Σ context attended) of the padded decode step."""
        if batch == 0:
            return batch, ctx_sum
        rows = bucket(batch, self.min_decode_rows)
        if self.attention_exact:  # `models.paged_attention`'s impl="cpu_kernel": padding rows attend nothing
            return rows, ctx_sum
        blocks = math.ceil((ctx_sum / batch + 1) / self.block_size)  # the new token's slot included
        width = bucket(blocks, self.min_table_blocks)
        if self.attention_chunk_bytes > 0 and self.kv_column_bytes > 0:
            # `models.paged_attention._xla_chunked`: chunks of `chunk` columns (its `chunk_columns` rule) up to
            # the last position before the new token (which joins the softmax apart from the pages)
            fits = self.attention_chunk_bytes // (rows * self.kv_column_bytes)
            chunk = 1 << max(0, fits.bit_length() - 1) if self.attention_chunk_pow2 else max(1, fits)
            chunk = max(chunk, self.attention_chunk_min_columns)
            if self.attention_chunk_max_columns > 0:
                chunk = min(chunk, self.attention_chunk_max_columns)
            chunk = min(chunk, width)
            width = math.ceil(ctx_sum / batch / (chunk * self.block_size)) * chunk
        return rows, float(rows * width * self.block_size)


@dataclasses.dataclass(frozen=True)
class PaddedModel:
    """A `StageLatency` that charges the padded shapes."""

    base: StageLatency
    padding: EnginePadding = EnginePadding()

    @property
    def pp(self) -> int:
        return self.base.pp

    def prefill_stage_s(self, num_tokens: float, sum_sq: float, batch: int) -> float:
        return self.base.prefill_stage_s(*self.padding.prefill(num_tokens, sum_sq, batch))

    def decode_stage_s(self, batch: int, ctx_sum: float) -> float:
        return self.base.decode_stage_s(*self.padding.decode(batch, ctx_sum))

    def chunk_stage_s(
        self, num_tokens: float, sum_sq: float, batch: int, decode_batch: int, decode_ctx_sum: float
    ) -> float:
        # The engine runs a mixed step as two sub-batches (`ModelEngine._step`): the prompt chunks, padded as
        # prompt rows, and the decodes riding along, padded as a decode step of their own (rows to a power
        # of two >= 2, each row's table to its bucket), not to the chunks' length.
        t, t2, b = self.padding.prefill(num_tokens, sum_sq, batch)
        rows, ctx = self.padding.decode(decode_batch, decode_ctx_sum)
        return self.base.chunk_stage_s(t, t2, b, rows, ctx)

    def send_s(self, num_tokens: int) -> float:
        return self.base.send_s(num_tokens)
