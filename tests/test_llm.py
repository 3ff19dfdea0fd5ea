"""Offline API (`jaxserve.LLM`) and `jaxserve generate` (in a fresh process, as a user runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxserve
from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.limits import ServingLimits
from jaxserve.runtime.controller import ControllerConfig
from jaxserve.runtime.engines.fake import fake_engine_factory, reference_tokens
from models.config import get_config

CFG = get_config("opt-tiny")
ROOT = Path(__file__).resolve().parents[1]


def test_llm_generates_for_token_id_prompts_in_order() -> None:
    prompts = [[2, 100, 31], [2, 7], [2, 9, 9, 9, 9]]
    with jaxserve.LLM(
        model="opt-tiny", deployment="disagg:prefill=tp1,decode=tp2", engine_factory=fake_engine_factory(CFG)
    ) as llm:
        outs = llm.generate(prompts, jaxserve.SamplingParams(max_tokens=5, ignore_eos=True))
        single = llm.generate([2, 7], jaxserve.SamplingParams(max_tokens=3, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == [reference_tokens(p, 5, CFG.vocab_size) for p in prompts]
    assert [o.prompt_token_ids for o in outs] == [tuple(p) for p in prompts]
    assert all(o.finish_reason == "length" and o.timings is not None for o in outs)
    assert len(single) == 1 and list(single[0].token_ids) == reference_tokens([2, 7], 3, CFG.vocab_size)


def test_llm_limits_keyword_sets_the_serving_limits() -> None:
    limits = ServingLimits(block_size=4, num_kv_blocks=8)  # a 32-token pool per instance
    with jaxserve.LLM(
        model="opt-tiny", deployment="colocated:tp1", limits=limits, engine_factory=fake_engine_factory(CFG)
    ) as llm:
        assert llm.controller.config.limits == limits
        fits = llm.generate([2, 7], jaxserve.SamplingParams(max_tokens=30, ignore_eos=True))[0]
        assert list(fits.token_ids) == reference_tokens([2, 7], 30, CFG.vocab_size)
        with pytest.raises(InvalidRequestError, match="KV pool"):  # 2 + 31 tokens: one more than the pool
            llm.generate([2, 7], jaxserve.SamplingParams(max_tokens=31, ignore_eos=True))
    with pytest.raises(ValueError, match="not both"):
        jaxserve.LLM(model="opt-tiny", config=ControllerConfig(), limits=limits)


def test_llm_defaults_size_the_pool_from_memory_as_serve_does() -> None:
    """No limits given: the pool is what the loaded weights leave (the rule `serve` uses), the batch the offline one."""
    from jaxserve.llm import OFFLINE_LIMITS
    from jaxserve.runtime.pool_sizing import DEFAULT_KV_MEMORY_FRACTION

    with jaxserve.LLM(model="opt-tiny", deployment="colocated:tp1") as llm:
        limits = llm.controller.config.limits
        engine = llm.controller.colocated_instances[0].engine
        cap = OFFLINE_LIMITS.max_decode_batch * -(-CFG.max_position_embeddings // limits.block_size)
        assert limits.num_kv_blocks == engine.kv_blocks_for_memory(  # type: ignore[attr-defined]
            limits.block_size, DEFAULT_KV_MEMORY_FRACTION, max_blocks=cap
        )
        assert limits.max_decode_batch == OFFLINE_LIMITS.max_decode_batch > ServingLimits().max_decode_batch
        out = llm.generate([2, 7, 9], jaxserve.SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a fresh machine sets nothing
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "jaxserve", "generate", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=180,
    )


def test_cli_default_model_and_deployment_work_on_a_fresh_process() -> None:
    # The default is the code model shipped in the package: it has a tokenizer, so text works.
    proc = _cli("--prompt", "import ", "--max-tokens", "4", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == {"token_ids", "text"} and len(out["token_ids"]) == 4
    assert isinstance(out["text"], str) and out["text"]
    assert "RANDOM weights" not in proc.stderr


def test_cli_preset_means_random_weights_with_a_warning() -> None:
    proc = _cli("--model", "opt-tiny", "--prompt-ids", "2,100,31", "--max-tokens", "4", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4
    assert all(0 <= t < CFG.vocab_size for t in out["token_ids"])
    assert "RANDOM weights" in proc.stderr  # a preset without a checkpoint says so


@pytest.mark.slow
def test_cli_matches_transformers_on_a_checkpoint(tmp_path: Path) -> None:
    import torch

    from jaxserve.testing.hf import make_hf_checkpoint, make_hf_model

    make_hf_checkpoint(tmp_path, CFG, seed=1)
    ref = make_hf_model(CFG, seed=1).generate(
        torch.tensor([[2, 100, 31]]), max_new_tokens=5, min_new_tokens=5, do_sample=False, eos_token_id=None
    )[0, 3:]
    proc = _cli("--model", str(tmp_path), "--prompt-ids", "2,100,31", "--max-tokens", "5", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == ref.tolist()


def test_cli_reports_bad_input() -> None:
    proc = _cli("--prompt-ids", "2,x", "--max-tokens", "4")
    assert proc.returncode == 2 and "--prompt-ids" in proc.stderr
    proc = _cli("--prompt-ids", "2,3", "--deployment", "disagg:prefill=tp1")
    assert proc.returncode == 2 and "decode" in proc.stderr
