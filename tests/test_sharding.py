"""tp x pp layouts on 8 virtual CPU devices give the unsharded model's logits, with really sharded params and KV."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from models import opt, steps
from models.config import OPTConfig, get_config
from models.paged_attention import BlockLayout
from models.params import init_params
from models.sharding import ShardedOPT, shardings_for, stage_layer_ranges, validate_parallelism

B, T = 2, 7


@pytest.fixture(scope="module")
def setup() -> tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray, np.ndarray]:
    cfg = get_config("opt-tiny-postln")
    params = jax.device_get(init_params(cfg, jax.random.key(4)))
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    lengths = np.array([T, 5], np.int32)
    full, _ = steps.prefill(params, cfg, tokens[:, :T], lengths, all_logits=True)
    nxt, _ = steps.prefill(params, cfg, tokens, np.full(B, T + 1, np.int32), all_logits=True)
    return cfg, params, tokens, np.asarray(full), np.asarray(nxt)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_matches_unsharded(
    setup: tuple[OPTConfig, opt.Params, np.ndarray, np.ndarray, np.ndarray], tp: int, pp: int
) -> None:
    cfg, params, tokens, full, nxt = setup
    devices = jax.devices()[: tp * pp]
    model = ShardedOPT.from_params(cfg, params, tp, pp, devices)

    # params really are split: column-parallel on out, row-parallel on in, layers by stage
    h, f, per_stage = cfg.hidden_size, cfg.ffn_dim, cfg.num_layers // pp
    for s, sp in enumerate(model.stage_params):
        layers = sp["layers"]
        assert {d for d in layers["fc1"]["kernel"].devices()} == set(devices[s * tp : (s + 1) * tp])
        shard = {
            name: layers[name]["kernel"].addressable_shards[0].data.shape
            for name in ("q_proj", "out_proj", "fc1", "fc2")
        }
        assert shard == {
            "q_proj": (per_stage, h, h // tp),
            "out_proj": (per_stage, h // tp, h),
            "fc1": (per_stage, h, f // tp),
            "fc2": (per_stage, f // tp, h),
        }
        assert layers["fc1"]["bias"].addressable_shards[0].data.shape == (per_stage, f // tp)
        assert ("embed_positions" in sp) == (s == 0)
        assert "embed_tokens" in sp if s in (0, pp - 1) else "embed_tokens" not in sp

    # one-device stages serve q/k/v as one fused matmul; stage_params (checkpoints) gives them back apart, unchanged
    served = set(model.run_params[0]["layers"][0])
    assert ("qkv_proj" in served, "q_proj" in served) == ((True, False) if tp == 1 else (False, True))
    if tp == pp == 1:
        back = model.stage_params[0]["layers"]
        assert all(np.array_equal(back[k][x], params["layers"][k][x]) for k in back for x in back[k])

    lengths = np.array([T, 5], np.int32)
    logits, caches = model.prefill(tokens[:, :T], lengths, all_logits=True)
    assert len(caches) == pp
    for c in caches:
        assert c.k.shape == (per_stage, B, T, cfg.num_heads, cfg.head_dim)
        assert c.k.addressable_shards[0].data.shape == (per_stage, B, T, cfg.num_heads // tp, cfg.head_dim)
    got = np.asarray(logits)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(got[b, :n], full[b, :n], atol=1e-5)

    # paged, in both block layouts (blocks [bs, H, D] and head-major [H, bs, D], heads split either way):
    # prefill into pages then decode one token, compared with the uncached forward
    assert model.block_layout == "heads"  # the CPU's default attention (impl "xla_heads_flat") reads head-major blocks
    full_len = np.full(B, T, np.int32)
    cases: list[tuple[BlockLayout, tuple[int, ...]]] = [
        ("tokens", (per_stage, 8, 3, cfg.num_heads // tp, cfg.head_dim)),
        ("heads", (per_stage, 8, cfg.num_heads // tp, 3, cfg.head_dim)),
    ]
    for layout, shard_shape in cases:
        paged = model.init_paged_caches(num_blocks=8, block_size=3, block_layout=layout)
        assert paged[0].k.addressable_shards[0].data.shape == shard_shape
        tables = np.array([[5, 2, 4], [0, 7, 1]], np.int32)
        _, paged = model.extend_paged(tokens[:, :T], np.zeros(B, np.int32), full_len, paged, tables)
        logits, paged = model.extend_paged(tokens[:, T:], full_len, np.ones(B, np.int32), paged, tables)
        np.testing.assert_allclose(np.asarray(logits), nxt[:, T], atol=1e-5)
        assert paged[-1].block_layout == layout
        assert paged[-1].k.sharding == model.layout.stages[pp - 1].pool_sharding(layout)

    if (tp, pp) != (2, 2):
        return  # the contiguous path differs only in its attention kernel; one layout keeps the suite fast
    # contiguous decode over the prefill caches (one slot of room added per stage)
    last, _ = model.prefill(tokens[:, :T], lengths)
    np.testing.assert_allclose(np.asarray(last), full[np.arange(B), lengths - 1], atol=1e-5)
    caches = model.init_caches(B, T + 1)
    _, pre = model.prefill(tokens[:, :T], full_len)
    caches = [
        type(c)(k=c.k.at[:, :, :T].set(p.k), v=c.v.at[:, :, :T].set(p.v)) for c, p in zip(caches, pre, strict=True)
    ]
    logits, caches = model.decode(tokens[:, T], full_len, caches)
    np.testing.assert_allclose(np.asarray(logits), nxt[:, T], atol=1e-5)


def test_stage_ranges_and_layout() -> None:
    cfg = get_config("opt-125m")
    assert stage_layer_ranges(cfg, 3) == [(0, 4), (4, 8), (8, 12)]
    layout = shardings_for(cfg, tp=2, pp=2, devices=jax.devices()[:4])
    assert [list(s.mesh.devices.flat) for s in layout.stages] == [jax.devices()[:2], jax.devices()[2:4]]
    assert layout.stages[1].layers == (6, 12)


@pytest.mark.parametrize(
    ("tp", "pp", "ndev", "message"),
    [
        (3, 1, 3, "num_heads 4 is not divisible by tp=3"),
        (1, 3, 3, "num_layers 2 is not divisible by pp=3"),
        (0, 1, 1, "tp and pp must be >= 1"),
        (2, 1, 4, "tp*pp = 2 devices needed, got 4"),
    ],
)
def test_bad_parallelism_is_a_clear_error(tp: int, pp: int, ndev: int, message: str) -> None:
    cfg = get_config("opt-tiny")
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_parallelism(cfg, tp, pp, ndev)
    with pytest.raises(ValueError, match=re.escape(message)):
        shardings_for(cfg, tp, pp, jax.devices()[:ndev])


@pytest.mark.parametrize("name", ["opt-350m", "opt-tiny-postln", "llama-tiny", "qwen2-7b", "llama-3.1-8b"])
def test_every_parameter_carries_logical_axes_the_rules_name(name: str) -> None:
    """Each parameter of each family (and of a fused one-device stage) names one logical axis per dimension, every
    name has a row in the one rule table, and the specs it gives split what tensor parallelism splits."""
    from flax import nnx

    from models.config import get_model_config
    from models.layers import Stage
    from models.params import abstract, logical_axes
    from models.sharding import LOGICAL_AXIS_RULES, TP_AXIS, param_specs

    cfg = get_model_config(name)
    for fused in (False, True):
        _, state = abstract(cfg, Stage(num_layers=1, fused=fused))
        axes = logical_axes(state)
        assert len(axes) == len(list(nnx.to_flat_state(state)))
        for path, var in nnx.to_flat_state(state):
            assert len(axes[path]) == len(var.shape), path
            assert all(a in LOGICAL_AXIS_RULES for a in axes[path]), (path, axes[path])
    specs = param_specs(cfg, tp=2)["layers"]
    q, down = ("q_proj", "fc2") if name.startswith("opt") else ("q_proj", "down_proj")
    assert specs[q]["kernel"] == jax.sharding.PartitionSpec(None, None, TP_AXIS)  # [L, in, out]: columns split
    assert specs[down]["kernel"] == jax.sharding.PartitionSpec(None, TP_AXIS, None)  # rows split
