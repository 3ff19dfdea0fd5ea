"""`ModelEngine.decode_steps`: N decode steps per dispatch give the tokens of N single steps."""

from __future__ import annotations

import jax
import pytest

from jaxserve.core.request import SamplingParams
from jaxserve.runtime.engines.contract import KVPages, PrefillItem, StepBatch, StepRow
from jaxserve.runtime.engines.model import ModelEngine
from models.sharding import ShardedOPT

BLOCK = 4
PROMPTS = [[2, 11, 12, 13, 14, 15], [2, 21, 22], [2, 31, 32, 33, 34, 35, 36, 37, 38]]


@pytest.fixture(scope="module")
def engine() -> ModelEngine:
    return ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[:1]))


def _start(engine: ModelEngine, sampling: list[SamplingParams]) -> tuple[KVPages, list[StepRow]]:
    pages = engine.init_pages(num_blocks=len(PROMPTS) * 8, block_size=BLOCK)
    items = [PrefillItem(f"r{i}", tuple(p), sampling[i], seed=100 + i) for i, p in enumerate(PROMPTS)]
    rows = []
    for i, seq in enumerate(engine.prefill(items).sequences):
        table = tuple(range(i * 8, (i + 1) * 8))
        pages = engine.insert(seq.kv, seq.num_tokens, pages, table)
        rows.append(StepRow(f"r{i}", (seq.first_token,), seq.num_tokens, table, sampling[i], 100 + i, 1))
    return pages, rows


def _single_steps(engine: ModelEngine, sampling: list[SamplingParams], n: int) -> list[list[int]]:
    pages, rows = _start(engine, sampling)
    out: list[list[int]] = [[] for _ in rows]
    live = list(range(len(rows)))
    for k in range(n):
        batch = [
            StepRow(r.request_id, (out[i][-1] if out[i] else r.token_ids[0],), r.start_position + k, r.block_table,
                    r.sampling, r.seed, r.sample_index + k)
            for i, r in enumerate(rows) if i in live
        ]  # fmt: skip
        if not batch:
            break
        tokens, pages = engine.decode_step(StepBatch(tuple(batch)), pages)
        for i, tok in zip([i for i in live], tokens, strict=True):
            out[i].append(tok)
        eos = engine.model_config.eos_token_id
        live = [
            i for i in live
            if out[i][-1] not in sampling[i].stop_token_ids
            and (sampling[i].ignore_eos or out[i][-1] != eos)
            and rows[i].sample_index + len(out[i]) < sampling[i].max_tokens
        ]  # fmt: skip
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_steps_equal_single_steps(engine: ModelEngine, temperature: float) -> None:
    sampling = [
        SamplingParams(max_tokens=20, temperature=temperature, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True),  # stops after 3 (index 1..3)
        SamplingParams(max_tokens=20, temperature=temperature, ignore_eos=True),
    ]
    expected = _single_steps(engine, sampling, 6)
    pages, rows = _start(engine, sampling)
    got, _ = engine.decode_steps(StepBatch(tuple(rows)), pages, num_steps=6)
    assert got == expected
    assert [len(g) for g in got] == [6, 3, 6]


def test_decode_steps_stop_on_a_stop_token(engine: ModelEngine) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = _single_steps(engine, [greedy] * 3, 6)
    stop = free[0][2]  # row 0's third token becomes its stop token
    sampling = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)), greedy, greedy]
    pages, rows = _start(engine, sampling)
    got, _ = engine.decode_steps(StepBatch(tuple(rows)), pages, num_steps=6)
    assert got[0] == free[0][: free[0].index(stop) + 1]
    assert got[1:] == free[1:]
