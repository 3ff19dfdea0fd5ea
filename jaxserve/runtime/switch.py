"""The live switch: move a running embedded deployment to another plan without losing a request.

`PlanSwitcher.switch(plan)` runs one switch, start to end (one at a time; a second caller gets
`SwitchInProgressError`). Where new instances come from is an `InstanceBuilder`: `LocalDevices`
(this process's JAX devices and an engine factory: the embedded backend) or the Ray backend's
`RayActors` (a new actor per instance, placed by Ray; retired actors are killed). The steps:

1. match: each instance of the new plan that has the role and shape (tp, pp, chunk size) of a live
   routed instance keeps that instance (no reload, no drain; `placement.replan_decision.plan_delta` counts
   the same way); the others are *added*, and the routed instances left unmatched *retire*. A dead
   routed instance is never kept: it retires, and a switch to the plan it was part of builds it anew.
2. devices: added instances go on devices no instance holds (`InstanceBuilder.can_build`). When
   there are too few, the retiring instances are routed away and drained first and their devices
   are reused; that needs a kept instance of every routed role to serve meanwhile, else the switch
   is refused (`SwitchError`) before anything changed.
3. build: `InstanceBuilder.build` loads each added instance's weights straight into its own
   sharding (embedded: `engine_factory(spec, devices)` on consecutive free devices; Ray: an actor);
   `SwitchSteps.add_instances` starts them *staged* (no traffic), and
   `SwitchSteps.warm_up_staged` warms them before they are routed (`compilation/deployment.py`'s
   `warm_up_staged`, with the controller's pinned requests): with the controller's
   `warmup_buckets` (serve's default) the bucket warm-up `serve` runs (every padded shape the
   instance's limits allow) and every new prefill -> decode pair's hand-off at every padded prompt
   length; otherwise one pinned request through each. `SwitchReport.warmup_s` is what it took.
4. route: `SwitchSteps.route(kept + added)` switches new requests, hand-offs and re-routes to the
   new instance set atomically (under the controller's lock); `controller.plan` becomes the new plan
   (device indices are those the instances really hold). A kept instance that died since the match
   (its worker moved its requests as it died) is left out and retires with the others: the plan and
   the report (`lost`) say so. If that leaves a role with no live instance, nothing is routed and the
   switch fails like a failed build. (One that dies after routing is a routed instance that died: no
   traffic, `instance_alive` 0, replaced by the next switch.)
5. drain: retiring instances finish what they hold (queued prompts are prefilled, buffered KVs are
   pulled by decode instances, decodes run to completion) and are stopped and dropped, KV pool and
   buffers with them (`SwitchSteps.retire_drained`; the Ray backend also kills their actors). After
   `drain_timeout_s` whatever they still hold
   moves to routed instances through the re-route path (resumed, token for token).

The steps on the instances are `SwitchSteps` (one per controller, its `switch_steps`; the Ray backend's
`RaySwitchSteps` also keeps leases and kills actors). They change the controller's `InstanceSet`
(`instance_set.py`, the controller's: it makes the instances and routes requests to them): its instances by
state, routed, *staged* (built and started, taking no traffic) or *retiring* (routed away, finishing what they
hold), under the controller's lock, which also guards its request table. What they need of the controller is
`SwitchHost`: the instance set and that lock, making an instance, the request table's pinned warm-up requests,
cancelling and moving requests. `PlanSwitcher` drives any `SwitchableController` (the embedded `Controller`,
`RayController`) through its `switch_steps` and imports neither.

Nothing here imports the planner: the replanning loop above (`jaxserve/tools/replan_loop.py`) decides
*what* to switch to; this module only knows how.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import jax

from jaxserve.core.errors import JaxServeError, ShuttingDownError
from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError
from jaxserve.runtime.api import InstanceStats
from jaxserve.runtime.colocated_instance import ColocatedInstance
from jaxserve.runtime.compilation.deployment import BucketWarmup, warm_up_staged
from jaxserve.runtime.decode_instance import DecodeInstance
from jaxserve.runtime.instance_set import InstanceSet
from jaxserve.runtime.instances import EngineFactory, Instance, PlacedInstance
from jaxserve.runtime.prefill_instance import PrefillInstance
from jaxserve.runtime.streams import RequestStream
from jaxserve.runtime.worker import LiveRequest
from models.config import ModelConfig

log = logging.getLogger(__name__)

Shape = tuple[str, int, int, int | None, str | None]  # role, tp, pp, chunk size, weight precision


class SwitchError(JaxServeError):
    """The switch could not be made; its message says what the deployment is now (as it was, unless a
    drain-first switch's build failed and the drained instances could not be rebuilt either)."""


class SwitchAbortedError(SwitchError):
    """The server began shutting down during the switch: it stopped at its next step (nothing new routed)."""


class SwitchUnsupportedError(SwitchError):
    """This deployment cannot switch live (no way to build new instances was given)."""


class SwitchInProgressError(JaxServeError):
    """Another switch is running."""


@dataclasses.dataclass(frozen=True)
class SwitchReport:
    from_plan: str
    to_plan: str
    kept: tuple[str, ...]
    added: tuple[str, ...]
    # instances of the new plan that died before routing (a kept one under load): not routed, retired like the
    # others; `to_plan` is the plan without them
    lost: tuple[str, ...]
    retired: tuple[InstanceStats, ...]  # each retired instance's last stats (KV blocks, buffer slots in use)
    started_at: float  # monotonic time the switch began
    routed_at: float  # monotonic time new requests started going to the new instance set
    drained_first: bool  # retiring instances were drained before the build, to free their devices
    num_moved: int  # requests moved off retiring instances at the drain timeout
    build_s: float  # loading the added instances' weights
    warmup_s: float  # compiling them before routing (`SwitchSteps.warm_up_staged`)
    drain_s: float
    total_s: float

    def to_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["retired"] = [dataclasses.asdict(s) for s in self.retired]
        return out


# `Controller.submit_pinned`: a switch's warm-up request (index, prompt, front instance, decode instance or None)
PinnedSubmit = Callable[
    [int, tuple[int, ...], PrefillInstance | ColocatedInstance, DecodeInstance | None], RequestStream
]


class SwitchHost(Protocol):
    """The few things of a controller the switch's steps (`SwitchSteps`) need (`Controller` is one).

    The instances (`instance_set`, the controller's: it makes them and routes requests to them) and the lock that
    guards them together with the request table: every enqueue happens under it, so an instance routed away
    takes nothing new. From the request table: the switch's own pinned warm-up requests, cancelling, and moving
    the requests a retired instance still held.
    """

    instance_set: InstanceSet
    lock: threading.Lock
    started: bool
    shutting_down: bool
    max_prompt_tokens: int

    @property
    def model_config(self) -> ModelConfig: ...

    def make_instance(self, p: PlacedInstance) -> Instance: ...

    def bucket_warmup(self) -> BucketWarmup: ...

    @property
    def submit_pinned(self) -> PinnedSubmit: ...

    @property
    def end_pinned(self) -> Callable[[Sequence[str]], None]: ...

    def drop_pinned(self) -> list[str]: ...

    def cancel(self, request_id: str) -> None: ...

    def move_held(self, held: Sequence[LiveRequest], why: str) -> None: ...


class SwitchSteps:
    """The steps of a live switch on one controller's instances: stage, warm up, route, retire, or discard.

    `PlanSwitcher` calls them in order (`switch()`); the controller's `shutdown()` calls `discard_staged` (a
    switch in progress stops at its next step). Each step changes the controller's `InstanceSet` under the
    controller's lock. The Ray backend extends three of them (`RaySwitchSteps`: lease keepers, actors).
    """

    def __init__(self, host: SwitchHost) -> None:
        self.host = host
        # the pinned warm-up requests are the request table's (what `compilation.deployment.warm_up_staged` calls)
        self.submit_pinned = host.submit_pinned
        self.end_pinned = host.end_pinned

    @property
    def model_config(self) -> ModelConfig:
        return self.host.model_config

    def add_instances(self, placed: Sequence[PlacedInstance]) -> list[Instance]:
        """Build and start instances for `placed`, *staged*: they take no traffic until `route()` names them."""
        h, instances = self.host, self.host.instance_set
        clash = instances.name_clash([p.name for p in placed])
        if clash:
            raise ValueError(f"instance names already in use: {clash}")
        new = [h.make_instance(p) for p in placed]  # one raises: nothing recorded, the ones built are dropped
        with h.lock:
            if h.shutting_down:  # shutdown() stops the instances it sees: none may appear after it
                raise ShuttingDownError("the server is shutting down: the switch stops before staging new instances")
            instances.placed_of.update((p.name, p) for p in placed)
            instances.stage(new)
            if h.started:  # under the lock: shutdown() sees these staged and stops them
                for inst in new:
                    inst.start()
        return new

    def warm_up_staged(self, timeout_s: float = 600.0) -> float:
        """Warm every staged instance before it is routed; seconds. What and in which order:
        `compilation.deployment.warm_up_staged` (the bucket warm-up, then pinned hand-off requests), through
        `staged_and_routed`, `check_still_staged` and the controller's `submit_pinned` / `end_pinned`."""
        h = self.host
        longest = min(h.max_prompt_tokens, h.model_config.max_position_embeddings - 2)  # + 2 tokens
        return warm_up_staged(self, h.bucket_warmup(), longest, timeout_s)

    def staged_and_routed(self) -> tuple[list[Instance], list[PrefillInstance], list[DecodeInstance]]:
        """The staged instances, and the live routed prefill and decode instances (one consistent view)."""
        instances = self.host.instance_set
        with self.host.lock:
            staged = list(instances.staged)
            routed_prefills = [p for p in instances.prefill if p.error is None]
            routed_decodes = [d for d in instances.decode if d.error is None]
        return staged, routed_prefills, routed_decodes

    def check_still_staged(self, staged: Sequence[Instance]) -> None:
        """Raise when the warm-up of `staged` cannot lead to routing them: one died (its warm-up requests
        were moved on and may have finished, but it cannot serve), or shutdown discarded them."""
        dead = [i for i in staged if i.error is not None]
        if dead:
            raise RuntimeError(f"instance {dead[0].name} died during its warm-up: {dead[0].error!r}")
        with self.host.lock:
            if self.host.shutting_down:
                raise ShuttingDownError("the server is shutting down: the switch stops during its warm-up")
            gone = [i.name for i in staged if i not in self.host.instance_set.staged]
        if gone:
            raise RuntimeError(f"staged instances {gone} were discarded during their warm-up")

    def discard_staged(self, join_timeout_s: float = 10.0) -> None:
        """Stop and drop every staged instance (a switch that failed before routing to them), and end the
        switch's warm-up requests still in flight (timed out, or on an instance that died or hangs).

        Those requests may be queued on a routed prefill instance or held in its buffer waiting for a staged
        decode instance's pull: cancelling them on the serving instances frees those buffer slots, so a
        staged instance that hangs in its warm-up costs the routed ones nothing. A staged instance's own
        lock is not needed (it may be held by a compile that never ends): it is out of the instance set first.
        """
        h = self.host
        with h.lock:
            staged = h.instance_set.discard_staged()
            warmups = h.drop_pinned()
        for inst in staged:  # never waits on their locks: a compile may hold one
            inst.request_stop()
        for rid in warmups:
            h.cancel(rid)  # no longer internal: only routed and retiring instances are asked
        deadline = time.monotonic() + join_timeout_s
        for inst in staged:
            if not inst.join(max(deadline - time.monotonic(), 0.0)):
                log.warning("discarded instance %s did not stop (stuck in a compile or a step): left behind", inst.name)

    def route(self, names: Sequence[str]) -> list[Instance]:
        """Atomically make the routed instances exactly the live ones of `names` (routed or staged ones), in that
        order (`InstanceSet.route`).

        New requests (and hand-offs, re-routes) go only to routed instances from here on; the ones left
        out *retire*: they finish what they hold (see `retire_drained`), and so does a named one that is dead.
        Returns them. Raises ShuttingDownError (nothing changed) once `shutdown()` has begun, ValueError
        (nothing changed) when a role would be left with no live instance.
        """
        with self.host.lock:
            if self.host.shutting_down:
                raise ShuttingDownError("the server is shutting down: the switch stops before routing")
            return self.host.instance_set.route(names)

    def routed_instances(self) -> list[Instance]:
        """The instances taking new requests now (staged and retiring ones left out)."""
        with self.host.lock:
            return self.host.instance_set.routed()

    @property
    def retiring(self) -> tuple[str, ...]:
        with self.host.lock:
            return tuple(i.name for i in self.host.instance_set.retiring)

    def num_held_by_retiring(self) -> int:
        with self.host.lock:
            retiring = list(self.host.instance_set.retiring)
        total = 0
        for inst in retiring:
            with inst.cond:
                total += len(inst.held_requests())
        return total

    def retire_drained(self, force: bool = False) -> list[InstanceStats]:
        """Stop each retiring instance that holds nothing and let it go (engine, KV pool and buffers with it).

        With `force`, a retiring instance still holding requests is stopped too and they move to routed
        instances (the re-route path: resumed where their streams stand). Returns the stats each stopped
        instance had last (its KV blocks and buffer slots in use then: 0 unless something leaked).
        """
        h = self.host
        with h.lock:
            candidates = list(h.instance_set.retiring)
        done: list[InstanceStats] = []
        for inst in candidates:
            with h.lock, inst.cond:  # every enqueue happens under the lock: unrouted and empty stays empty
                empty = not inst.held_requests()
            if not empty and not force:
                continue
            inst.stop()
            with inst.cond:
                held = inst.held_requests()
                inst.drop_all()
            h.move_held(held, f"instance {inst.name} retired by a deployment switch")
            stats = inst.stats()
            with h.lock:
                h.instance_set.forget(inst)
            done.append(stats)
        return done


class SwitchableController(Protocol):
    """What `PlanSwitcher` needs of the controller it switches (`Controller`, `RayController`): its plan, where
    each instance is placed (for the builder), and its `SwitchSteps`."""

    plan: DeploymentPlan

    @property
    def placed_of(self) -> dict[str, PlacedInstance]: ...

    @property
    def switch_steps(self) -> SwitchSteps: ...


def shape_of(spec: InstanceSpec) -> Shape:
    """What an instance must share with a plan's entry to be kept: its precision too (its weights differ)."""
    return (spec.role, spec.tp, spec.pp, spec.chunk_size, spec.quantization)


def match_instances(
    routed: Sequence[tuple[str, InstanceSpec]], plan: DeploymentPlan
) -> tuple[list[tuple[InstanceSpec, str | None]], list[str]]:
    """For each instance of `plan`: the routed instance it keeps (same role and shape) or None (to add);
    and the routed instances nobody keeps (to retire). First come, first kept."""
    free = list(routed)
    pairs: list[tuple[InstanceSpec, str | None]] = []
    for spec in plan.instances:
        hit = next((k for k, (_, s) in enumerate(free) if shape_of(s) == shape_of(spec)), None)
        pairs.append((spec, free.pop(hit)[0] if hit is not None else None))
    return pairs, [name for name, _ in free]


@runtime_checkable
class InstanceBuilder(Protocol):
    """Where a switch's new instances come from, and what the devices allow."""

    def can_build(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], freeing: Sequence[str]
    ) -> bool:
        """Whether `specs` fit on what no instance holds, plus what the instances `freeing` hold."""
        ...

    def capacity_note(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], freeing: Sequence[str]
    ) -> str:
        """Why they do not fit, in words (for the SwitchError)."""
        ...

    def build(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], names: Sequence[str]
    ) -> list[PlacedInstance]:
        """Load an engine for each spec (weights in place), named `names`; nothing is routed yet."""
        ...

    def discard(self, controller: SwitchableController, names: Sequence[str]) -> None:
        """Give back what `build` took for instances that will never be routed (a failed switch)."""
        ...


class LocalDevices:
    """The embedded backend: consecutive free devices of this process, engines from `engine_factory`."""

    def __init__(self, engine_factory: EngineFactory, devices: Sequence[jax.Device] | None = None) -> None:
        self.engine_factory = engine_factory
        self.devices = tuple(devices) if devices is not None else tuple(jax.devices())

    def _free(self, controller: SwitchableController, freeing: Sequence[str]) -> list[int]:
        index = {d: k for k, d in enumerate(self.devices)}
        gone = set(freeing)
        held = {index[d] for n, p in controller.placed_of.items() if n not in gone for d in p.devices if d in index}
        return [k for k in range(len(self.devices)) if k not in held]

    def can_build(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], freeing: Sequence[str]
    ) -> bool:
        return sum(s.num_devices for s in specs) <= len(self._free(controller, freeing))

    def capacity_note(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], freeing: Sequence[str]
    ) -> str:
        free, freed = len(self._free(controller, ())), len(self._free(controller, freeing))
        return (
            f"it needs {sum(s.num_devices for s in specs)} new devices; {free} are free and retiring instances "
            f"free {freed - free} more (of {len(self.devices)})"
        )

    def build(
        self, controller: SwitchableController, specs: Sequence[InstanceSpec], names: Sequence[str]
    ) -> list[PlacedInstance]:
        free = self._free(controller, ())
        placed: list[PlacedInstance] = []
        cursor = 0
        for spec, name in zip(specs, names, strict=True):
            ids = tuple(free[cursor : cursor + spec.num_devices])
            cursor += spec.num_devices
            placed_spec = dataclasses.replace(spec, devices=ids, nodes=None)
            devs = tuple(self.devices[k] for k in ids)
            placed.append(PlacedInstance(name, placed_spec, devs, self.engine_factory(placed_spec, devs)))
        return placed

    def discard(self, controller: SwitchableController, names: Sequence[str]) -> None:
        del controller, names  # the engines' arrays go with the instances


class PlanSwitcher:
    """Switches a running controller between plans (one switch at a time)."""

    def __init__(
        self,
        controller: SwitchableController,
        builder: InstanceBuilder | EngineFactory,
        devices: Sequence[jax.Device] | None = None,
        *,
        drain_timeout_s: float = 60.0,
        warmup_timeout_s: float = 600.0,
    ) -> None:
        """`builder`: an `InstanceBuilder`, or an engine factory (then `LocalDevices(builder, devices)`)."""
        self.controller = controller
        self.builder = builder if isinstance(builder, InstanceBuilder) else LocalDevices(builder, devices)
        self.drain_timeout_s = drain_timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        self._lock = threading.Lock()
        self.last_report: SwitchReport | None = None

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def switch(self, plan: DeploymentPlan) -> SwitchReport:
        """Move the deployment to `plan` (blocking until the retired instances are gone)."""
        if not self._lock.acquire(blocking=False):
            raise SwitchInProgressError("a deployment switch is already running; retry when it has finished")
        try:
            report = self._switch(plan)
        finally:
            self._lock.release()
        self.last_report = report
        return report

    # ---- steps -------------------------------------------------------------------
    def _switch(self, plan: DeploymentPlan) -> SwitchReport:
        c = self.controller
        started = time.monotonic()
        old = c.plan
        if plan.kind != old.kind:
            raise SwitchError(f"cannot switch a {old.kind} deployment to a {plan.kind} one ({plan.describe()})")
        routed = c.switch_steps.routed_instances()
        routed_specs = [(i.name, c.placed_of[i.name].spec) for i in routed]
        # A dead routed instance is never kept (it cannot serve): it retires, and its shape is built anew.
        dead = {i.name for i in routed if i.error is not None}
        if dead:
            log.warning("switch: routed instances %s are dead: they retire, the new plan's are built", sorted(dead))
        pairs, retiring = match_instances([(n, s) for n, s in routed_specs if n not in dead], plan)
        retiring += [n for n, _ in routed_specs if n in dead]
        to_add = [spec for spec, kept in pairs if kept is None]
        builder = self.builder
        drain_first = not builder.can_build(c, to_add, ())
        if drain_first and not builder.can_build(c, to_add, retiring):
            raise SwitchError(f"{plan.describe()} cannot be built: {builder.capacity_note(c, to_add, retiring)}")
        kept_names = [k for _, k in pairs if k is not None]
        num_moved = 0
        drain_s = 0.0
        if drain_first:
            kept_roles = {c.placed_of[n].spec.role for n in kept_names}
            needed = {"colocated"} if plan.kind == "colocated" else {"prefill", "decode"}
            if not needed <= kept_roles:
                raise SwitchError(
                    f"{plan.describe()} does not fit beside the running instances ({builder.capacity_note(c, to_add, ())}); "
                    f"draining the retiring instances first would leave no {sorted(needed - kept_roles)} instance serving"
                )
            log.info("switch: draining %s first to free their devices", retiring)
            try:
                c.switch_steps.route(kept_names)
            except ShuttingDownError as e:
                raise SwitchAbortedError(f"the switch to {plan.describe()} stopped: {e}") from e
            except ValueError as e:  # the kept instances of a role died since the match: nothing changed
                raise SwitchError(f"{plan.describe()} cannot drain first: {e}; the deployment is as it was") from e
            t = time.monotonic()
            retired, num_moved = self._drain()
            drain_s = time.monotonic() - t
        # build the added instances (embedded: on free devices, consecutive per instance)
        t = time.monotonic()
        names: list[str] = []
        taken = set(c.placed_of)
        for spec in to_add:
            names.append(_fresh_name(spec.role, taken))
            taken.add(names[-1])
        # route: kept and added, in the new plan's order
        new_names: list[str] = []
        added_iter = iter(names)
        for _, kept in pairs:
            new_names.append(kept if kept is not None else next(added_iter))
        step = "building"
        try:
            placed = builder.build(c, to_add, names) if to_add else []
            c.switch_steps.add_instances(placed)
            build_s = time.monotonic() - t
            step = "warming up"
            warmup_s = c.switch_steps.warm_up_staged(self.warmup_timeout_s) if placed else 0.0
            routed_at = time.monotonic()
            step = "routing"
            # (after a drain-first, the kept ones are routed already: this adds the built ones). An instance
            # of `new_names` that died meanwhile (a kept one) is left out and retires: see `InstanceSet.route`.
            c.switch_steps.route(new_names)
        except Exception as e:
            c.switch_steps.discard_staged()
            builder.discard(c, names)
            if isinstance(e, ShuttingDownError):
                raise SwitchAbortedError(f"the switch to {plan.describe()} stopped: {e}") from e
            what = f"{step} the new instances of {plan.describe()} failed: {e}"
            if drain_first:
                drained = [(name, spec) for name, spec in routed_specs if name in retiring]
                restored = self._restore(old, [name for name, _ in routed_specs], drained)
                raise SwitchError(f"{what}; {restored}") from e
            raise SwitchError(f"{what}; the deployment is as it was ({old.describe()})") from e
        serving = {i.name for i in c.switch_steps.routed_instances()}
        lost = [n for n in new_names if n not in serving]  # dead at routing: left out, retiring
        new_names = [n for n in new_names if n in serving]
        c.plan = DeploymentPlan(
            tuple(c.placed_of[n].spec for n in new_names),
            model=old.model,
            expected=dict(plan.expected) if not lost else {},  # the plan's predictions were for all of it
        )
        if lost:
            log.error("switch: %s died during the switch: not routed (retiring); serving %s", lost, c.plan.describe())
        log.info("switch: now routing to %s (%s)", c.plan.describe(), ", ".join(new_names))
        if not drain_first:
            t = time.monotonic()
            retired, num_moved = self._drain()
            drain_s = time.monotonic() - t
        report = SwitchReport(
            from_plan=old.describe(),
            to_plan=c.plan.describe(),
            kept=tuple(n for n in kept_names if n not in lost),
            added=tuple(n for n in names if n not in lost),
            lost=tuple(lost),
            retired=tuple(retired),
            started_at=started,
            routed_at=routed_at,
            drained_first=drain_first,
            num_moved=num_moved,
            build_s=build_s,
            warmup_s=warmup_s,
            drain_s=drain_s,
            total_s=time.monotonic() - started,
        )
        log.info(
            "switch %s -> %s: kept %s, added %s, retired %s in %.2f s (build %.2f, warm-up %.2f, drain %.2f)",
            report.from_plan, report.to_plan, list(report.kept), list(report.added),
            [s.name for s in report.retired], report.total_s, build_s, warmup_s, drain_s,
        )  # fmt: skip
        return report

    def _restore(
        self, old: DeploymentPlan, routed_order: Sequence[str], drained: Sequence[tuple[str, InstanceSpec]]
    ) -> str:
        """A drain-first switch whose build failed has already stopped the `drained` instances (name, spec).
        Rebuild them on the devices they freed, under their names, warm them and route them again in
        `routed_order` (the order before the switch). Returns what is serving now, truthfully, for the error."""
        c = self.controller
        names = [name for name, _ in drained]
        try:
            placed = self.builder.build(c, [spec for _, spec in drained], names)
            c.switch_steps.add_instances(placed)
            c.switch_steps.warm_up_staged(self.warmup_timeout_s)
            c.switch_steps.route(routed_order)
        except Exception as e:
            c.switch_steps.discard_staged()
            self.builder.discard(c, names)
            serving = [i.name for i in c.switch_steps.routed_instances()]
            c.plan = DeploymentPlan(tuple(c.placed_of[n].spec for n in serving), model=old.model)
            log.error("switch: rebuilding the drained instances %s failed too: %r", names, e)
            return (
                f"{', '.join(names)} had been drained first to free their devices, and rebuilding them failed too "
                f"({e}): now serving {c.plan.describe()} ({', '.join(serving)})"
            )
        c.plan = DeploymentPlan(
            tuple(c.placed_of[n].spec for n in routed_order), model=old.model, expected=dict(old.expected)
        )
        log.warning("switch: the build failed after draining %s first; rebuilt them", names)
        return (
            f"{', '.join(names)} had been drained first to free their devices and were rebuilt: "
            f"the deployment is as it was ({c.plan.describe()})"
        )

    def _drain(self) -> tuple[list[InstanceStats], int]:
        """Wait for the retiring instances to finish what they hold; move the rest at the timeout."""
        steps = self.controller.switch_steps
        retired: list[InstanceStats] = []
        deadline = time.monotonic() + self.drain_timeout_s
        while steps.retiring and time.monotonic() < deadline:
            retired.extend(steps.retire_drained())
            time.sleep(0.005)
        num_moved = 0
        if steps.retiring:
            num_moved = steps.num_held_by_retiring()
            log.warning("switch: %d requests still on %s after %.0f s: moving them", num_moved, steps.retiring,
                        self.drain_timeout_s)  # fmt: skip
            retired.extend(steps.retire_drained(force=True))
        return retired, num_moved


def _fresh_name(role: str, taken: set[str]) -> str:
    k = 0
    while f"{role}-{k}" in taken:
        k += 1
    return f"{role}-{k}"


__all__ = [
    "InstanceBuilder",
    "LocalDevices",
    "PlanError",
    "PlanSwitcher",
    "SwitchAbortedError",
    "SwitchError",
    "SwitchHost",
    "SwitchInProgressError",
    "SwitchReport",
    "SwitchSteps",
    "SwitchUnsupportedError",
    "SwitchableController",
    "match_instances",
]
