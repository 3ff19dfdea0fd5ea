"""Sizing a deployment's KV pool from the memory its loaded weights leave (vLLM's `gpu_memory_utilization`).

Used by `jaxserve serve` and by the offline `LLM` alike, so both start with the same pool for the same
model and machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import DeploymentPlan, InstanceSpec
from jaxserve.runtime.engines.contract import Engine
from jaxserve.runtime.instances import EngineFactory, place

DEFAULT_KV_MEMORY_FRACTION = 0.9


def kv_blocks_from_memory(
    plan: DeploymentPlan, factory: EngineFactory, limits: ServingLimits, memory_fraction: float
) -> tuple[int | None, EngineFactory]:
    """Load the plan's engines now and size the KV pool from the memory their weights leave.

    Every instance's engine is built first (so the weights are in memory), then each decode /
    colocated engine that can say (`kv_blocks_for_memory`: `ModelEngine`) gives the blocks
    `memory_fraction` of its devices' memory leaves, capped at what a full decode batch of
    sequences of the model's length can reserve; the smallest instance sets the number
    (`ServingLimits.num_kv_blocks` is one number for all; `limits` gives `block_size` and `max_decode_batch`). Returns it (None: no engine could
    say) and a factory that hands the built engines to `Controller.from_plan` (and loads any
    later instance, such as a replan's, itself).
    """
    block_size, max_decode_batch = limits.block_size, limits.max_decode_batch
    built: dict[tuple[int, ...], Engine] = {}
    blocks: list[int] = []
    for _, spec, devices in place(plan):
        engine = factory(spec, devices)
        built[tuple(d.id for d in devices)] = engine
    for _, spec, devices in place(plan):
        engine = built[tuple(d.id for d in devices)]
        if spec.role == "prefill" or not engine.capabilities.memory_sized_pool:
            continue
        cap = max_decode_batch * -(-engine.model_config.max_position_embeddings // block_size)
        blocks.append(engine.kv_blocks_for_memory(block_size, memory_fraction, max_blocks=cap))

    def cached(spec: InstanceSpec, devices: Sequence[jax.Device]) -> Engine:
        engine = built.pop(tuple(d.id for d in devices), None)
        return engine if engine is not None else factory(spec, devices)

    return (min(blocks) if blocks else None), cached
