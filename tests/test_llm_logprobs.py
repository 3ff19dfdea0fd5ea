"""`LLM.generate` with `SamplingParams(logprobs=k)`: each output carries every token's log-probability and
the k most likely tokens, equal to Hugging Face's `log_softmax` of its logits (random tiny OPT, greedy)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_runtime_logprobs import PROMPTS, check_against_hf

from jaxserve.core.limits import ServingLimits
from jaxserve.core.request import SamplingParams
from jaxserve.llm import LLM
from jaxserve.runtime.controller import ControllerConfig
from jaxserve.testing.hf import make_hf_checkpoint, make_hf_model
from models.config import get_config

CFG = get_config("opt-tiny")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-hf"), CFG, seed=5)


@pytest.mark.parametrize("spec", ["colocated:tp1", "disagg:prefill=tp1,decode=tp2"])
def test_generate_returns_logprobs_equal_to_transformers(spec: str, checkpoint: Path) -> None:
    config = ControllerConfig(limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64))
    with LLM(str(checkpoint), spec, config=config) as llm:
        asked = llm.generate(list(PROMPTS), SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))
        plain = llm.generate(list(PROMPTS), SamplingParams(max_tokens=6, temperature=0.0))
    model = make_hf_model(CFG, seed=5)
    for prompt, out, other in zip(PROMPTS, asked, plain, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
        check_against_hf(model, prompt, list(out.token_ids), list(out.logprobs), 3)
        assert other.logprobs is None and other.token_ids == out.token_ids
