"""Greedy outputs of the real engine equal Hugging Face `generate` on a random-weight checkpoint.

Every deployment shape the runtime supports gets the same prompts: colocated (prefill priority
and chunked prefill), disaggregated with different tp/pp on each side, and two prefill instances.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.testing.hf import make_hf_checkpoint, make_hf_model
from models.config import get_config

CFG = get_config("opt-tiny")
# Short prompts (one 16-token bucket, one prefill batch) keep compilation to a few programs per instance.
PROMPTS = [(2, 100, 31, 7, 8), (2, 5, 6), (2, 300, 301, 302, 17, 9, 44, 11, 5, 6, 7, 480, 13)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-hf"), CFG, seed=3)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    import torch

    model = make_hf_model(CFG, seed=3)
    out = []
    for p in PROMPTS:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
        )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize(
    "spec",
    [
        "colocated:tp1",
        "disagg:prefill=tp2,decode=tp1",
        "disagg:prefill=tp1pp2,decode=tp2",
        "disagg:prefill=2xtp1,decode=tp1",
        "colocated:tp1,chunk=8",
        pytest.param("disagg:prefill=tp2,decode=tp1pp2", marks=pytest.mark.slow),  # micro-batched paged decode
    ],
)
def test_greedy_matches_transformers(spec: str, checkpoint: Path, expected: list[list[int]]) -> None:
    config = ControllerConfig(limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64))
    c = Controller.from_plan(str(checkpoint), parse_deployment(spec), config=config)
    c.start()
    try:
        sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        streams = [c.submit(GenerateRequest(f"r{i}", p, sampling)) for i, p in enumerate(PROMPTS)]
        got = [s.collect(timeout_s=120)[0] for s in streams]
    finally:
        c.shutdown(drain_timeout_s=0)
    assert got == expected
    if spec.startswith("disagg"):
        prefill_devices = {d for p in c.prefill_instances for d in p.engine.devices}
        decode_devices = {d for p in c.decode_instances for d in p.engine.devices}
        assert prefill_devices.isdisjoint(decode_devices)
        assert c.stats().num_transfers == len(PROMPTS)
    if spec == "disagg:prefill=2xtp1,decode=tp1":
        assert all(p.num_steps > 0 for p in c.prefill_instances)  # both prefill instances took work
