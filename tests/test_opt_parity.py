"""Our OPT against Hugging Face's PyTorch `OPTForCausalLM` with the same random weights.

Weights travel the real way: `save_pretrained` to a safetensors dir, then our checkpoint loader.
Both variants are covered: pre-LN (`opt-tiny`) and post-LN with project_in/out (`opt-tiny-postln`,
word_embed_proj_dim 32 != hidden 64).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.testing.hf import make_hf_checkpoint, make_hf_model  # noqa: E402
from models import (  # noqa: E402
    checkpoint,
    steps,
)
from models.attention import DecodeCache  # noqa: E402
from models.config import OPTConfig, get_config  # noqa: E402
from models.sharding import ShardedOPT  # noqa: E402

PROMPT_LENS = (5, 11, 8)
NUM_NEW = 32


@pytest.fixture(scope="module", params=["opt-tiny", "opt-tiny-postln"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[OPTConfig, Any, Any]:
    cfg = get_config(request.param)
    path: Path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), cfg, seed=3)
    hf = make_hf_model(cfg, seed=3)  # same seed -> same weights as the saved checkpoint
    params = checkpoint.load_hf_params(path, cfg)
    return cfg, hf, params


def _prompts(cfg: OPTConfig) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        np.concatenate([[cfg.bos_token_id], rng.integers(4, cfg.vocab_size, n - 1)]).astype(np.int32)
        for n in PROMPT_LENS
    ]


def _right_pad(prompts: list[np.ndarray], width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(prompts), width), pad, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)


def test_config_from_saved_hf_dir_matches(setup: tuple[OPTConfig, Any, Any], tmp_path: Path) -> None:
    cfg, _, _ = setup
    loaded = OPTConfig.from_hf_config(make_hf_checkpoint(tmp_path / "c", cfg) / "config.json", name=cfg.name)
    assert loaded == cfg


def test_full_logits_match_hf_with_padding(setup: tuple[OPTConfig, Any, Any]) -> None:
    cfg, hf, params = setup
    tokens, lengths = _right_pad(_prompts(cfg), max(PROMPT_LENS), cfg.pad_token_id)
    ours, _ = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), all_logits=True)
    mask = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.int64)
    with torch.inference_mode():
        ref = hf(input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask)).logits.numpy()
    ours = np.asarray(ours)
    for b, n in enumerate(lengths):
        assert np.abs(ours[b, :n] - ref[b, :n]).max() <= 1e-4, f"row {b}"
        assert np.abs(ref[b, :n]).max() > 1e-2  # the comparison is not between two near-zero tensors
    # last-position logits (the default) are the same rows
    last, _ = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
    np.testing.assert_allclose(np.asarray(last), ours[np.arange(3), lengths - 1], atol=1e-5)


def _hf_greedy(hf: Any, prompt: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out = hf.generate(
            torch.from_numpy(prompt[None]).long(),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            eos_token_id=None,  # random weights: don't stop early, always compare 32 tokens
            pad_token_id=1,
        )
    return out[0, len(prompt) :].numpy()


def test_greedy_tokens_match_hf_generate(setup: tuple[OPTConfig, Any, Any]) -> None:
    """32 greedy tokens for a batch of different-length prompts: contiguous decode and paged decode."""
    cfg, hf, params = setup
    prompts = _prompts(cfg)
    expected = np.stack([_hf_greedy(hf, p) for p in prompts])
    assert expected.shape == (3, NUM_NEW)

    width = max(PROMPT_LENS)
    tokens, lengths = _right_pad(prompts, width, cfg.pad_token_id)
    logits, kv = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
    cache = DecodeCache.from_kv(kv, width + NUM_NEW)  # the per-layer head-major decode layout
    ours = []
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    pos = jnp.asarray(lengths)
    for _ in range(NUM_NEW):
        ours.append(tok)
        logits, cache = steps.decode(params, cfg, tok, pos, cache)
        tok, pos = jnp.argmax(logits, -1).astype(jnp.int32), pos + 1
    np.testing.assert_array_equal(np.stack(ours, 1), expected)

    # the same through the sharded model's paged path (tp=2): prefill into pages, decode by pages
    model = ShardedOPT.from_params(cfg, params, tp=2, pp=1, devices=jax.devices()[:2])
    block_size, blocks_per_seq = 4, (width + NUM_NEW) // 4 + 1
    tables = np.random.default_rng(0).permutation(3 * blocks_per_seq).reshape(3, blocks_per_seq).astype(np.int32)
    caches = model.init_paged_caches(3 * blocks_per_seq, block_size)
    zeros = np.zeros(3, np.int32)
    logits, caches = model.extend_paged(tokens, zeros, lengths, caches, tables)
    tok, pos, paged = jnp.argmax(logits, -1).astype(jnp.int32), lengths.copy(), []
    for _ in range(NUM_NEW):
        paged.append(np.asarray(tok))
        logits, caches = model.extend_paged(np.asarray(tok)[:, None], pos, np.ones(3, np.int32), caches, tables)
        tok, pos = jnp.argmax(logits, -1).astype(jnp.int32), pos + 1
    np.testing.assert_array_equal(np.stack(paged, 1), expected)
