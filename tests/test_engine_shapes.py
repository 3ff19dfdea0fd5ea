"""Engine shapes follow the work (issue 11): what `ModelEngine.decode_step` hands the model.

The model call is recorded (not replaced): each test checks the shapes the real engine
dispatches and that the sampled tokens equal those of steps run one kind at a time.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from jaxserve.core.request import SamplingParams
from jaxserve.runtime.engines.contract import KVPages, PrefillItem, StepBatch, StepRow
from jaxserve.runtime.engines.model import ModelEngine, filled_blocks
from models.sharding import ShardedOPT

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
BLOCK = 4


@pytest.fixture(scope="module")
def engine() -> ModelEngine:
    return ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[:1]))


class Recorder:
    """Wraps `ShardedOPT.extend_paged` and keeps (tokens shape, table shape) of every call."""

    def __init__(self, engine: ModelEngine) -> None:
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self._model = engine.model
        self._orig = engine.model.extend_paged

    def __enter__(self) -> Recorder:
        def record(tokens: Any, starts: Any, lengths: Any, caches: Any, tables: Any, **kw: Any) -> Any:
            self.calls.append((tuple(np.shape(tokens)), tuple(np.shape(tables))))
            return self._orig(tokens, starts, lengths, caches, tables, **kw)

        self._model.extend_paged = record  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._model.extend_paged


def _prefilled(
    engine: ModelEngine, prompts: list[list[int]], reserve: int, spare: int = 0
) -> tuple[KVPages, list[tuple[int, ...]]]:
    """A pool holding each prompt's KV in its own `reserve`-block table (+ `spare` free blocks at the end)."""
    pages = engine.init_pages(num_blocks=len(prompts) * reserve + spare, block_size=BLOCK)
    items = [PrefillItem(f"r{i}", tuple(p), GREEDY, seed=0) for i, p in enumerate(prompts)]
    result = engine.prefill(items)
    tables = []
    for i, seq in enumerate(result.sequences):
        table = tuple(range(i * reserve, (i + 1) * reserve))
        pages = engine.insert(seq.kv, seq.num_tokens, pages, table)
        tables.append(table)
    return pages, tables


def test_filled_blocks_counts_positions_after_the_step() -> None:
    row = StepRow("a", (7,), start_position=8, block_table=tuple(range(32)), sampling=GREEDY, seed=0, sample_index=0)
    assert filled_blocks(row, 4) == 3  # positions 0..8 -> blocks 0, 1, 2
    chunk = StepRow("b", tuple(range(5)), 0, tuple(range(32)), GREEDY, 0, 0, is_prompt=True)
    assert filled_blocks(chunk, 4) == 2
    short = StepRow("c", (1,), 30, (0, 1), GREEDY, 0, 0)
    assert filled_blocks(short, 4) == 2  # never more than the table holds


def test_decode_table_width_follows_filled_blocks_not_reservation(engine: ModelEngine) -> None:
    prompts = [[2, 11, 12, 13, 14, 15], [2, 21, 22]]
    pages, tables = _prefilled(engine, prompts, reserve=32)  # room for 128 positions each
    rows = tuple(
        StepRow(f"r{i}", (5,), len(p), tables[i], GREEDY, seed=0, sample_index=1) for i, p in enumerate(prompts)
    )
    with Recorder(engine) as rec:
        wide, pages = engine.decode_step(StepBatch(rows), pages)
    # 7 positions fill 2 blocks of 4: the table is 2 wide, not the 32 reserved
    assert rec.calls == [((2, 1), (2, 2))]
    # the same step over tables cut to the filled blocks samples the same tokens
    pages2, tables2 = _prefilled(engine, prompts, reserve=32)
    cut = tuple(
        StepRow(f"r{i}", (5,), len(p), tables2[i][:2], GREEDY, seed=0, sample_index=1) for i, p in enumerate(prompts)
    )
    narrow, _ = engine.decode_step(StepBatch(cut), pages2)
    assert wide == narrow


def test_mixed_step_runs_decodes_and_chunk_as_separate_sub_batches(engine: ModelEngine) -> None:
    prompts = [[2, 31, 32, 33], [2, 41, 42, 43, 44], [2, 51]]
    pages, tables = _prefilled(engine, prompts, reserve=16)
    decodes = tuple(
        StepRow(f"r{i}", (9,), len(p), tables[i], GREEDY, seed=0, sample_index=1) for i, p in enumerate(prompts)
    )
    mixed_pages, _ = _prefilled(engine, prompts, reserve=16, spare=16)
    # a 40-token prompt chunk in the 16 spare blocks 48..63
    chunk = StepRow("c", tuple(range(3, 43)), 0, tuple(range(48, 64)), GREEDY, seed=0, sample_index=0, is_prompt=True)
    with Recorder(engine) as rec:
        mixed, _ = engine.decode_step(StepBatch((*decodes, chunk)), mixed_pages)
    # the chunk (40 tokens -> bucket 64, 10 blocks -> width 16) and the three decodes (bucket 4 rows,
    # one token, 2 blocks) are two calls; no decode row is padded to the chunk's length
    assert sorted(rec.calls) == sorted([((1, 64), (1, 16)), ((4, 1), (4, 2))])
    alone, _ = engine.decode_step(StepBatch(decodes), pages)
    assert mixed[:3] == alone
