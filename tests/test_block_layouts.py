"""The serving pool in both block layouts ("tokens" `[bs, H, D]` blocks, "heads" `[H, bs, D]`).

`kv_pool` places and reads positions by hand-checkable indices in either layout; the dense KV it
takes and gives is the same in both, so instances whose pools differ still exchange KV; and the
real engine, served through the controller (colocated, disaggregated tp1 / tp2, mixed layouts,
prefix caching), gives Hugging Face `generate`'s greedy tokens in each.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import StageKV, StagePages
from jaxserve.runtime.engines.model import ModelEngine, model_engine_factory
from jaxserve.runtime.instances import EngineFactory
from jaxserve.runtime.kv_pool import read_sequence, write_sequence
from jaxserve.testing.hf import make_hf_checkpoint, make_hf_model
from models.config import get_config
from models.paged_attention import BlockLayout, block_layout_for, default_impl
from models.sharding import ShardedOPT

CFG = get_config("opt-tiny")
PROMPTS = [(2, 100, 31, 7, 8), (2, 5, 6), (2, 300, 301, 302, 17, 9, 44, 11, 5, 6, 7, 480, 13)]
MAX_TOKENS = 8


def _pool(layout: BlockLayout, num_blocks: int = 6, bs: int = 4, h: int = 2, d: int = 3) -> StagePages:
    shape = (2, num_blocks, h, bs, d) if layout == "heads" else (2, num_blocks, bs, h, d)
    return StagePages(k=jnp.zeros(shape), v=jnp.zeros(shape), block_layout=layout)


def _dense(t: int, h: int = 2, d: int = 3, offset: float = 0.0) -> StageKV:
    """[L=2, T, H, D] with entry (l, p, h, d) = 1000 l + 100 p + 10 h + d (+ offset): every slot tells where it came from."""
    idx = np.indices((2, t, h, d))
    k = (1000 * idx[0] + 100 * idx[1] + 10 * idx[2] + idx[3] + offset).astype(np.float32)
    return StageKV(k=jnp.asarray(k), v=jnp.asarray(-k))


def test_heads_pool_places_positions_head_major() -> None:
    kv = _dense(8)
    pages = write_sequence((_pool("heads"),), (kv,), num_tokens=7, block_table=(4, 1))
    k = np.asarray(pages[0].k)  # [L, N, H, bs, D]
    assert pages[0].block_layout == "heads" and pages[0].block_size == 4
    # position 5 -> block 1 (the table's second), slot 1; layer 1, head 1, dim 2
    assert k[1, 1, 1, 1, 2] == 1000 + 500 + 10 + 2
    assert k[0, 4, 0, 3, 0] == 300  # position 3 -> block 4, slot 3
    assert np.all(k[:, 1, :, 3] == 0)  # position 7 is padding: not written
    assert np.all(k[:, [0, 2, 3, 5]] == 0)  # blocks outside the table untouched
    np.testing.assert_array_equal(np.asarray(pages[0].v), -k)


@pytest.mark.parametrize("layout", ["tokens", "heads"])
def test_read_sequence_inverts_write_sequence(layout: BlockLayout) -> None:
    kv = _dense(11)
    pages = write_sequence((_pool(layout),), (kv,), num_tokens=11, block_table=(3, 0, 5))
    back = read_sequence(pages, (3, 0, 5), num_tokens=11, padded=11)
    np.testing.assert_array_equal(np.asarray(back[0].k), np.asarray(kv.k))
    np.testing.assert_array_equal(np.asarray(back[0].v), np.asarray(kv.v))
    # a continuation written at start=11 lands after the first 11 positions in either layout
    more = write_sequence(pages, (_dense(1, offset=0.5),), num_tokens=1, block_table=(3, 0, 5), start=11)
    got = np.asarray(read_sequence(more, (3, 0, 5), num_tokens=12, padded=12)[0].k)
    np.testing.assert_array_equal(got[:, :11], np.asarray(kv.k))
    np.testing.assert_array_equal(got[:, 11], np.asarray(_dense(1, offset=0.5).k)[:, 0])


def test_dense_kv_moves_between_layouts() -> None:
    """A sequence read from a token-major pool and written into a head-major one reads back unchanged."""
    kv = _dense(9)
    tokens = write_sequence((_pool("tokens"),), (kv,), num_tokens=9, block_table=(2, 4, 1))
    dense = read_sequence(tokens, (2, 4, 1), num_tokens=9, padded=9)
    heads = write_sequence((_pool("heads"),), dense, num_tokens=9, block_table=(5, 0, 3))
    np.testing.assert_array_equal(np.asarray(read_sequence(heads, (5, 0, 3), 9, 9)[0].k), np.asarray(kv.k))


def test_default_layout_follows_the_attention_impl() -> None:
    assert block_layout_for("xla") == block_layout_for("xla_heads_flat") == "heads"
    assert {block_layout_for(i) for i in ("xla_tokens", "xla_gather", "pallas_gpu")} == {"tokens"}
    model = ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[:1])
    assert block_layout_for("cpu_kernel") == "heads"
    assert default_impl() in ("cpu_kernel", "xla_heads_flat") and model.block_layout == "heads"  # CPU
    engine = ModelEngine(model)
    assert engine.init_pages(4, 4)[0].block_layout == "heads"
    model.attention_impl = "xla_gather"
    assert engine.init_pages(4, 4)[0].k.shape == (CFG.num_layers, 4, 4, CFG.num_heads, CFG.head_dim)
    model.block_layout = "heads"  # an explicit choice wins over the impl's
    assert engine.init_pages(4, 4)[0].k.shape == (CFG.num_layers, 4, CFG.num_heads, 4, CFG.head_dim)
    with pytest.raises(ValueError, match="block layout"):
        model.block_layout = "rows"  # type: ignore[assignment]


# ---- served greedy tokens against transformers, per layout ----------------------------------


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


def _factory(source: str, layouts: dict[str, BlockLayout]) -> EngineFactory:
    """`model_engine_factory` with each role's pool layout set (roles: prefill, decode, colocated)."""
    base = model_engine_factory(source)

    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> ModelEngine:
        engine = base(spec, devices)
        engine.model.block_layout = layouts[spec.role]
        return engine

    return factory  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("spec", "layouts", "prefix_caching"),
    [
        ("colocated:tp1", {"colocated": "tokens"}, False),
        ("colocated:tp2", {"colocated": "heads"}, False),
        ("colocated:tp1,chunk=8", {"colocated": "heads"}, False),
        ("disagg:prefill=tp1,decode=tp2", {"prefill": "tokens", "decode": "tokens"}, False),
        ("disagg:prefill=tp2,decode=tp1", {"prefill": "heads", "decode": "heads"}, True),
        ("disagg:prefill=tp1,decode=tp2", {"prefill": "heads", "decode": "tokens"}, True),  # mixed: dense KV moves
    ],
)
def test_served_greedy_matches_transformers_in_each_layout(
    spec: str, layouts: dict[str, BlockLayout], prefix_caching: bool, checkpoint: Path, expected: list[list[int]]
) -> None:
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=prefix_caching),
        limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64),
    )
    c = Controller.from_plan(
        str(checkpoint), parse_deployment(spec), engine_factory=_factory(str(checkpoint), layouts), config=config
    )
    c.start()
    try:
        sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        streams = [c.submit(GenerateRequest(f"r{i}", p, sampling)) for i, p in enumerate(PROMPTS)]
        got = [s.collect(timeout_s=120)[0] for s in streams]
        if prefix_caching:  # the same prompts again: served from cached blocks on the prefill side
            streams = [c.submit(GenerateRequest(f"again{i}", p, sampling)) for i, p in enumerate(PROMPTS)]
            assert [s.collect(timeout_s=120)[0] for s in streams] == expected
    finally:
        c.shutdown(drain_timeout_s=0)
    assert got == expected
    roles = (
        [("prefill", i) for i in c.prefill_instances]
        + [("decode", i) for i in c.decode_instances]
        + [("colocated", i) for i in c.colocated_instances]
    )
    pools = [(role, getattr(i, "pages", None)) for role, i in roles]
    assert {role: p[0].block_layout for role, p in pools if p is not None} == {
        role: layouts[role] for role, p in pools if p is not None
    }
    assert any(role != "prefill" and p is not None for role, p in pools)  # the decode side's pool was checked


def test_llm_generate_runs_the_head_major_pool_by_default(checkpoint: Path, expected: list[list[int]]) -> None:
    """Offline `LLM.generate` serves from head-major blocks on CPU; `block_layout="tokens"` gives the same tokens."""
    from jaxserve.llm import LLM

    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    layouts: tuple[BlockLayout | None, ...] = (None, "tokens")
    for layout in layouts:
        config = ControllerConfig(limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64))
        with LLM(str(checkpoint), "colocated:tp1", config=config, block_layout=layout) as llm:
            got = [list(o.token_ids) for o in llm.generate(PROMPTS, sampling)]
            pages = llm.controller.colocated_instances[0].pages
        assert got == expected
        assert pages[0].block_layout == (layout or "heads")


def test_llm_runs_the_attention_impl_it_is_given(checkpoint: Path, expected: list[list[int]]) -> None:
    """`LLM(attention_impl=...)` compiles that paged attention on every instance (here the opt-in one-dot-per-head
    form) and serves transformers' greedy tokens with it; a name that is not an impl fails before any load."""
    from jaxserve.llm import LLM

    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    config = ControllerConfig(limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64))
    with LLM(str(checkpoint), "colocated:tp1", config=config, attention_impl="xla_heads_flat") as llm:
        got = [list(o.token_ids) for o in llm.generate(PROMPTS, sampling)]
        instance = llm.controller.colocated_instances[0]
        assert isinstance(instance.engine, ModelEngine)
        assert instance.engine.model.attention_impl == "xla_heads_flat"
        assert instance.pages[0].block_layout == "heads"  # the layout that impl reads
    assert got == expected
    with pytest.raises(ValueError, match="unknown paged attention implementation 'flash'"):
        LLM(str(checkpoint), "colocated:tp1", config=config, attention_impl="flash")  # type: ignore[arg-type]
