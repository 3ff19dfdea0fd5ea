"""Our Llama-style decoders against Hugging Face's PyTorch `LlamaForCausalLM` / `Qwen2ForCausalLM` /
`MistralForCausalLM` with the same random weights.

Weights travel the real way: `save_pretrained` to a safetensors dir, then our config mapping and
checkpoint loader. Four variants (tests/llama_hf.py): GQA with llama3 RoPE; a head_dim that is not
hidden / heads with linear RoPE and attention biases; Qwen2 MQA with a tied head and q/k/v biases;
plain MHA Mistral. Each is checked for a full padded forward, for greedy tokens against
`generate`, and for cached decoding (contiguous, head-major, paged, chunked prefill) against the
uncached forward.
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

from llama_hf import KINDS, make_hf_llama, save_hf_llama  # noqa: E402

from models import checkpoint, steps  # noqa: E402
from models.attention import DecodeCache, KVCache, init_cache, init_paged_cache, insert_into_pages  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.params import fuse_layer, unstack_layers  # noqa: E402

PROMPT_LENS = (5, 13, 9)
NUM_NEW = 24
PAD = 0


@pytest.fixture(scope="module", params=KINDS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaConfig, Any, Any]:
    hf = make_hf_llama(request.param, seed=3)
    path: Path = save_hf_llama(hf, tmp_path_factory.mktemp(request.param))
    cfg = checkpoint.load_hf_model_config(path)
    assert isinstance(cfg, LlamaConfig)
    return cfg, hf, checkpoint.load_hf_params(path, cfg)


def _prompts(cfg: LlamaConfig) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [np.concatenate([[1], rng.integers(3, cfg.vocab_size, n - 1)]).astype(np.int32) for n in PROMPT_LENS]


def _right_pad(prompts: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(prompts), width), PAD, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)


def _hf_logits(hf: Any, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    mask = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.int64)
    with torch.inference_mode():
        out = hf(input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask))
    return out.logits.numpy()


def test_config_maps_the_family(setup: tuple[LlamaConfig, Any, Any]) -> None:
    cfg, hf, _ = setup
    hc = hf.config
    assert (cfg.num_heads, cfg.kv_heads, cfg.head_dim) == (
        hc.num_attention_heads,
        hc.num_key_value_heads,
        getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads,
    )
    assert cfg.tie_word_embeddings == bool(hc.tie_word_embeddings)
    assert cfg.kv_bytes_per_token == 2 * cfg.num_layers * cfg.kv_heads * cfg.head_dim * 4
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())  # a tied head is one tensor in both


def test_full_logits_match_hf_with_padding(setup: tuple[LlamaConfig, Any, Any]) -> None:
    cfg, hf, params = setup
    tokens, lengths = _right_pad(_prompts(cfg), max(PROMPT_LENS))
    ours, _ = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), all_logits=True)
    ref = _hf_logits(hf, tokens, lengths)
    ours = np.asarray(ours)
    for b, n in enumerate(lengths):
        assert np.abs(ours[b, :n] - ref[b, :n]).max() <= 1e-4, f"row {b}"
        assert np.abs(ref[b, :n]).max() > 1e-1  # the comparison is not between two near-zero tensors
    last, _ = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
    np.testing.assert_allclose(np.asarray(last), ours[np.arange(3), lengths - 1], atol=1e-5)


def _hf_greedy(hf: Any, prompt: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out = hf.generate(
            torch.from_numpy(prompt[None]).long(),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=NUM_NEW,
            min_new_tokens=NUM_NEW,
            do_sample=False,
            eos_token_id=None,  # random weights: don't stop early
            pad_token_id=PAD,
        )
    return out[0, len(prompt) :].numpy()


def test_greedy_tokens_match_hf_generate_contiguous_and_paged(setup: tuple[LlamaConfig, Any, Any]) -> None:
    """Greedy tokens for different-length prompts: head-major contiguous decode, then paged decode."""
    cfg, hf, params = setup
    prompts = _prompts(cfg)
    expected = np.stack([_hf_greedy(hf, p) for p in prompts])
    assert expected.shape == (3, NUM_NEW)

    width = max(PROMPT_LENS)
    tokens, lengths = _right_pad(prompts, width)
    logits, kv = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
    assert kv.k.shape == (cfg.num_layers, 3, width, cfg.kv_heads, cfg.head_dim)  # K/V stored at kv_heads
    cache = DecodeCache.from_kv(kv, width + NUM_NEW)
    ours = []
    tok, pos = jnp.argmax(logits, -1).astype(jnp.int32), jnp.asarray(lengths)
    for _ in range(NUM_NEW):
        ours.append(tok)
        logits, cache = steps.decode(params, cfg, tok, pos, cache)
        tok, pos = jnp.argmax(logits, -1).astype(jnp.int32), pos + 1
    np.testing.assert_array_equal(np.stack(ours, 1), expected)

    # prefill's KV inserted into a block pool (scattered blocks), then paged decode steps
    block_size, per_seq = 4, (width + NUM_NEW) // 4 + 1
    tables = jnp.asarray(np.random.default_rng(0).permutation(3 * per_seq).reshape(3, per_seq).astype(np.int32))
    for layout in ("tokens", "heads"):
        pool = init_paged_cache(cfg, 3 * per_seq + 1, block_size, block_layout=layout)
        logits, kv = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
        pool = insert_into_pages(pool, kv, tables, jnp.asarray(lengths))
        tok, pos, paged = jnp.argmax(logits, -1).astype(jnp.int32), jnp.asarray(lengths), []
        for _ in range(NUM_NEW):
            paged.append(np.asarray(tok))
            logits, pool = steps.extend_paged(params, cfg, tok[:, None], pos, jnp.ones(3, jnp.int32), pool, tables)
            tok, pos = jnp.argmax(logits, -1).astype(jnp.int32), pos + 1
        np.testing.assert_array_equal(np.stack(paged, 1), expected, err_msg=layout)


def test_cached_steps_equal_the_uncached_forward(setup: tuple[LlamaConfig, Any, Any]) -> None:
    """Logits of step-by-step decoding (stacked `KVCache`) and of a chunked paged prefill equal one full
    forward over the whole sequence, ours and Hugging Face's."""
    cfg, hf, params = setup
    rng = np.random.default_rng(11)
    seq = rng.integers(3, cfg.vocab_size, (2, 20)).astype(np.int32)
    full_lengths = np.full(2, 20, np.int32)
    full, _ = steps.prefill(params, cfg, jnp.asarray(seq), jnp.asarray(full_lengths), all_logits=True)
    full = np.asarray(full)
    np.testing.assert_allclose(full, _hf_logits(hf, seq, full_lengths), atol=1e-4)

    # contiguous: prefill 8 tokens, then 12 single-token steps over a stacked KVCache
    first, kv = steps.prefill(params, cfg, jnp.asarray(seq[:, :8]), jnp.full(2, 8, jnp.int32), all_logits=True)
    cache = init_cache(cfg, 2, 20)
    cache = KVCache(k=cache.k.at[:, :, :8].set(kv.k), v=cache.v.at[:, :, :8].set(kv.v))
    outs = [np.asarray(first)]
    for p in range(8, 20):
        logits, cache = steps.decode(params, cfg, jnp.asarray(seq[:, p]), jnp.full(2, p, jnp.int32), cache)
        outs.append(np.asarray(logits)[:, None])
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-5)

    # paged: three chunks of 7 / 7 / 6 tokens appended into scattered blocks (chunked prefill)
    tables = jnp.asarray(np.array([[5, 0, 3, 7, 1], [2, 6, 4, 9, 8]], np.int32))
    pool = init_paged_cache(cfg, 10, 4)
    chunks = []
    for start, end in ((0, 7), (7, 14), (14, 20)):
        logits, pool = steps.extend_paged(
            params, cfg, jnp.asarray(seq[:, start:end]), jnp.full(2, start, jnp.int32),
            jnp.full(2, end - start, jnp.int32), pool, tables, all_logits=True,
        )  # fmt: skip
        chunks.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(chunks, 1), full, atol=2e-5)


def test_stacked_per_layer_and_fused_layouts_agree(setup: tuple[LlamaConfig, Any, Any]) -> None:
    """The model built from stacked layer leaves, from one dict per layer, and from fused q/k/v and gate/up
    projections (a one-device stage's serving layout) gives the same logits and K/V."""
    cfg, _, params = setup
    tokens, lengths = _right_pad(_prompts(cfg), max(PROMPT_LENS))
    per_layer = unstack_layers(params["layers"])
    a, kv_a = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
    for layers in (per_layer, [fuse_layer(lp) for lp in per_layer]):
        b, kv_b = steps.prefill({**params, "layers": layers}, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        np.testing.assert_allclose(np.asarray(kv_a.k), np.asarray(kv_b.k), atol=1e-5)


def test_bf16_weights_run_and_stay_close(setup: tuple[LlamaConfig, Any, Any]) -> None:
    """bfloat16 params and cache: same greedy first token as float32 on most rows, logits within bf16 noise."""
    cfg, _, params = setup
    tokens, lengths = _right_pad(_prompts(cfg), max(PROMPT_LENS))
    half = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    ref, _ = steps.prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths))
    got, kv = steps.prefill(half, cfg.with_dtype("bfloat16"), jnp.asarray(tokens), jnp.asarray(lengths))
    assert kv.k.dtype == jnp.bfloat16 and got.dtype == jnp.float32
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() < 0.1 * np.abs(np.asarray(ref)).max()
