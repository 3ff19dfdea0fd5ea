"""Greedy tokens with prefix caching on equal those with it off, and Hugging Face `generate`.

A two-turn conversation on the tiny random-weight OPT (turn 2's prompt = turn 1's prompt + its
answer + new tokens), so turn 2 really hits: on the prefill instance (turn 1's prompt blocks), on
the decode instance (prompt + answer, pulled partially or prefilled locally) and on a colocated
instance. Expected tokens come from `transformers`, never from our own code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.testing.hf import make_hf_checkpoint, make_hf_model
from models.config import get_config

CFG = get_config("opt-tiny")
TURN1 = (2, 300, 301, 302, 17, 9, 44, 11, 5, 6, 7, 480, 13, 21, 22)  # 15 tokens
NEW = (2, 77, 78, 79, 80, 81)
MAX_TOKENS = 6


def _hf(model, prompt: tuple[int, ...]) -> list[int]:
    import torch

    ids = model.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
    )
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-hf"), CFG, seed=3)


@pytest.fixture(scope="module")
def expected() -> tuple[tuple[int, ...], list[int], list[int]]:
    model = make_hf_model(CFG, seed=3)
    out1 = _hf(model, TURN1)
    turn2 = TURN1 + tuple(out1) + NEW
    return turn2, out1, _hf(model, turn2)


@pytest.mark.parametrize(
    "spec,local",
    [
        ("colocated:tp1", 0),
        # slow (~15-30 s each): the default run keeps one colocated and both decode=tp2 cases; .ci/run runs all
        pytest.param("colocated:tp2,chunk=8", 0, marks=pytest.mark.slow),
        pytest.param("disagg:prefill=tp2,decode=tp1", 0, marks=pytest.mark.slow),
        ("disagg:prefill=tp1,decode=tp2", 0),
        ("disagg:prefill=tp1,decode=tp2", 16),  # turn 2 prefilled on the decode instance
        # pp2 prefill: turn 1 (no hit) through the pipelined dense prefill, written into the pool; turn 2 hits it
        pytest.param("disagg:prefill=tp1pp2,decode=tp1", 0, marks=pytest.mark.slow),
    ],
)
def test_greedy_tokens_identical_with_caching_on_and_off(spec: str, local: int, checkpoint: Path, expected) -> None:
    turn2, out1, out2 = expected
    for caching in (False, True):
        config = ControllerConfig(
            prefix_policy=PrefixPolicy(enabled=caching, local_prefill_tokens=local),
            limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64),
        )
        c = Controller.from_plan(str(checkpoint), parse_deployment(spec), config=config)
        c.start()
        try:
            sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            ids1, last1 = c.submit(GenerateRequest("t1", TURN1, sampling)).collect(timeout_s=300)
            ids2, last2 = c.submit(GenerateRequest("t2", turn2, sampling)).collect(timeout_s=300)
            assert (ids1, ids2) == (out1, out2), f"caching={caching}"
            assert last1.timings is not None and last2.timings is not None
            t2 = last2.timings
            if not caching:
                assert t2.cached_prompt_tokens == 0
                continue
            # 27-token turn 2: colocated and local prefills see turn 1's prompt + answer but its last
            # token (20 tokens = 5 blocks); a prefill instance only turn 1's prompt (15 -> 3 blocks).
            assert t2.cached_prompt_tokens == (12 if spec.startswith("disagg") and not local else 20)
            if spec.startswith("disagg"):
                assert t2.kv_transfer_tokens == (0 if local else 27 - 20)
        finally:
            c.shutdown(drain_timeout_s=0)
