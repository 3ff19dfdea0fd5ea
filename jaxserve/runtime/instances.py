"""From a `DeploymentPlan` to engines on disjoint device sets.

`build_engines(plan, devices, factory)` assigns devices (the plan's own
assignment, or consecutive ones), checks they are disjoint and exist, and asks
the engine factory for one engine per instance on exactly its devices (stage
s on devices[s*tp:(s+1)*tp]). The default factory loads the model into each
instance's own sharding (`ModelEngine.load`); tests pass the fake engine's.
`Instance` names the three roles' instance types (what a controller holds).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError
from jaxserve.runtime.colocated_instance import ColocatedInstance
from jaxserve.runtime.decode_instance import DecodeInstance
from jaxserve.runtime.engines.contract import Engine
from jaxserve.runtime.prefill_instance import PrefillInstance

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from models.checkpoint import CheckpointChatTemplate

log = logging.getLogger(__name__)

# Embedded factories build an `Engine` (both roles); the Ray backend places one proxy per role.
EngineFactory = Callable[[InstanceSpec, Sequence[jax.Device]], Engine]
Instance = PrefillInstance | DecodeInstance | ColocatedInstance


@dataclasses.dataclass(frozen=True)
class PlacedInstance:
    name: str
    spec: InstanceSpec
    devices: tuple[jax.Device, ...]
    engine: Engine  # with the prefill role for a prefill instance, the decode role otherwise


def instance_names(plan: DeploymentPlan) -> list[str]:
    counts: dict[str, int] = {}
    names = []
    for spec in plan.instances:
        i = counts.get(spec.role, 0)
        counts[spec.role] = i + 1
        names.append(f"{spec.role}-{i}")
    return names


def place(
    plan: DeploymentPlan, devices: Sequence[jax.Device] | None = None
) -> list[tuple[str, InstanceSpec, tuple[jax.Device, ...]]]:
    """Each instance's name, spec (devices assigned) and device objects; raises PlanError if they do not fit."""
    available = list(devices) if devices is not None else jax.devices()
    plan = plan.assign_devices(len(available))
    out = []
    for name, spec in zip(instance_names(plan), plan.instances, strict=True):
        assert spec.devices is not None
        out.append((name, spec, tuple(available[d] for d in spec.devices)))
    used = [d for _, _, devs in out for d in devs]
    if len(set(used)) != len(used):
        raise PlanError("instances must own disjoint devices")
    return out


def build_engines(
    plan: DeploymentPlan, factory: EngineFactory, devices: Sequence[jax.Device] | None = None
) -> list[PlacedInstance]:
    return [PlacedInstance(name, spec, devs, factory(spec, devs)) for name, spec, devs in place(plan, devices)]


def checkpoint_text_tools(source: str) -> tuple[Tokenizer | None, CheckpointChatTemplate | None]:
    """The tokenizer and chat template a model source carries (either None where it has none: a preset name,
    a directory without tokenizer files). One that cannot be read is logged and left out; the model serves
    token ids (and chat through jaxserve's built-in template)."""
    from models.checkpoint import load_chat_template, load_tokenizer

    tokenizer = template = None
    try:
        tokenizer = load_tokenizer(source)
    except Exception:  # a preset name or a directory without tokenizer files
        tokenizer = None
    try:
        template = load_chat_template(source)
    except Exception as e:
        log.warning("%s: its chat template cannot be read (%s); chat uses the built-in template", source, e)
    return tokenizer, template
