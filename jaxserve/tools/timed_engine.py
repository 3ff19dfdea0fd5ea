"""The timed engine bound to the planner's latency model: the one place that joins the two.

`jaxserve.runtime.engines.timed.TimedEngine` sleeps what a step-cost contract says; here each instance gets
the simulator's own (`placement.step_time.ModelStepCost` of its latency model and step overhead) and the link
the simulator charges a same-node pull, so `serve --engine timed --profile P` runs the simulator's timeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from jaxserve.core.plan import InstanceSpec
from jaxserve.core.step_cost import LinkCost
from jaxserve.runtime.engines.timed import TimedEngine
from models.config import ModelConfig
from placement.hardware import ClusterSpec
from placement.latency import DeploymentKind, LatencyProvider
from placement.step_time import ModelStepCost


def timed_engine_factory(
    config: ModelConfig, latency: LatencyProvider, cluster: ClusterSpec | None = None
) -> Callable[[InstanceSpec, Sequence[jax.Device]], TimedEngine]:
    """Engines for `Controller.from_plan` that take `latency`'s times (instances on one node of `cluster`)."""
    cluster = cluster or ClusterSpec(latency.device, 1, 8)

    def factory(spec: InstanceSpec, devices: Sequence[jax.Device]) -> TimedEngine:
        kind: DeploymentKind = "colocated" if spec.role == "colocated" else "disagg"
        model = latency.instance(kind, spec.tp, spec.pp, cluster.nvlink_bandwidth, spec.quantization)
        # A pull inside a node: the min(#devices) device pairs move their shares in parallel (the simulator's
        # charge for a same-node pair; the decode side's devices stand in for the smaller side).
        pairs = spec.num_devices
        return TimedEngine(
            config,
            devices,
            ModelStepCost(model, latency.step_overhead(kind, spec.tp, spec.quantization)),
            tp=spec.tp,
            pp=spec.pp,
            link=LinkCost(
                latency_s=cluster.link_latency_s,
                s_per_token=latency.cfg.kv_bytes_per_token / (pairs * cluster.nvlink_bandwidth),
            ),
        )

    return factory
