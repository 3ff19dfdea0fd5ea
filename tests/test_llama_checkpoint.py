"""Llama-style checkpoints: HF safetensors (single, sharded index, fp32/bf16/fp16) into params and straight
into a tp x pp layout; one clear error for a missing tensor, a shape the config disagrees with, a
truncated file, and an architecture or option we do not run; tensor-parallel rules for K/V heads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llama_hf import hf_config, make_hf_llama, save_hf_llama  # noqa: E402

from models import (  # noqa: E402
    checkpoint,
    steps,
)
from models.attention import init_paged_cache  # noqa: E402
from models.checkpoint import CheckpointError  # noqa: E402
from models.config import LlamaConfig, UnsupportedModelError, config_from_hf  # noqa: E402
from models.sharding import ShardedLlama, ShardedOPT, kv_heads_split, validate_parallelism  # noqa: E402


@pytest.fixture(scope="module")
def hf_gqa() -> Any:
    return make_hf_llama("llama-gqa-llama3", seed=5)


@pytest.fixture(scope="module")
def single(hf_gqa: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_llama(hf_gqa, tmp_path_factory.mktemp("single"))


def _leaves(tree: dict) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_sharded_index_loads_the_same_weights(hf_gqa: Any, single: Path, tmp_path: Path) -> None:
    sharded = save_hf_llama(hf_gqa, tmp_path / "sharded", max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    ref, got = _leaves(checkpoint.load_hf_params(single)), _leaves(checkpoint.load_hf_params(sharded))
    assert ref.keys() == got.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    # the HF tensor really is our kernel transposed (not merely consistent between two loads of ours)
    q = hf_gqa.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(got["['layers']['q_proj']['kernel']"][1], q.T)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load(dtype: str, tmp_path: Path) -> None:
    hf = make_hf_llama("qwen2-mqa-tied", seed=2)
    path = save_hf_llama(hf, tmp_path / dtype, dtype=dtype)
    header_len = int.from_bytes((path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((path / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert {m["dtype"] for n, m in header.items() if n != "__metadata__"} == {"BF16" if dtype == "bfloat16" else "F16"}
    params = checkpoint.load_hf_params(path)
    want = hf.model.layers[0].self_attn.k_proj.bias.detach().to(getattr(torch, dtype)).float().numpy()
    np.testing.assert_array_equal(params["layers"]["k_proj"]["bias"][0], want)
    assert "lm_head" not in params  # tied: the embedding is the head


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    """Copy a single-file checkpoint with `edit(tensors)` applied to its tensors."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir(parents=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(single: Path, tmp_path: Path) -> None:
    bad = _rewrite(single, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        ShardedLlama.load(bad, tp=1, pp=1, devices=jax.devices()[:1])


def test_untied_head_missing_is_named(single: Path, tmp_path: Path) -> None:
    bad = _rewrite(single, tmp_path / "nohead", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor lm_head\.weight \(expected shape \(160, 64\)\)"):
        checkpoint.load_hf_params(bad)


def test_shape_disagreeing_with_config_is_named(single: Path, tmp_path: Path) -> None:
    def shrink(t: dict[str, np.ndarray]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]

    bad = _rewrite(single, tmp_path / "misshapen", shrink)
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.self_attn\.k_proj\.weight has shape \(16, 64\), expected \(32, 64\)"
    ):
        checkpoint.load_hf_params(bad)


def test_truncated_file_is_an_error_before_any_read(single: Path, tmp_path: Path) -> None:
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((single / "config.json").read_text())
    data = (single / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"truncated safetensors file: tensor .* ends at byte"):
        ShardedLlama.load(bad, tp=1, pp=1, devices=jax.devices()[:1])
    (bad / "model.safetensors").write_bytes(data[:20])  # cut inside the header
    with pytest.raises(CheckpointError, match=r"truncated safetensors file: header"):
        checkpoint.load_hf_params(bad)


def test_missing_shard_of_an_index_is_named(hf_gqa: Any, tmp_path: Path) -> None:
    sharded = save_hf_llama(hf_gqa, tmp_path / "sharded", max_shard_size="60KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"index names {victim.name}, which does not exist"):
        checkpoint.load_hf_params(sharded)


def _raw(kind: str) -> dict[str, Any]:
    raw = hf_config(kind).to_dict()
    raw["architectures"] = [type(hf_config(kind)).__name__.replace("Config", "ForCausalLM")]
    return raw


@pytest.mark.parametrize(
    ("kind", "edit", "message"),
    [
        ("llama-gqa-llama3", {"architectures": ["GemmaForCausalLM"]}, r"architecture 'GemmaForCausalLM' is not"),
        ("mistral-mha", {"sliding_window": 4096}, r"MistralForCausalLM config not supported: sliding_window=4096"),
        ("qwen2-mqa-tied", {"use_sliding_window": True, "sliding_window": 64}, r"use_sliding_window=True"),
        (
            "llama-gqa-llama3",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
            r"rope_scaling type 'yarn'",
        ),
        (
            "llama-gqa-llama3",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"rope_scaling type 'dynamic'",
        ),
        ("llama-gqa-llama3", {"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ("llama-gqa-llama3", {"mlp_bias": True}, r"mlp_bias=True"),
    ],
)
def test_unsupported_architecture_or_option_is_one_clear_error(
    kind: str, edit: dict[str, Any], message: str, tmp_path: Path
) -> None:
    raw = {**_raw(kind), **edit}
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf(raw)
    # ... from a directory too, before any weight is touched (there are none here)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match=message):
        ShardedLlama.load(tmp_path, tp=1, pp=1, devices=jax.devices()[:1])


def test_transformers4_rope_spelling_maps_like_transformers5() -> None:
    v5 = config_from_hf(_raw("llama-gqa-llama3"))
    v4 = {k: v for k, v in _raw("llama-gqa-llama3").items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})  # fmt: skip
    assert config_from_hf(v4) == v5
    assert isinstance(v5, LlamaConfig) and v5.rope_scaling is not None and v5.rope_scaling.rope_type == "llama3"
    assert config_from_hf(v5.to_hf_dict(), name=v5.name) == v5


def test_opt_model_class_refuses_a_llama_checkpoint(single: Path) -> None:
    with pytest.raises(
        UnsupportedModelError, match=r"ShardedOPT runs OPTConfig; .* is a LlamaConfig \(use ShardedLlama\)"
    ):
        ShardedOPT.load(single, tp=1, pp=1, devices=jax.devices()[:1])


# ---- tensor parallelism ------------------------------------------------------------------------


def _cfg(heads: int, kv_heads: int) -> LlamaConfig:
    return LlamaConfig(name="t", hidden_size=heads * 16, intermediate_size=96, num_layers=2, num_heads=heads,
                       num_kv_heads=kv_heads, vocab_size=160)  # fmt: skip


def test_kv_heads_split_replicate_or_refuse() -> None:
    assert kv_heads_split(_cfg(8, 4), 2) and kv_heads_split(_cfg(8, 4), 4)
    assert not kv_heads_split(_cfg(8, 2), 4) and not kv_heads_split(_cfg(8, 1), 8)
    with pytest.raises(ValueError, match=r"6 K/V heads neither split over tp=4 .* nor replicate across it"):
        validate_parallelism(_cfg(12, 6), 4, 1)
    with pytest.raises(ValueError, match=r"num_heads 12 is not divisible by tp=8"):
        validate_parallelism(_cfg(12, 4), 8, 1)


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "kv_split"),
    [
        ("llama-gqa-llama3", 2, 2, True),
        ("qwen2-mqa-tied", 2, 1, False),
        # the same two KV layouts (split, replicated) on more devices: heavier, in the slow run
        pytest.param("llama-gqa-llama3", 4, 1, False, marks=pytest.mark.slow),
        pytest.param("mistral-mha", 4, 2, True, marks=pytest.mark.slow),
    ],
)
def test_hf_dir_loads_into_a_tp_pp_layout_and_runs_like_the_unsharded_model(
    kind: str, tp: int, pp: int, kv_split: bool, tmp_path: Path
) -> None:
    hf = make_hf_llama(kind, seed=9)
    path = save_hf_llama(hf, tmp_path / kind)
    cfg = checkpoint.load_hf_model_config(path)
    assert isinstance(cfg, LlamaConfig)
    params = checkpoint.load_hf_params(path, cfg)
    model = ShardedLlama.load(path, tp=tp, pp=pp, devices=jax.devices()[: tp * pp])
    assert all(st.kv_split == kv_split for st in model.layout.stages)
    q = model.stage_params[0]["layers"]["q_proj"]["kernel"]
    assert q.addressable_shards[0].data.shape == (cfg.num_layers // pp, cfg.hidden_size, cfg.q_dim // tp)
    k = model.stage_params[0]["layers"]["k_proj"]["kernel"]
    assert k.addressable_shards[0].data.shape[-1] == cfg.kv_dim // (tp if kv_split else 1)

    rng = np.random.default_rng(1)
    tokens = rng.integers(3, cfg.vocab_size, (2, 10)).astype(np.int32)
    lengths = np.array([10, 6], np.int32)
    ref, _ = steps.prefill(params, cfg, tokens, lengths)
    got, _ = model.prefill(tokens, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)

    # paged prefill + decode steps through the stages, against the unsharded paged path
    tables = np.arange(2 * 5, dtype=np.int32).reshape(2, 5)[:, ::-1].copy()
    caches = model.init_paged_caches(11, 4)
    pool = init_paged_cache(cfg, 11, 4)
    zeros, ones = np.zeros(2, np.int32), np.ones(2, np.int32)
    got, caches = model.extend_paged(tokens, zeros, lengths, caches, tables)
    ref, pool = steps.extend_paged(params, cfg, tokens, zeros, lengths, pool, tables)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)
    pos = lengths.copy()
    for _ in range(4):
        tok = np.asarray(ref).argmax(-1).astype(np.int32)[:, None]
        got, caches = model.extend_paged(tok, pos, ones, caches, tables)
        ref, pool = steps.extend_paged(params, cfg, tok, pos, ones, pool, tables)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)
        pos = pos + 1


def test_orbax_round_trip_of_a_llama_model(single: Path, tmp_path: Path) -> None:
    saved = ShardedLlama.load(single, tp=2, pp=1, devices=jax.devices()[:2])
    path = checkpoint.save_checkpoint(tmp_path / "ckpt", saved)
    restored = ShardedLlama.load(path, tp=1, pp=2, devices=jax.devices()[2:4])
    assert restored.cfg == saved.cfg
    tokens, lengths = np.arange(3, 12, dtype=np.int32)[None], np.array([9], np.int32)
    np.testing.assert_allclose(
        np.asarray(restored.prefill(tokens, lengths)[0]), np.asarray(saved.prefill(tokens, lengths)[0]), atol=1e-5
    )


def test_presets_have_the_published_parameter_counts_and_gqa_kv_bytes() -> None:
    """Sizes the planner reads: parameter counts as the model cards state them; KV bytes follow kv_heads."""
    from models.config import get_llama_config

    published = {
        "llama-3.1-8b": 8_030_261_248,
        "llama-3.1-70b": 70_553_706_496,
        "qwen2-7b": 7_615_616_512,
        "mistral-7b-v0.3": 7_248_023_552,
    }
    for name, count in published.items():
        assert get_llama_config(name).num_params == count, name
    cfg = get_llama_config("meta-llama/llama-3.1-8b", dtype="bfloat16")
    assert cfg.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB: 8 K/V heads, not 32
    assert cfg.param_bytes == 2 * 8_030_261_248
