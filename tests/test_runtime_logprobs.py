"""Logprobs of the real engine equal Hugging Face's `log_softmax` of its logits (greedy, random OPT).

Every token of a greedy request that asks (`SamplingParams.logprobs = k`) carries the log-softmax of
the model's raw logits at its position — its own entry and the k most likely tokens — through
prefill, the KV hand-off, single- and multi-step decoding (`decode_steps_per_call` 1 and 4) and
colocated chunked prefill. A request that does not ask gets none, in the same batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import MAX_LOGPROBS, GenerateRequest, SamplingParams, TokenChunk, TokenLogprobs
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.fake import fake_engine_factory
from jaxserve.testing.hf import hf_logprobs, make_hf_checkpoint, make_hf_model
from models.config import get_config

CFG = get_config("opt-tiny")
PROMPTS = [(2, 100, 31, 7, 8), (2, 300, 301, 302, 17, 9, 44, 11, 5, 6, 7, 480, 13)]
MAX_TOKENS = 6
TOP = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-hf"), CFG, seed=3)


@pytest.fixture(scope="module")
def hf_model():  # type: ignore[no-untyped-def]
    return make_hf_model(CFG, seed=3)


def check_against_hf(
    model: object, prompt: tuple[int, ...], output: list[int], logprobs: list[TokenLogprobs], k: int
) -> None:
    expected = hf_logprobs(model, prompt, output)
    assert len(logprobs) == len(output)
    for pos, (tok, lp) in enumerate(zip(output, logprobs, strict=True)):
        row = expected[pos]
        assert lp.logprob == pytest.approx(row[tok], abs=2e-4)
        assert int(np.argmax(row)) == tok  # greedy: the token is the most likely one ...
        assert lp.logprob == pytest.approx(row.max(), abs=2e-4)  # ... so its logprob is the top one
        assert len(lp.top) == k
        want_ids = np.argsort(-row, kind="stable")[:k]
        assert [t for t, _ in lp.top] == want_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(row[want_ids].tolist(), abs=2e-4)


def run(c: Controller, requests: list[GenerateRequest]) -> list[list[TokenChunk]]:
    streams = [c.submit(r) for r in requests]
    out = []
    for s in streams:
        chunks = []
        while (chunk := s.next_chunk(timeout_s=120)) is not None:
            chunks.append(chunk)
        out.append(chunks)
    return out


@pytest.mark.parametrize(
    ("spec", "steps"),
    [
        ("colocated:tp1", 1),
        ("colocated:tp1", 4),
        ("disagg:prefill=tp1,decode=tp1", 1),
        ("disagg:prefill=tp1,decode=tp1", 4),
        ("colocated:tp1,chunk=8", 1),
    ],
)
def test_logprobs_match_transformers(spec: str, steps: int, checkpoint: Path, hf_model: object) -> None:
    config = ControllerConfig(
        limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64), decode_steps_per_call=steps
    )
    c = Controller.from_plan(str(checkpoint), parse_deployment(spec), config=config)
    c.start()
    try:
        asks = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=k) for k in (TOP, 0)]
        plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        requests = [GenerateRequest(f"r{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, asks, strict=True))]
        requests.append(GenerateRequest("plain", PROMPTS[0], plain))
        results = run(c, requests)
    finally:
        c.shutdown(drain_timeout_s=0)
    for request, chunks in zip(requests[:2], results[:2], strict=True):
        output = [t for ch in chunks for t in ch.token_ids]
        assert len(output) == MAX_TOKENS
        for ch in chunks:  # every chunk carries one entry per token it carries
            assert ch.logprobs is not None and len(ch.logprobs) == len(ch.token_ids)
        # a multi-step call streams a row's tokens as one chunk: they did come from the loop program
        assert (max(len(ch.token_ids) for ch in chunks) > 1) == (steps > 1)
        logprobs = [lp for ch in chunks for lp in ch.logprobs or ()]
        check_against_hf(hf_model, request.prompt_token_ids, output, logprobs, request.sampling.logprobs or 0)
    assert all(ch.logprobs is None for ch in results[2])  # the request that did not ask gets none
    assert [t for ch in results[2] for t in ch.token_ids] == [t for ch in results[0] for t in ch.token_ids]


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0])
def test_logprobs_out_of_range_are_refused(bad: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logprobs=bad).check_ranges(max_tokens_limit=16)  # type: ignore[arg-type]
    assert e.value.field == "logprobs"


def test_fake_engine_refuses_logprobs() -> None:
    """The fake engine's tokens come from arithmetic, not a distribution: a request for logprobs is refused."""
    plan = parse_deployment("colocated:tp1")
    c = Controller.from_plan("fake", plan, engine_factory=fake_engine_factory(CFG))
    with pytest.raises(InvalidRequestError) as e:
        c.check_fits(GenerateRequest("r", (2, 5), SamplingParams(max_tokens=2, logprobs=1)))
    assert e.value.field == "logprobs"
    c.check_fits(GenerateRequest("r", (2, 5), SamplingParams(max_tokens=2)))
