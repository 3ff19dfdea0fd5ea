"""The instances a controller owns, by state: routed (per role, in routing order), staged and retiring.

The controller keeps one `InstanceSet` and changes it only under its lock: at start every instance is routed;
a live switch's steps (`switch.SwitchSteps`, on the controller's instance set) stage new ones (`add_instances`),
route a new set (`route`), and forget the retiring ones once drained (`retire_drained`).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.runtime.colocated_instance import ColocatedInstance
from jaxserve.runtime.decode_instance import DecodeInstance
from jaxserve.runtime.instances import Instance, PlacedInstance
from jaxserve.runtime.prefill_instance import PrefillInstance


class InstanceSet:
    """A deployment's instances by state: routed (per role, in routing order), staged and retiring.

    Not thread-safe on its own: the controller calls it under its lock (every enqueue happens under that
    lock too, so an instance routed away takes nothing new). `placed_of` names every instance that holds
    devices (routed, staged or retiring) and what it was placed as.
    """

    def __init__(self) -> None:
        self.prefill: list[PrefillInstance] = []
        self.decode: list[DecodeInstance] = []
        self.colocated: list[ColocatedInstance] = []
        self.staged: list[Instance] = []
        self.retiring: list[Instance] = []
        self.placed_of: dict[str, PlacedInstance] = {}

    def add_routed(self, inst: Instance) -> None:
        if isinstance(inst, PrefillInstance):
            self.prefill.append(inst)
        elif isinstance(inst, DecodeInstance):
            self.decode.append(inst)
        else:
            self.colocated.append(inst)

    def routed(self) -> list[Instance]:
        return [*self.prefill, *self.decode, *self.colocated]

    def serving(self) -> list[Instance]:
        """The instances the serving path may touch: routed and retiring (staged ones are invisible to it
        until routed; a staged instance may hold its lock across a compile)."""
        return [*self.prefill, *self.decode, *self.colocated, *self.retiring]

    def all(self) -> list[Instance]:
        return [*self.prefill, *self.decode, *self.colocated, *self.staged, *self.retiring]

    def name_clash(self, names: Sequence[str]) -> list[str]:
        """The names of `names` an instance holds already."""
        return sorted(set(names) & set(self.placed_of))

    def stage(self, new: Sequence[Instance]) -> None:
        """Hold `new` staged: running, taking no traffic until `route` names them."""
        self.staged.extend(new)

    def discard_staged(self) -> list[Instance]:
        """Drop every staged instance (a switch that failed before routing to them); the caller stops them."""
        staged, self.staged = self.staged, []
        for inst in staged:
            self.placed_of.pop(inst.name, None)
        return staged

    def route(self, names: Sequence[str]) -> list[Instance]:
        """Make the routed instances exactly the live ones of `names` (routed or staged ones), in that order; the
        routed ones left out retire (returned), and so does a named instance that is dead (its worker already
        handed what it held on: it cannot serve, and a dead staged one is not routed either). Raises ValueError
        (nothing changed) for an unknown name, a mix that is neither prefill + decode nor colocated only, or
        one whose live part is not (a role whose named instances are all dead)."""
        routed = self.routed()
        pool: dict[str, Instance] = {i.name: i for i in [*routed, *self.staged]}
        missing = [n for n in names if n not in pool]
        if missing:
            raise ValueError(f"no routed or staged instance named {missing}")
        chosen = [pool[n] for n in names]
        if not _routable(chosen):
            raise ValueError("route either prefill and decode instances, or colocated ones only")
        dead = [i for i in chosen if i.error is not None]
        if dead:
            chosen = [i for i in chosen if i.error is None]
            if not _routable(chosen):
                raise ValueError(
                    f"{', '.join(i.name for i in dead)} died ({dead[0].error!r}): no live instance of "
                    f"{'its role' if len(dead) == 1 else 'their roles'} would be left to route"
                )
        kept = {i.name for i in chosen}
        retired = [i for i in routed if i.name not in kept]
        self.prefill[:] = [i for i in chosen if isinstance(i, PrefillInstance)]
        self.decode[:] = [i for i in chosen if isinstance(i, DecodeInstance)]
        self.colocated[:] = [i for i in chosen if isinstance(i, ColocatedInstance)]
        retired += [i for i in self.staged if i in dead]  # a dead staged instance: stopped and freed like the rest
        self.staged = [i for i in self.staged if i.name not in names]
        self.retiring.extend(retired)
        return retired

    def forget(self, inst: Instance) -> None:
        """A retiring instance is stopped and gone."""
        self.retiring.remove(inst)
        self.placed_of.pop(inst.name, None)


def _routable(instances: Sequence[Instance]) -> bool:
    """Prefill and decode instances, or colocated ones only."""
    prefills = any(isinstance(i, PrefillInstance) for i in instances)
    decodes = any(isinstance(i, DecodeInstance) for i in instances)
    colocated = any(isinstance(i, ColocatedInstance) for i in instances)
    return prefills == decodes and prefills != colocated
