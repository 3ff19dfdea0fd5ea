"""Multi-step decoding in the runtime (`decode_steps_per_call`): the same tokens as one step per call.

Through the embedded controller on the tiny OPT: greedy and seeded outputs with N = 4 equal N = 1 on a
disaggregated and a colocated deployment, with requests that end mid-call (a stop token id met inside
a call, max_tokens not a multiple of N); a multi-step call streams several tokens per chunk; greedy
tokens still equal Hugging Face `generate`; the timed engine's multi-step call sleeps the rounds it ran.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.testing.hf import make_hf_checkpoint, make_hf_model
from models.config import get_config

CFG = get_config("opt-tiny")
PROMPTS = [(2, 100, 31, 7, 8), (2, 5, 6), (2, 300, 301, 302, 17, 9, 44, 11, 5, 6, 7, 480, 13), (2, 77, 78, 79)]
MAX_TOKENS = [9, 6, 11, 7]  # none a multiple of 4: every request's last call ends mid-call


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-multistep"), CFG, seed=3)


def _run(
    checkpoint: Path, spec: str, steps: int, sampling: list[SamplingParams]
) -> tuple[list[list[int]], list[str | None], list[int]]:
    """Each request's tokens, finish reason and largest streamed chunk, all requests submitted at once."""
    config = ControllerConfig(
        limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64), decode_steps_per_call=steps
    )
    c = Controller.from_plan(str(checkpoint), parse_deployment(spec), config=config)
    c.start()
    try:
        streams = [
            c.submit(GenerateRequest(f"r{i}", p, s)) for i, (p, s) in enumerate(zip(PROMPTS, sampling, strict=True))
        ]
        tokens, reasons, widest = [], [], []
        for stream in streams:
            ids: list[int] = []
            chunk_sizes = []
            for chunk in stream:
                ids.extend(chunk.token_ids)
                chunk_sizes.append(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    reasons.append(chunk.finish_reason)
            tokens.append(ids)
            widest.append(max(chunk_sizes))
    finally:
        c.shutdown()
    return tokens, reasons, widest


def _sampling(temperature: float, stops: list[tuple[int, ...]] | None = None) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=m,
            temperature=temperature,
            seed=40 + i,
            ignore_eos=True,
            stop_token_ids=stops[i] if stops else (),
        )
        for i, m in enumerate(MAX_TOKENS)
    ]


@pytest.mark.parametrize(
    ("temperature", "spec"),
    [
        # the default run keeps greedy on one deployment and sampling on the other; .ci/run runs all four (slow:
        # ~20-30 s each on 2 cores)
        (0.0, "disagg:prefill=tp1,decode=tp1"),
        (0.9, "colocated:tp1"),
        pytest.param(0.9, "disagg:prefill=tp1,decode=tp1", marks=pytest.mark.slow),
        pytest.param(0.0, "colocated:tp1", marks=pytest.mark.slow),
    ],
)
def test_four_steps_per_call_give_the_tokens_of_one(checkpoint: Path, spec: str, temperature: float) -> None:
    one, reasons_one, widest_one = _run(checkpoint, spec, 1, _sampling(temperature))
    assert [len(t) for t in one] == MAX_TOKENS and reasons_one == ["length"] * 4
    assert widest_one == [1, 1, 1, 1]
    four, reasons_four, widest_four = _run(checkpoint, spec, 4, _sampling(temperature))
    assert four == one and reasons_four == reasons_one
    assert max(widest_four) == 4  # a multi-step call streams its tokens together, as soon as it returns
    # A stop token id met mid-call: request i stops at its token 5 (decode calls give tokens 1-4, 5-8, ...),
    # or 2 for the short one; the tokens the call sampled after it are discarded.
    cut = [5, 2, 6, 3]
    stops = [(one[i][k],) for i, k in enumerate(cut)]
    expect = [t[: t.index(s[0]) + 1] for t, s in zip(one, stops, strict=True)]
    stopped_one, why_one, _ = _run(checkpoint, spec, 1, _sampling(temperature, stops))
    stopped_four, why_four, _ = _run(checkpoint, spec, 4, _sampling(temperature, stops))
    assert stopped_one == expect and why_one == ["stop"] * 4
    assert stopped_four == expect and why_four == ["stop"] * 4


def test_multi_step_greedy_matches_transformers(checkpoint: Path) -> None:
    import torch

    model = make_hf_model(CFG, seed=3)
    expected = []
    for p, m in zip(PROMPTS, MAX_TOKENS, strict=True):
        ids = model.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False, eos_token_id=None)
        expected.append(ids[0, len(p) :].tolist())
    got, _, _ = _run(checkpoint, "disagg:prefill=tp1,decode=tp1", 4, _sampling(0.0))
    assert got == expected


def test_eos_mid_call_is_exact(checkpoint: Path, tmp_path: Path) -> None:
    """EOS (not ignored) met inside a call ends the request on it, with N = 4 as with N = 1.

    The same random weights are saved with `eos_token_id` set to a token greedy decoding produces
    mid-call (token 6 of the longest request), so EOS is met without waiting for chance.
    """
    one, _, _ = _run(checkpoint, "disagg:prefill=tp1,decode=tp1", 1, _sampling(0.0))
    eos = one[2][6]
    eos_checkpoint = make_hf_checkpoint(tmp_path / "eos", dataclasses.replace(CFG, eos_token_id=eos), seed=3)
    sampling = [dataclasses.replace(s, ignore_eos=False) for s in _sampling(0.0)]
    expect = [t[: t.index(eos) + 1] if eos in t else t for t in one]
    for steps in (1, 4):
        got, why, _ = _run(eos_checkpoint, "disagg:prefill=tp1,decode=tp1", steps, sampling)
        assert got == expect, steps
        assert why == ["stop" if eos in t else "length" for t in one], steps


def test_pipeline_engine_runs_multi_step_as_single_steps() -> None:
    """With pp > 1 `ModelEngine.decode_steps` falls back to single steps: the same tokens as the on-device loop."""
    import jax

    from jaxserve.runtime.engines.contract import PrefillItem, StepBatch, StepRow
    from jaxserve.runtime.engines.model import ModelEngine

    got = []
    for pp in (1, 2):
        engine = ModelEngine.load("opt-tiny", jax.devices()[:pp], pp=pp)
        pages = engine.init_pages(32, 4)
        sampling = [SamplingParams(max_tokens=m, temperature=t, seed=9) for m, t in ((7, 0.0), (4, 0.9))]
        items = [PrefillItem(f"r{i}", PROMPTS[i], s, 9) for i, s in enumerate(sampling)]
        rows = []
        for i, seq in enumerate(engine.prefill(items).sequences):
            table = tuple(range(i * 8, (i + 1) * 8))
            pages = engine.insert(seq.dense_kv, seq.num_tokens, pages, table)
            rows.append(StepRow(f"r{i}", (seq.first_token,), seq.num_tokens, table, sampling[i], 9, 1))
        lists, pages = engine.decode_steps(StepBatch(tuple(rows)), pages, 8)
        got.append(lists)
    assert [len(x) for x in got[0]] == [6, 3]  # max_tokens - 1 (the first came from the prefill)
    assert got[1] == got[0]
