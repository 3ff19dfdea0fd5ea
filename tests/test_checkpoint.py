"""Checkpoint loading: sharded safetensors, pytorch_model.bin, errors that name the tensor, Orbax re-layout, tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from jaxserve.testing.hf import make_hf_checkpoint
from models import checkpoint
from models.checkpoint import CheckpointError
from models.config import OPTConfig, get_config
from models.sharding import ShardedOPT


@pytest.fixture(scope="module")
def cfg() -> OPTConfig:
    return get_config("opt-tiny")


@pytest.fixture(scope="module")
def single(cfg: OPTConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("single"), cfg, seed=11)


def _leaves(tree: dict) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_sharded_safetensors_and_torch_bin_load_the_same_weights(cfg: OPTConfig, single: Path, tmp_path: Path) -> None:
    sharded = make_hf_checkpoint(tmp_path / "sharded", cfg, seed=11, sharded=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    torch_dir = make_hf_checkpoint(tmp_path / "bin", cfg, seed=11, safetensors=False)
    assert (torch_dir / "pytorch_model.bin").exists()
    ref = _leaves(checkpoint.load_hf_params(single))
    assert ref["['layers']['fc1']['kernel']"].shape == (cfg.num_layers, cfg.hidden_size, cfg.ffn_dim)
    for other in (sharded, torch_dir):
        got = _leaves(checkpoint.load_hf_params(other))
        assert got.keys() == ref.keys()
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


@pytest.mark.parametrize("torch_dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_load(cfg: OPTConfig, tmp_path: Path, torch_dtype: str) -> None:
    import torch

    from jaxserve.testing.hf import make_hf_model

    model = make_hf_model(cfg, seed=11).to(getattr(torch, torch_dtype))
    model.save_pretrained(tmp_path)
    expected = model.model.decoder.layers[1].fc1.weight.detach().float().numpy().T
    got = checkpoint.load_hf_params(tmp_path)["layers"]["fc1"]["kernel"][1]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    sharded = ShardedOPT.load(tmp_path, tp=2, pp=1, devices=jax.devices()[:2], dtype=torch_dtype)
    assert str(sharded.dtype) == torch_dtype and sharded.cfg.dtype == torch_dtype


def test_hf_dir_loads_straight_into_a_sharded_layout(cfg: OPTConfig, single: Path) -> None:
    ref = checkpoint.load_hf_params(single)
    model = ShardedOPT.load(single, tp=2, pp=2, devices=jax.devices()[:4])
    k = model.stage_params[1]["layers"]["q_proj"]["kernel"]
    assert k.shape == (1, cfg.hidden_size, cfg.hidden_size)
    assert {s.data.shape for s in k.addressable_shards} == {(1, cfg.hidden_size, cfg.hidden_size // 2)}
    np.testing.assert_array_equal(np.asarray(k), ref["layers"]["q_proj"]["kernel"][1:])
    np.testing.assert_array_equal(np.asarray(model.stage_params[1]["embed_tokens"]), ref["embed_tokens"])


def _rewrite_safetensors(src: Path, dst: Path, edit: str) -> Path:
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    if edit == "missing":
        del tensors["model.decoder.layers.1.fc2.bias"]
    elif edit == "bare":
        tensors = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    else:
        w = tensors["model.decoder.layers.0.self_attn.k_proj.weight"]
        tensors["model.decoder.layers.0.self_attn.k_proj.weight"] = np.ascontiguousarray(w[:, :-1])
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_bare_decoder_prefix_loads(single: Path, tmp_path: Path) -> None:
    bare = _rewrite_safetensors(single, tmp_path / "bare", "bare")
    ref, got = _leaves(checkpoint.load_hf_params(single)), _leaves(checkpoint.load_hf_params(bare))
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_missing_tensor_is_named(single: Path, tmp_path: Path) -> None:
    bad = _rewrite_safetensors(single, tmp_path / "missing", "missing")
    with pytest.raises(CheckpointError, match=r"missing tensor model\.decoder\.layers\.1\.fc2\.bias"):
        ShardedOPT.load(bad, tp=1, pp=1, devices=jax.devices()[:1])


def test_misshapen_tensor_is_named_with_shapes(single: Path, tmp_path: Path) -> None:
    bad = _rewrite_safetensors(single, tmp_path / "misshapen", "misshapen")
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.self_attn\.k_proj\.weight has shape \(64, 63\), expected \(64, 64\)"
    ):
        checkpoint.load_hf_params(bad)


def test_orbax_round_trip_into_other_layouts(cfg: OPTConfig, single: Path, tmp_path: Path) -> None:
    saved = ShardedOPT.load(single, tp=2, pp=1, devices=jax.devices()[:2])
    path = checkpoint.save_checkpoint(tmp_path / "ckpt", saved)
    ref = checkpoint.load_hf_params(single)
    tokens = np.arange(3, 12, dtype=np.int32)[None]
    ref_logits, _ = saved.prefill(tokens, np.array([9], np.int32))
    for tp, pp in [(4, 1), (1, 2)]:
        restored = ShardedOPT.load(path, tp=tp, pp=pp, devices=jax.devices()[2 : 2 + tp * pp])
        assert restored.cfg == saved.cfg
        per_stage = cfg.num_layers // pp
        for s, sp in enumerate(restored.stage_params):
            kern = sp["layers"]["fc1"]["kernel"]
            assert kern.addressable_shards[0].data.shape == (per_stage, cfg.hidden_size, cfg.ffn_dim // tp)
            lo = s * per_stage
            for name, leaf in _leaves(sp["layers"]).items():
                full = _leaves(ref["layers"])[name]
                np.testing.assert_array_equal(leaf, full[lo : lo + per_stage], err_msg=name)
        np.testing.assert_array_equal(np.asarray(restored.stage_params[-1]["embed_tokens"]), ref["embed_tokens"])
        logits, _ = restored.prefill(tokens, np.array([9], np.int32))
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)


def test_preset_name_gives_random_weights_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="models.checkpoint"):
        model = ShardedOPT.load("opt-tiny", tp=2, pp=1, devices=jax.devices()[:2], dtype="bfloat16", seed=1)
    assert "RANDOM weights" in caplog.text
    assert str(model.dtype) == "bfloat16"
    logits, caches = model.prefill(np.array([[2, 5, 9]], np.int32), np.array([3], np.int32))
    assert logits.shape == (1, 512) and np.isfinite(np.asarray(logits)).all()
    assert str(caches[0].k.dtype) == "bfloat16"


def test_not_a_checkpoint_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither a Hugging Face OPT directory nor a jaxserve checkpoint"):
        ShardedOPT.load(tmp_path, tp=1, pp=1, devices=jax.devices()[:1])


def test_tokenizer_from_vocab_and_merges(tmp_path: Path) -> None:
    # a tiny GPT-2 style byte-level BPE: "Ġ" marks a leading space
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "h": 3, "i": 4, "Ġ": 5, "hi": 6, "Ġhi": 7}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh i\nĠ hi\n")
    tok = checkpoint.load_tokenizer(tmp_path)
    assert tok is not None
    enc = tok.encode("hi hi")
    assert enc.ids == [2, 6, 7]  # OPT prepends </s> as BOS
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hi hi"
    tok.save(str(tmp_path / "tokenizer.json"))
    again = checkpoint.load_tokenizer(tmp_path)
    assert again is not None and again.encode("hi hi").ids == [2, 6, 7]
    assert checkpoint.load_tokenizer(tmp_path / "nothing-here") is None
