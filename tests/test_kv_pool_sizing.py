"""`jaxserve serve` without `--num-kv-blocks`: the KV pool is sized from the memory the loaded weights leave."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.runtime.engines.contract import Engine
from jaxserve.runtime.engines.model import ModelEngine, model_engine_factory
from jaxserve.runtime.pool_sizing import kv_blocks_from_memory
from models.config import get_config

CFG = get_config("opt-tiny")


def _counting_factory() -> tuple[list[Engine], object]:
    made: list[Engine] = []
    load = model_engine_factory("opt-tiny")

    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> Engine:
        engine = load(spec, devices)
        made.append(engine)
        return engine

    return made, factory


def test_pool_is_capped_at_what_a_full_batch_can_reserve() -> None:
    made, factory = _counting_factory()
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1").assign_devices()
    limits = ServingLimits(block_size=16, max_decode_batch=4)
    blocks, cached = kv_blocks_from_memory(plan, factory, limits=limits, memory_fraction=0.5)  # type: ignore[arg-type]
    # A tiny model's blocks are a few KiB: memory is not the limit, 4 sequences of every position are.
    assert blocks == 4 * -(-CFG.max_position_embeddings // 16)
    assert len(made) == 2  # every engine was loaded before sizing
    # Controller.from_plan gets the engines already built (not loaded twice); a later instance loads anew.
    from jaxserve.runtime.instances import place

    handed = [cached(spec, devs) for _, spec, devs in place(plan)]
    assert handed == made and len(made) == 2
    spec, devs = place(plan)[1][1:]
    assert cached(spec, devs) is not made[1] and len(made) == 3


def test_pool_follows_the_memory_fraction_when_memory_is_the_limit() -> None:
    made, factory = _counting_factory()
    plan = parse_deployment("colocated:tp1").assign_devices()
    limits = ServingLimits(block_size=16, max_decode_batch=10**9)
    blocks, _ = kv_blocks_from_memory(plan, factory, limits=limits, memory_fraction=0.5)  # type: ignore[arg-type]
    engine = made[0]
    assert isinstance(engine, ModelEngine)
    # The engine's own rule for that memory (MemAvailable moves a little between the two reads).
    expected = engine.kv_blocks_for_memory(16, 0.5)
    assert blocks is not None and abs(blocks - expected) / expected < 0.05
