"""`--backend ray`: a disaggregated plan deployed as one Ray actor per instance.

`RayController.launch(model, plan, ...)`:

1. joins the cluster at `RayConfig.address`, or starts a local one on loopback;
2. reserves the plan's room (`placement_groups.py`: Ray placement groups per plan node);
3. starts a `PrefillActor` / `DecodeActor` per instance, each with its own
   JAX runtime (`runtime_env` gives a CPU actor `tp * pp` virtual devices) and
   `max_restarts`, and waits for each to report its `ActorInfo`;
4. checks that every actor serves the same model with the same KV shape
   (`check_compatible`), refusing a mismatched peer with a clear error;
5. wraps the actors in `RemotePrefillEngine` / `RemoteDecodeEngine` proxies
   and hands them to the ordinary `Controller`, whose prefill / decode loops
   and scheduling policies run unchanged in this process, with one
   `RayKVTransfer` per decode instance as the KV transfer.

Failures end in the controller's own hooks: a proxy whose actor is gone for
good raises EngineDeadError, its instance's worker dies, and
`Controller.on_instance_dead` moves its requests (nothing here touches the
controller's request table). Fault counters are bumped as events happen
(`FaultCounters`, shared by the proxies and the controller), so `stats()` makes
no remote call.

`shutdown()` drains like the embedded controller, then stops the lease keepers,
kills the actors and removes the placement groups.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError
from jaxserve.runtime.api import InstanceStats
from jaxserve.runtime.compilation.cache import CompileCacheConfig
from jaxserve.runtime.controller import Controller, ControllerConfig, Observer
from jaxserve.runtime.decode_instance import DecodeInstance
from jaxserve.runtime.engines.contract import Engine
from jaxserve.runtime.instances import Instance, PlacedInstance, checkpoint_text_tools, instance_names
from jaxserve.runtime.kv_connectors.ray import RayKVTransfer
from jaxserve.runtime.kv_connectors.ray_pull import ActorPulls, TransferConfig, fetch
from jaxserve.runtime.prefill_instance import PrefillInstance
from jaxserve.runtime.ray_backend.actors import (
    ActorInfo,
    BufferStats,
    DecodeActor,
    DecodeStats,
    EngineKind,
    EngineSpec,
    PrefillActor,
    check_compatible,
)
from jaxserve.runtime.ray_backend.placement_groups import ReservedGroups, ResourceConfig, reserve_groups
from jaxserve.runtime.ray_backend.remote_engine import FaultCounters, RemoteDecodeEngine, RemotePrefillEngine
from jaxserve.runtime.switch import SwitchableController, SwitchSteps, SwitchUnsupportedError
from models.config import ModelConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # join this cluster; None: start a local one on 127.0.0.1
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    resources: ResourceConfig = dataclasses.field(default_factory=ResourceConfig)
    max_restarts: int = 4  # per actor; a dead actor comes back this many times and rejoins
    restart_timeout_s: float = 180.0
    start_timeout_s: float = 300.0
    engine: EngineKind = "model"
    fake_config: ModelConfig | None = None  # engine "fake": the hand-computable test engine


def loopback_only() -> None:
    """Make Ray bind 127.0.0.1 (it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def init_ray(address: str | None = None, temp_dir: str | None = None, num_cpus: int | None = None) -> None:
    """Join `address`, or start a local single-node cluster bound to loopback (no dashboard), whose actors run at
    the driver's CPU priority: Ray starts its workers at niceness 15 (`worker_niceness`), so on a busy machine
    every other process, the controller's own threads included, came first, and an actor's warm-up took minutes
    where the embedded engine's took seconds (SmolLM2's prefill actor: 452 s against ~12 s)."""
    import ray

    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, log_to_driver=True)
        return
    loopback_only()
    # Ray's socket paths must stay under 108 characters: a short directory under /tmp.
    root = temp_dir or os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="rt", dir="/tmp")
    os.environ["RAY_TMPDIR"] = root
    ray_dir = os.path.join(root, "ray")
    os.makedirs(ray_dir, exist_ok=True)
    ray.init(
        _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=ray_dir, num_cpus=num_cpus,
        log_to_driver=True, _system_config={"worker_niceness": 0},
    )  # fmt: skip


def actor_env(spec: EngineSpec, use_gpus: bool) -> dict[str, dict[str, str]]:
    """The actor's own JAX runtime: `tp * pp` virtual CPU devices, or the GPUs Ray assigns."""
    if use_gpus:
        return {"env_vars": {}}
    env = {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={spec.num_devices}",
        "JAX_PLATFORMS": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return {"env_vars": env}


class RayController(Controller):
    """A `Controller` whose instances are Ray actors (see the module docstring)."""

    def __init__(
        self,
        placed: list[PlacedInstance],
        plan: DeploymentPlan,
        config: ControllerConfig,
        *,
        actors: dict[str, ActorHandle],
        infos: dict[str, ActorInfo],
        groups: ReservedGroups,
        counters: FaultCounters,
        observer: Observer | None = None,
        tokenizer: Tokenizer | None = None,
        launch: LaunchInputs | None = None,
    ) -> None:
        # Every decode instance's transfer looks prefill actors up here: a live switch adds to it.
        self._holders: dict[str, ActorHandle] = {p.name: actors[p.name] for p in placed if p.spec.role == "prefill"}

        def transfer(engine: Engine) -> RayKVTransfer:
            return RayKVTransfer(engine, self._holders)

        super().__init__(
            placed, plan, config, transfer=transfer, observer=observer, tokenizer=tokenizer, faults=counters
        )
        self.switch_steps = RaySwitchSteps(self)
        self.actors = actors
        self.actor_infos = infos
        self.groups = groups
        self.launch_inputs = launch
        self.counters = counters
        # Instances whose bundle sits in a placement group shared with others (the launch's, per plan
        # node): retiring one frees nothing until shutdown. Instances a switch adds get their own group.
        self._shared_group = {p.name for p in placed} if groups.groups else set()
        self._own_groups: dict[str, ReservedGroups] = {}
        for inst in self.prefill_instances:
            engine = inst.engine
            assert isinstance(engine, RemotePrefillEngine)
            engine.start_lease_keeper(inst.holds_kv)
        pooled: list[PrefillInstance | DecodeInstance] = [*self.prefill_instances, *self.decode_instances]
        for worker in pooled:
            _forget_pool_on_restart(worker)

    @classmethod
    def launch(
        cls,
        model_source: str,
        plan: DeploymentPlan,
        config: ControllerConfig | None = None,
        ray_config: RayConfig | None = None,
        *,
        observer: Observer | None = None,
        dtype: str = "float32",
        quantization: str | None = None,
    ) -> RayController:

        config = config or ControllerConfig()
        rc = ray_config or RayConfig()
        if plan.kind != "disagg":
            raise PlanError("the Ray backend deploys disaggregated plans (prefill and decode instances)")
        init_ray(rc.address)
        inputs = LaunchInputs.of(model_source, dtype, rc, config, quantization)
        groups = reserve_groups(plan, rc.resources)
        names = instance_names(plan)
        try:
            actors, infos = _start_actors(inputs, names, plan.instances, groups.options)
        except BaseException:
            groups.remove()
            raise
        counters = FaultCounters()
        model_config = infos[names[0]].model_config
        placed = [
            _placed(inputs, name, inst, actors[name], infos[name], model_config, counters)
            for name, inst in zip(names, plan.instances, strict=True)
        ]
        tokenizer, chat_template = checkpoint_text_tools(model_source)
        controller = cls(
            placed, plan, config, actors=actors, infos=infos, groups=groups, counters=counters,
            observer=observer, tokenizer=tokenizer, launch=inputs,
        )  # fmt: skip
        controller.chat_template = chat_template
        return controller

    # ---- live switch (jaxserve/runtime/switch.py with `RayActors`) ------------------------------
    def start_actors(self, specs: Sequence[InstanceSpec], names: Sequence[str]) -> list[PlacedInstance]:
        """New actors for `specs` (each in its own placement group when it names a node), checked against
        the running model, wrapped in proxies; not yet instances of this controller."""
        if self.launch_inputs is None:
            raise SwitchUnsupportedError("this Ray controller was not started by RayController.launch")
        inputs = self.launch_inputs
        started: list[str] = []
        try:
            for name, spec in zip(names, specs, strict=True):
                groups = reserve_groups([spec], inputs.ray.resources)
                self._own_groups[name] = groups
                started.append(name)
                actors, infos = _start_actors(inputs, [name], [spec], groups.options)
                reference = next(iter(self.actor_infos))
                reference_info = self.actor_infos[reference]
                self.actors.update(actors)  # before the check: one that fails it is killed with the others below
                self.actor_infos.update(infos)
                check_compatible(reference_info.signature, infos[name].signature, reference, name)
        except BaseException:
            self.release_actors(started)
            raise
        return [
            _placed(inputs, name, spec, self.actors[name], self.actor_infos[name], self.model_config, self.counters)
            for name, spec in zip(names, specs, strict=True)
        ]

    def release_actors(self, names: Sequence[str]) -> None:
        """Kill the actors of instances that are gone (retired, or built for a switch that failed)."""
        import ray

        for name in names:
            actor = self.actors.pop(name, None)
            self.actor_infos.pop(name, None)
            self._holders.pop(name, None)
            if actor is not None:
                with contextlib.suppress(Exception):  # already gone
                    ray.kill(actor, no_restart=True)
            groups = self._own_groups.pop(name, None)
            if groups is not None:
                groups.remove()

    def freed_resources(self, names: Sequence[str]) -> dict[str, float]:
        """The Ray resources killing these instances' actors gives back (none for a shared launch group)."""
        out: dict[str, float] = {}
        for name in names:
            if name in self._shared_group or name not in self.placed_of or self.launch_inputs is None:
                continue
            for key, value in _actor_resources(self.placed_of[name].spec, self.launch_inputs.ray).items():
                out[key] = out.get(key, 0.0) + value
        return out

    # ---- introspection ---------------------------------------------------------------------
    def actor(self, name: str) -> ActorHandle:
        return self.actors[name]

    def buffer_stats(self, name: str, timeout_s: float = 30.0) -> BufferStats:
        return cast(BufferStats, fetch(self.actors[name].buffer_stats.remote(), timeout_s))

    def decode_stats(self, name: str) -> DecodeStats:
        return cast(DecodeStats, fetch(self.actors[name].stats.remote(), 30))

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self, drain_timeout_s: float | None = None) -> None:
        import ray

        super().shutdown(drain_timeout_s)
        for inst in self.prefill_instances:
            engine = inst.engine
            if isinstance(engine, RemotePrefillEngine):
                engine.stop_lease_keeper()
        # copies: a switch's build may still be adding actors from its thread (it kills them when it sees the
        # shutdown; these are the ones already there)
        for a in list(self.actors.values()):
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a, no_restart=True)
        self.groups.remove()
        for groups in list(self._own_groups.values()):
            groups.remove()
        self._own_groups.clear()


class RaySwitchSteps(SwitchSteps):
    """`SwitchSteps` on Ray actors: a staged prefill proxy keeps its actor's KV leases alive, a discarded or retired
    one stops doing so, and a retired instance's actor is killed (and its group removed)."""

    def __init__(self, host: RayController) -> None:
        super().__init__(host)
        self.controller = host

    def add_instances(self, placed: Sequence[PlacedInstance]) -> list[Instance]:
        new = super().add_instances(placed)
        for inst in new:
            if isinstance(inst, PrefillInstance | DecodeInstance):
                _forget_pool_on_restart(inst)
            if isinstance(inst, PrefillInstance):
                engine = inst.engine
                assert isinstance(engine, RemotePrefillEngine)
                self.controller._holders[inst.name] = engine.actor
                engine.start_lease_keeper(inst.holds_kv)
        return new

    def discard_staged(self, join_timeout_s: float = 10.0) -> None:
        """`SwitchSteps.discard_staged` (a switch that failed before routing, or shutdown during one), and the new
        prefill proxies' lease keepers stop; the switcher then kills the actors (`RayActors.discard`)."""
        with self.host.lock:
            engines = [inst.engine for inst in self.host.instance_set.staged]
        super().discard_staged(join_timeout_s)
        for engine in engines:
            if isinstance(engine, RemotePrefillEngine):
                engine.stop_lease_keeper()

    def retire_drained(self, force: bool = False) -> list[InstanceStats]:
        """`SwitchSteps.retire_drained`, then each retired instance's actor is killed (and its group removed)."""
        with self.host.lock:
            engines = {inst.name: inst.engine for inst in self.host.instance_set.retiring}
        retired = super().retire_drained(force)
        for stats in retired:
            engine = engines.get(stats.name)
            if isinstance(engine, RemotePrefillEngine):
                engine.stop_lease_keeper()
        self.controller.release_actors([s.name for s in retired])
        return retired


class RayActors:
    """`InstanceBuilder` of a live switch on the Ray backend: one new actor per added instance.

    What fits is what Ray has available now plus what the retiring actors give back (their CPU / GPU
    bundle; an instance placed in the launch's shared per-node group frees nothing until shutdown).
    """

    def __init__(self, controller: RayController) -> None:
        self.controller = controller

    def _needs(self, specs: Sequence[InstanceSpec]) -> dict[str, float]:
        assert self.controller.launch_inputs is not None
        out: dict[str, float] = {}
        for spec in specs:
            for key, value in _actor_resources(spec, self.controller.launch_inputs.ray).items():
                out[key] = out.get(key, 0.0) + value
        return out

    def _short(self, specs: Sequence[InstanceSpec], freeing: Sequence[str]) -> dict[str, tuple[float, float]]:
        import ray

        available = ray.available_resources()
        freed = self.controller.freed_resources(freeing)
        have = {k: available.get(k, 0.0) + freed.get(k, 0.0) for k in self._needs(specs)}
        return {k: (need, have[k]) for k, need in self._needs(specs).items() if need > have[k] + 1e-9}

    def can_build(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], freeing: Sequence[str]
    ) -> bool:
        del controller
        return not self._short(specs, freeing)

    def capacity_note(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], freeing: Sequence[str]
    ) -> str:
        del controller
        short = self._short(specs, freeing)
        return "the Ray cluster is short of " + ", ".join(
            f"{k} (needs {n:g}, has {h:g})" for k, (n, h) in short.items()
        )

    def build(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], names: Sequence[str]
    ) -> list[PlacedInstance]:
        del controller
        return self.controller.start_actors(specs, names)

    def discard(self, controller: SwitchableController, names: Sequence[str]) -> None:
        del controller
        self.controller.release_actors(names)


def _forget_pool_on_restart(inst: PrefillInstance | DecodeInstance) -> None:
    """Prefix caching: the instance's `PrefixCache` (in this process) names blocks of its actor's pool; a
    restarted actor's pool is new, so the blocks no request pins are forgotten (`clear`). The pinned ones
    are rewritten by the recovery: a prefill batch runs again in full, a decode actor rebuilds every
    running sequence's whole context."""
    engine = inst.engine
    if not isinstance(engine, RemotePrefillEngine | RemoteDecodeEngine):
        return

    def forget() -> None:
        with inst.cond:
            num = inst.cache.clear()
        if num:
            log.warning("%s restarted: forgot %d cached KV blocks", inst.name, num)

    engine.on_pool_lost = forget


@dataclasses.dataclass(frozen=True)
class LaunchInputs:
    """What a deployment's actors are started from (kept for the actors a live switch adds)."""

    model_source: str
    dtype: str
    ray: RayConfig
    block_size: int
    pulls: ActorPulls  # the Ray connector's knobs and the controller's (one name each for both backends)
    quantization: str | None = None  # every instance's precision unless its plan entry names one

    @classmethod
    def of(
        cls, model_source: str, dtype: str, rc: RayConfig, config: ControllerConfig, quantization: str | None = None
    ) -> LaunchInputs:
        pulls = ActorPulls(rc.transfer, config.pull_failure, config.kv_checksum)
        return cls(model_source, dtype, rc, config.limits.block_size, pulls, quantization)


def _actor_resources(spec: InstanceSpec, rc: RayConfig) -> dict[str, float]:
    out = {"CPU": rc.resources.num_cpus_per_actor}
    if rc.resources.use_gpus:
        out["GPU"] = float(spec.num_devices)
    return out


def _start_actors(
    inputs: LaunchInputs,
    names: Sequence[str],
    specs: Sequence[InstanceSpec],
    options: Sequence[dict[str, object]],
) -> tuple[dict[str, ActorHandle], dict[str, ActorInfo]]:
    """Start one actor per instance and wait for each to report; all are killed if one fails."""
    import ray

    rc = inputs.ray
    actors: dict[str, ActorHandle] = {}
    try:
        for name, inst, opts in zip(names, specs, options, strict=True):
            assert inst.role in ("prefill", "decode")
            spec = EngineSpec(
                role=inst.role, tp=inst.tp, pp=inst.pp, model_source=inputs.model_source, dtype=inputs.dtype,
                block_size=inputs.block_size, engine=rc.engine, fake_config=rc.fake_config,
                quantization=inst.quantization if inst.quantization is not None else inputs.quantization,
                compile_cache=CompileCacheConfig.current(),
            )  # fmt: skip
            actor_cls = PrefillActor if inst.role == "prefill" else DecodeActor
            remote_cls = ray.remote(actor_cls)
            actors[name] = remote_cls.options(  # type: ignore[attr-defined,assignment]
                max_restarts=rc.max_restarts,
                max_concurrency=4,  # decode: a step and pulls in flight at once
                runtime_env=actor_env(spec, rc.resources.use_gpus),
                **opts,
            ).remote(name, spec, inputs.pulls)
        refs: dict[str, object] = {name: a.info.remote() for name, a in actors.items()}
        infos: dict[str, ActorInfo] = {}
        for name, ref in refs.items():
            infos[name] = cast(ActorInfo, fetch(ref, rc.start_timeout_s))
        first = names[0]
        for name in names[1:]:
            check_compatible(infos[first].signature, infos[name].signature, first, name)
    except BaseException:
        for a in actors.values():
            ray.kill(a, no_restart=True)
        raise
    return actors, infos


def _placed(
    inputs: LaunchInputs,
    name: str,
    inst: InstanceSpec,
    actor: ActorHandle,
    info: ActorInfo,
    model_config: ModelConfig,
    counters: FaultCounters,
) -> PlacedInstance:
    """The controller's view of one actor: its spec and the proxy engine."""
    rc = inputs.ray
    engine: RemotePrefillEngine | RemoteDecodeEngine
    if inst.role == "prefill":
        engine = RemotePrefillEngine(
            name, actor, info, model_config, rc.restart_timeout_s, counters, lease_s=rc.transfer.lease_s
        )
    else:
        engine = RemoteDecodeEngine(
            name, actor, info, model_config, rc.restart_timeout_s, counters, stage_layers=info.stage_layers
        )
    log.info(
        "instance %s: role=%s tp=%d x pp=%d actor pid=%d node=%s (%s)",
        name, inst.role, inst.tp, inst.pp, info.pid, info.node_id[:12], info.node_ip,
    )  # fmt: skip
    return PlacedInstance(name, inst, (), engine)


def launch_from_args(
    model: str, plan: DeploymentPlan, config: ControllerConfig, args: argparse.Namespace
) -> Controller:
    """`jaxserve serve --backend ray`: the Ray deployment the command-line flags describe."""
    fake_config = None
    if args.engine == "fake":
        from models.checkpoint import source_config

        fake_config = source_config(model)
    rc = RayConfig(
        address=args.ray_address,
        transfer=TransferConfig(mechanism=args.kv_transfer),
        engine=args.engine,
        fake_config=fake_config,
    )
    return RayController.launch(model, plan, config, rc, dtype=args.dtype, quantization=args.quantization)
