"""Reserving a `DeploymentPlan`'s instances their room on a Ray cluster (Ray's placement groups).

(The planner places instances on devices and nodes: that is `placement/`. This module only turns the plan's node
assignment into Ray resource requests: `ResourceConfig`, `ReservedGroups`, `reserve_groups`.)

One actor per instance, so an instance lives on one node. When the plan names
nodes (`InstanceSpec.nodes`, written by the planner), every instance on plan
node `n` gets a bundle in one STRICT_PACK placement group for `n`: Ray puts the
whole group on one machine. With low node affinity (Algorithm 2) the planner
gives a stage's prefill and decode segments the same node, so their KV moves
inside one machine. A plan without nodes (high affinity) places actors anywhere.

`node_resource_prefix` ties plan node `n` to the cluster node that offers the
custom resource `f"{prefix}{n}"` (how tests simulate nodes with
`ray.cluster_utils.Cluster`, and how an operator pins plan nodes to machines).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


@dataclasses.dataclass(frozen=True)
class ResourceConfig:
    """What each actor asks the Ray cluster for (`RayConfig.resources`)."""

    num_cpus_per_actor: float = 1.0
    use_gpus: bool = False  # GPUs: num_gpus = tp * pp per actor; CPU: virtual devices in the actor's env
    node_resource_prefix: str | None = None
    ready_timeout_s: float = 120.0


def instance_node(spec: InstanceSpec) -> int | None:
    """The plan node an instance runs on; PlanError when its stages span nodes (one actor per instance)."""
    if spec.nodes is None:
        return None
    if len(set(spec.nodes)) != 1:
        raise PlanError(
            f"{spec.role} {spec.shape} spans nodes {spec.nodes}: the Ray backend runs one actor per instance, "
            "so an instance must sit on one node"
        )
    return spec.nodes[0]


def bundle(spec: InstanceSpec, config: ResourceConfig) -> dict[str, float]:
    out: dict[str, float] = {"CPU": config.num_cpus_per_actor}
    if config.use_gpus:
        out["GPU"] = float(spec.num_devices)
    node = instance_node(spec)
    if node is not None and config.node_resource_prefix is not None:
        out[f"{config.node_resource_prefix}{node}"] = 0.001
    return out


def group_by_node(plan: DeploymentPlan | Sequence[InstanceSpec]) -> dict[int, list[int]]:
    """Plan node -> indices (into the instances) of the instances on it; empty when they name no nodes."""
    specs = plan.instances if isinstance(plan, DeploymentPlan) else plan
    nodes = [instance_node(spec) for spec in specs]
    if any(n is None for n in nodes) and any(n is not None for n in nodes):
        raise PlanError("either every instance names its node or none does")
    out: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        if n is not None:
            out.setdefault(n, []).append(i)
    return out


@dataclasses.dataclass
class ReservedGroups:
    """Per instance (plan order): the Ray actor options that place it; plus the groups to remove at shutdown."""

    options: list[dict[str, object]]
    groups: list[PlacementGroup]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            remove_placement_group(g)
        self.groups = []


def reserve_groups(plan: DeploymentPlan | Sequence[InstanceSpec], config: ResourceConfig) -> ReservedGroups:
    """Create the placement groups a plan (or some instances: a live switch's) needs, waiting until they are
    ready, and each actor's options."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    specs = plan.instances if isinstance(plan, DeploymentPlan) else tuple(plan)
    options: list[dict[str, object]] = []
    for spec in specs:
        opt: dict[str, object] = {"num_cpus": config.num_cpus_per_actor}
        if config.use_gpus:
            opt["num_gpus"] = spec.num_devices
        options.append(opt)
    groups = []
    for node, members in sorted(group_by_node(specs).items()):
        pg = placement_group([bundle(specs[i], config) for i in members], strategy="STRICT_PACK")
        try:
            ray.get(pg.ready(), timeout=config.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PlanError(
                f"plan node {node} ({len(members)} instances) found no Ray node with room within "
                f"{config.ready_timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}"
            ) from None
        groups.append(pg)
        for b, i in enumerate(members):
            options[i]["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=b
            )
    return ReservedGroups(options, groups)
