"""`--backend ray`: a disaggregated plan deployed as one Ray actor per instance.

`RayController.launch(model, plan, ...)`:

1. joins the cluster at `RayConfig.address`, or starts a local one on loopback;
2. places the plan (`placement.py`: placement groups per plan node);
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
from typing import TYPE_CHECKING, cast

from jaxserve.plan import DeploymentPlan, PlanError
from jaxserve.runtime.controller import Controller, ControllerConfig, Observer
from jaxserve.runtime.engine import DecodeEngine
from jaxserve.runtime.instances import PlacedInstance, instance_names
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
from jaxserve.runtime.ray_backend.placement import Placement, PlacementConfig, place_on_cluster
from jaxserve.runtime.ray_backend.remote_engine import (
    FaultCounters,
    RayKVTransfer,
    RemoteDecodeEngine,
    RemotePrefillEngine,
)
from jaxserve.runtime.ray_backend.transfer import TransferConfig, fetch
from models.config import OPTConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # join this cluster; None: start a local one on 127.0.0.1
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    max_restarts: int = 4  # per actor; a dead actor comes back this many times and rejoins
    restart_timeout_s: float = 180.0
    start_timeout_s: float = 300.0
    engine: EngineKind = "opt"
    fake_config: OPTConfig | None = None  # engine "fake": the hand-computable test engine


def loopback_only() -> None:
    """Make Ray bind 127.0.0.1 (it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def init_ray(address: str | None = None, temp_dir: str | None = None, num_cpus: int | None = None) -> None:
    """Join `address`, or start a local single-node cluster bound to loopback (no dashboard)."""
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
        log_to_driver=True,
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
        placement: Placement,
        counters: FaultCounters,
        observer: Observer | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        holders = {p.name: actors[p.name] for p in placed if p.spec.role == "prefill"}

        def transfer(engine: DecodeEngine) -> RayKVTransfer:
            return RayKVTransfer(engine, holders)

        super().__init__(
            placed, plan, config, transfer=transfer, observer=observer, tokenizer=tokenizer, faults=counters
        )
        self.actors = actors
        self.actor_infos = infos
        self.placement = placement
        for inst in self.prefill_instances:
            engine = inst.engine
            assert isinstance(engine, RemotePrefillEngine)
            engine.start_lease_keeper(inst.holds_kv)

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
    ) -> RayController:
        import ray

        rc = ray_config or RayConfig()
        config = config or ControllerConfig()
        if config.prefix_caching:
            raise PlanError(
                "the Ray backend does not support prefix caching yet (its prefill actors keep dense KV "
                "outside this process); serve with the embedded backend or without --prefix-caching"
            )
        if plan.kind != "disagg":
            raise PlanError("the Ray backend deploys disaggregated plans (prefill and decode instances)")
        init_ray(rc.address)
        placement = place_on_cluster(plan, rc.placement)
        names = instance_names(plan)
        actors: dict[str, ActorHandle] = {}
        try:
            for name, inst, opts in zip(names, plan.instances, placement.options, strict=True):
                assert inst.role in ("prefill", "decode")
                spec = EngineSpec(
                    inst.role, inst.tp, inst.pp, model_source, dtype, config.block_size, rc.engine, rc.fake_config
                )
                actor_cls = PrefillActor if inst.role == "prefill" else DecodeActor
                remote_cls = ray.remote(actor_cls)
                actors[name] = remote_cls.options(  # type: ignore[attr-defined,assignment]
                    max_restarts=rc.max_restarts,
                    max_concurrency=4,  # decode: a step and pulls in flight at once
                    runtime_env=actor_env(spec, rc.placement.use_gpus),
                    **opts,
                ).remote(name, spec, rc.transfer)
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
            placement.remove()
            raise
        model_config = infos[first].model_config
        counters = FaultCounters()
        placed = []
        for name, inst in zip(names, plan.instances, strict=True):
            info, actor = infos[name], actors[name]
            engine: RemotePrefillEngine | RemoteDecodeEngine
            if inst.role == "prefill":
                engine = RemotePrefillEngine(
                    name, actor, info, model_config, rc.restart_timeout_s, counters, lease_s=rc.transfer.lease_s
                )
            else:
                layers = info.stage_layers
                engine = RemoteDecodeEngine(
                    name, actor, info, model_config, rc.restart_timeout_s, counters, stage_layers=layers
                )
            log.info(
                "instance %s: role=%s tp=%d x pp=%d actor pid=%d node=%s (%s)",
                name, inst.role, inst.tp, inst.pp, info.pid, info.node_id[:12], info.node_ip,
            )  # fmt: skip
            placed.append(PlacedInstance(name, inst, (), engine))
        tokenizer = None
        try:
            from models.checkpoint import load_tokenizer

            tokenizer = load_tokenizer(model_source)
        except Exception:  # a preset name or a directory without tokenizer files
            tokenizer = None
        return cls(
            placed, plan, config, actors=actors, infos=infos, placement=placement, counters=counters,
            observer=observer, tokenizer=tokenizer,
        )  # fmt: skip

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
        for a in self.actors.values():
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a, no_restart=True)
        self.placement.remove()


def launch_from_args(
    model: str, plan: DeploymentPlan, config: ControllerConfig, args: argparse.Namespace
) -> Controller:
    """`jaxserve serve --backend ray`: the Ray deployment the command-line flags describe."""
    from jaxserve.runtime.ray_backend.transfer import TransferConfig

    fake_config = None
    if args.engine == "fake":
        from models.config import PRESETS, get_config

        fake_config = get_config(model) if model in PRESETS else OPTConfig.from_hf_config(model)
    rc = RayConfig(
        address=args.ray_address,
        transfer=TransferConfig(mechanism=args.kv_transfer),
        engine=args.engine,
        fake_config=fake_config,
    )
    return RayController.launch(model, plan, config, rc, dtype=args.dtype)
