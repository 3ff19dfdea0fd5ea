"""Deployment plans: which instances run, with what parallelism, on which devices.

The contract between the planner (`placement/`, which writes plans) and the
runtime (`jaxserve/`, which deploys them). Pure Python, no JAX: the planner
imports it. One spec syntax everywhere a deployment is named on a command line:

    SPEC  := colocated:INST[,chunk=N] | disagg:prefill=GROUP,decode=GROUP | FILE.json
    GROUP := [Kx]INST          K instances of the same shape (default 1)
    INST  := tpA[ppB]          tensor-parallel degree A, pipeline stages B (default 1)
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Literal

from jaxserve.core.limits import ServingLimits

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")


class PlanError(ValueError):
    """A deployment spec or plan file that cannot be used; the message says why."""


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """One serving instance: a role and a tp x pp device grid.

    `devices` are indices into the deployment's device list (stage-major: the
    first `tp` devices are stage 0). `nodes` gives the node of each pipeline
    stage when the planner placed the instance on a cluster.
    """

    role: Role
    tp: int = 1
    pp: int = 1
    devices: tuple[int, ...] | None = None
    nodes: tuple[int, ...] | None = None
    chunk_size: int | None = None  # colocated only: chunked prefill with piggybacked decodes

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PlanError(f"unknown instance role {self.role!r}; expected one of {ROLES}")
        if self.tp < 1 or self.pp < 1:
            raise PlanError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if self.devices is not None and len(self.devices) != self.num_devices:
            raise PlanError(
                f"{self.role} instance tp{self.tp}pp{self.pp} needs {self.num_devices} devices, "
                f"plan gives {len(self.devices)}"
            )
        if self.nodes is not None and len(self.nodes) != self.pp:
            raise PlanError(f"{self.role} instance has {self.pp} stages but {len(self.nodes)} node entries")
        if self.chunk_size is not None and (self.role != "colocated" or self.chunk_size < 1):
            raise PlanError("chunk_size is a positive integer and only for colocated instances")

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp

    @property
    def shape(self) -> str:
        return f"tp{self.tp}" + (f"pp{self.pp}" if self.pp > 1 else "")

    def stage_devices(self, stage: int) -> tuple[int, ...]:
        if self.devices is None:
            raise PlanError("instance has no device assignment yet; call DeploymentPlan.assign_devices")
        return self.devices[stage * self.tp : (stage + 1) * self.tp]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "tp": self.tp, "pp": self.pp}
        if self.devices is not None:
            out["devices"] = list(self.devices)
        if self.nodes is not None:
            out["nodes"] = list(self.nodes)
        if self.chunk_size is not None:
            out["chunk_size"] = self.chunk_size
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> InstanceSpec:
        unknown = set(raw) - {"role", "tp", "pp", "devices", "nodes", "chunk_size"}
        if unknown:
            raise PlanError(f"unknown instance fields: {sorted(unknown)}")
        try:
            return cls(
                role=raw["role"],
                tp=int(raw.get("tp", 1)),
                pp=int(raw.get("pp", 1)),
                devices=tuple(int(d) for d in raw["devices"]) if raw.get("devices") is not None else None,
                nodes=tuple(int(n) for n in raw["nodes"]) if raw.get("nodes") is not None else None,
                chunk_size=int(raw["chunk_size"]) if raw.get("chunk_size") is not None else None,
            )
        except KeyError as e:
            raise PlanError(f"instance entry is missing field {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True)
class DeploymentPlan:
    """A full deployment: colocated (one or more colocated instances) or disaggregated.

    `expected` carries the planner's predictions (goodput per device, rate, SLOs)
    so `jaxserve serve --plan` can log what the plan promised.
    """

    instances: tuple[InstanceSpec, ...]
    model: str | None = None
    expected: dict[str, float] = dataclasses.field(default_factory=dict)
    limits: ServingLimits | None = None  # what the planner assumed; `serve --plan` applies them

    def __post_init__(self) -> None:
        if not self.instances:
            raise PlanError("a deployment needs at least one instance")
        roles = {i.role for i in self.instances}
        if "colocated" in roles and roles != {"colocated"}:
            raise PlanError("a deployment is either colocated or disaggregated, not both")
        if "colocated" not in roles and roles != {"prefill", "decode"}:
            raise PlanError("a disaggregated deployment needs at least one prefill and one decode instance")
        assigned = [i.devices for i in self.instances if i.devices is not None]
        if assigned and len(assigned) != len(self.instances):
            raise PlanError("either every instance has a device assignment or none has")
        flat = [d for devs in assigned for d in devs]
        if len(flat) != len(set(flat)):
            raise PlanError("instances must own disjoint devices; the plan assigns a device twice")

    @property
    def kind(self) -> Literal["colocated", "disagg"]:
        return "colocated" if self.instances[0].role == "colocated" else "disagg"

    @property
    def num_devices(self) -> int:
        return sum(i.num_devices for i in self.instances)

    def of_role(self, role: Role) -> tuple[InstanceSpec, ...]:
        return tuple(i for i in self.instances if i.role == role)

    def assign_devices(self, num_available: int | None = None) -> DeploymentPlan:
        """Give instances without devices consecutive device indices, in plan order."""
        if self.instances[0].devices is not None:
            plan = self
        else:
            nxt = 0
            placed = []
            for inst in self.instances:
                placed.append(dataclasses.replace(inst, devices=tuple(range(nxt, nxt + inst.num_devices))))
                nxt += inst.num_devices
            plan = dataclasses.replace(self, instances=tuple(placed))
        if num_available is not None:
            highest = max(d for i in plan.instances for d in (i.devices or ()))
            if highest >= num_available:
                raise PlanError(
                    f"deployment {plan.describe()} needs {plan.num_devices} devices (highest index {highest}) "
                    f"but only {num_available} are available"
                )
        return plan

    def describe(self) -> str:
        """The spec string for this plan (device assignment left out)."""
        if self.kind == "colocated":
            inst = self.instances[0]
            groups = _group(self.instances)
            chunk = f",chunk={inst.chunk_size}" if inst.chunk_size else ""
            return f"colocated:{groups}{chunk}"
        return f"disagg:prefill={_group(self.of_role('prefill'))},decode={_group(self.of_role('decode'))}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "instances": [i.to_dict() for i in self.instances]}
        if self.model is not None:
            out["model"] = self.model
        if self.expected:
            out["expected"] = dict(self.expected)
        if self.limits is not None:
            out["limits"] = self.limits.to_dict()
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeploymentPlan:
        if not isinstance(raw, dict) or "instances" not in raw:
            raise PlanError("a plan is a JSON object with an 'instances' list")
        unknown = set(raw) - {"kind", "instances", "model", "expected", "limits"}
        if unknown:
            raise PlanError(f"unknown plan fields: {sorted(unknown)}")
        try:
            limits = ServingLimits.from_dict(raw["limits"]) if raw.get("limits") is not None else None
        except (TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"plan limits: {e}") from None
        plan = cls(
            instances=tuple(InstanceSpec.from_dict(i) for i in raw["instances"]),
            model=raw.get("model"),
            expected={str(k): float(v) for k, v in (raw.get("expected") or {}).items()},
            limits=limits,
        )
        if "kind" in raw and raw["kind"] != plan.kind:
            raise PlanError(f"plan says kind {raw['kind']!r} but its instances make it {plan.kind!r}")
        return plan

    @classmethod
    def from_json(cls, text: str) -> DeploymentPlan:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file is not valid JSON: {e}") from None
        return cls.from_dict(raw)


def _group(instances: tuple[InstanceSpec, ...]) -> str:
    shapes = [i.shape for i in instances]
    if len(set(shapes)) == 1:
        return f"{len(shapes)}x{shapes[0]}" if len(shapes) > 1 else shapes[0]
    return "+".join(shapes)


_INST_RE = re.compile(r"^tp(\d+)(?:pp(\d+))?$")
_GROUP_RE = re.compile(r"^(?:(\d+)x)?(tp\d+(?:pp\d+)?)$")


def _parse_inst(text: str, role: Role, chunk: int | None = None) -> InstanceSpec:
    m = _INST_RE.match(text)
    if not m:
        raise PlanError(f"bad instance shape {text!r}: expected tpA or tpApPB, e.g. tp2 or tp2pp2")
    return InstanceSpec(role=role, tp=int(m.group(1)), pp=int(m.group(2) or 1), chunk_size=chunk)


def _parse_group(text: str, role: Role, chunk: int | None = None) -> list[InstanceSpec]:
    out: list[InstanceSpec] = []
    for part in text.split("+"):
        m = _GROUP_RE.match(part)
        if not m:
            raise PlanError(f"bad {role} group {part!r}: expected [Kx]tpA[ppB], e.g. 2xtp1 or tp2pp2")
        count = int(m.group(1) or 1)
        if count < 1:
            raise PlanError(f"instance count must be >= 1 in {part!r}")
        out.extend(_parse_inst(m.group(2), role, chunk) for _ in range(count))
    return out


def parse_deployment(spec: str) -> DeploymentPlan:
    """Parse a deployment spec string or load a plan file (a path ending in .json)."""
    spec = spec.strip()
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise PlanError(f"plan file {spec!r} does not exist")
        return DeploymentPlan.from_json(path.read_text())
    kind, sep, body = spec.partition(":")
    if not sep or not body:
        raise PlanError(f"bad deployment {spec!r}: expected colocated:tp1[,chunk=N] or disagg:prefill=...,decode=...")
    if kind == "colocated":
        parts = body.split(",")
        chunk: int | None = None
        for extra in parts[1:]:
            key, eq, value = extra.partition("=")
            if key != "chunk" or not eq or not value.isdigit() or int(value) < 1:
                raise PlanError(f"bad colocated option {extra!r}: the only option is chunk=N with N >= 1")
            chunk = int(value)
        return DeploymentPlan(instances=tuple(_parse_group(parts[0], "colocated", chunk)))
    if kind == "disagg":
        fields: dict[str, str] = {}
        for part in body.split(","):
            key, eq, value = part.partition("=")
            if key not in ("prefill", "decode") or not eq or not value:
                raise PlanError(f"bad disagg field {part!r}: expected prefill=GROUP and decode=GROUP")
            if key in fields:
                raise PlanError(f"disagg spec names {key} twice")
            fields[key] = value
        missing = {"prefill", "decode"} - set(fields)
        if missing:
            raise PlanError(f"disagg spec is missing {sorted(missing)}")
        prefill = _parse_group(fields["prefill"], "prefill")
        decode = _parse_group(fields["decode"], "decode")
        return DeploymentPlan(instances=tuple(prefill + decode))
    raise PlanError(f"bad deployment kind {kind!r}: expected 'colocated' or 'disagg'")
