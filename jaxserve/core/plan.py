"""Deployment plans: which instances run, with what parallelism, on which devices.

The contract between the planner (`placement/`, which writes plans) and the
runtime (`jaxserve/`, which deploys them). Pure Python, no JAX: the planner
imports it. One spec syntax everywhere a deployment is named on a command line:

    SPEC  := colocated:INST[,chunk=N] | disagg:prefill=GROUP,decode=GROUP | FILE.json
    GROUP := [Kx]INST          K instances of the same shape (default 1)
    INST  := tpA[ppB]          tensor-parallel degree A, pipeline stages B (default 1)

Two doors, because specs and plans also arrive from the network (`POST /admin/deployment`):
`parse_spec` and `DeploymentPlan.from_dict`/`from_json` never touch the disk and refuse, with
a `PlanError` that says why, anything that is not a plan: a wrong type, a number that is not an
integer, a deployment of more devices than `max_devices` (default `MAX_PLAN_DEVICES`), checked
before anything is built per instance, so `1000000000xtp1` costs nothing. `parse_deployment`
is the command line's door: a spec, or a plan file the operator names.
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


MAX_PLAN_DEVICES = 4096  # the parsers' absolute cap on a deployment's devices (a sanity bound, not a cluster size)
_MAX_DIGITS = 7  # a count or degree longer than this is over any cap; int() never sees it
_MAX_CHUNK_SIZE = 10**9 - 1  # chunk=N in a spec: at most 9 digits

# The weight precisions an instance can be asked to serve at (`InstanceSpec.quantization`; `serve --quantization`):
# int8 per-channel weight-only, int4 group-wise weight-only, w8a8 (int8 weights, dynamic int8 activations), fp8
# (where the device has it). None: the checkpoint's own precision (a GGUF as stored, an HF checkpoint in its dtype).
# Each phase of a disaggregated plan may name its own (prefill w8a8, decode int4).
QUANTIZATIONS: tuple[str, ...] = ("int8", "int4", "w8a8", "fp8")


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
    quantization: str | None = None  # one of QUANTIZATIONS; None: the checkpoint's own precision

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
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise PlanError(f"unknown quantization {_shown(self.quantization)}; expected one of {QUANTIZATIONS}")

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
        if self.quantization is not None:
            out["quantization"] = self.quantization
        return out

    @classmethod
    def from_dict(cls, raw: object, max_devices: int = MAX_PLAN_DEVICES) -> InstanceSpec:
        """One `instances` entry of a plan file; a PlanError for anything else (see the module docstring)."""
        if not isinstance(raw, dict):
            raise PlanError(f"an instance entry is a JSON object, got {_shown(raw)}")
        unknown = set(raw) - {"role", "tp", "pp", "devices", "nodes", "chunk_size", "quantization"}
        if unknown:
            raise PlanError(f"unknown instance fields: {sorted(map(str, unknown))}")
        if "role" not in raw:
            raise PlanError("instance entry is missing field 'role'")
        if not isinstance(raw["role"], str) or raw["role"] not in ROLES:
            raise PlanError(f"unknown instance role {_shown(raw['role'])}; expected one of {ROLES}")
        tp = _int_field(raw.get("tp", 1), "tp", 1, max_devices)
        pp = _int_field(raw.get("pp", 1), "pp", 1, max_devices)
        if tp * pp > max_devices:
            raise PlanError(f"instance tp{tp}pp{pp} needs {tp * pp} devices; at most {max_devices} are available")
        return cls(
            role=raw["role"],
            tp=tp,
            pp=pp,
            devices=_int_list(raw.get("devices"), "devices", max_devices - 1, tp * pp),
            nodes=_int_list(raw.get("nodes"), "nodes", max_devices - 1, pp),
            chunk_size=_int_field(raw["chunk_size"], "chunk_size", 1, _MAX_CHUNK_SIZE)
            if raw.get("chunk_size") is not None
            else None,
            quantization=_quantization_field(raw.get("quantization")),
        )


def _shown(value: object, limit: int = 40) -> str:
    """A value for an error message, cut short (a hostile body can be a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _quantization_field(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in QUANTIZATIONS:
        raise PlanError(f"unknown quantization {_shown(value)}; expected one of {QUANTIZATIONS}")
    return value


def _int_field(value: object, name: str, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(f"{name} must be an integer, got {_shown(value)}")
    if value < low or (high is not None and value > high):
        raise PlanError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {_shown(value)}")
    return value


def _int_list(value: object, name: str, high: int, length: int) -> tuple[int, ...] | None:
    """`devices` / `nodes`: None, or a list of `length` integers in [0, high]."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise PlanError(f"{name} must be a list of integers, got {_shown(value)}")
    if len(value) != length:
        raise PlanError(f"{name} must list {length} entries, got {len(value)}")
    return tuple(_int_field(v, name, 0, high) for v in value)


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
    def from_dict(cls, raw: object, max_devices: int = MAX_PLAN_DEVICES) -> DeploymentPlan:
        """A plan file's object; a PlanError for anything that is not one, or a plan of over `max_devices`."""
        if not isinstance(raw, dict) or "instances" not in raw:
            raise PlanError("a plan is a JSON object with an 'instances' list")
        unknown = set(raw) - {"kind", "instances", "model", "expected", "limits"}
        if unknown:
            raise PlanError(f"unknown plan fields: {sorted(map(str, unknown))}")
        entries = raw["instances"]
        if not isinstance(entries, list):
            raise PlanError(f"'instances' must be a list, got {_shown(entries)}")
        if len(entries) > max_devices:  # every instance holds a device
            raise PlanError(f"the plan has {len(entries)} instances; at most {max_devices} devices are available")
        instances = []
        num_devices = 0
        for entry in entries:
            inst = InstanceSpec.from_dict(entry, max_devices)
            num_devices += inst.num_devices
            if num_devices > max_devices:
                raise PlanError(f"the plan needs over {max_devices} devices; at most {max_devices} are available")
            instances.append(inst)
        model = raw.get("model")
        if model is not None and not isinstance(model, str):
            raise PlanError(f"model must be a string, got {_shown(model)}")
        expected = raw.get("expected") or {}
        if not isinstance(expected, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in expected.values()
        ):
            raise PlanError(f"expected must map names to numbers, got {_shown(expected)}")
        try:
            predictions = {str(k): float(v) for k, v in expected.items()}
        except OverflowError:  # an integer of hundreds of digits
            raise PlanError("expected holds a number too large for a float") from None
        try:
            limits = ServingLimits.from_dict(raw["limits"]) if raw.get("limits") is not None else None
        except (TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"plan limits: {e}") from None
        plan = cls(
            instances=tuple(instances),
            model=model,
            expected=predictions,
            limits=limits,
        )
        if "kind" in raw and raw["kind"] != plan.kind:
            raise PlanError(f"plan says kind {_shown(raw['kind'])} but its instances make it {plan.kind!r}")
        return plan

    @classmethod
    def from_json(cls, text: str, max_devices: int = MAX_PLAN_DEVICES) -> DeploymentPlan:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file is not valid JSON: {e}") from None
        except (ValueError, RecursionError) as e:  # an integer of thousands of digits; nesting past the stack
            raise PlanError(f"plan file is not a usable JSON document: {type(e).__name__}") from None
        return cls.from_dict(raw, max_devices)


def _group(instances: tuple[InstanceSpec, ...]) -> str:
    shapes = [i.shape for i in instances]
    if len(set(shapes)) == 1:
        return f"{len(shapes)}x{shapes[0]}" if len(shapes) > 1 else shapes[0]
    return "+".join(shapes)


_GROUP_RE = re.compile(r"^(?:([0-9]+)x)?tp([0-9]+)(?:pp([0-9]+))?$")  # ASCII digits only: int() agrees


def _number(digits: str, what: str, max_devices: int) -> int:
    """A count or degree from a spec, checked before it is used (and before int() sees a huge string)."""
    if len(digits) > _MAX_DIGITS or int(digits) > max_devices:
        shown = digits if len(digits) <= _MAX_DIGITS else digits[:_MAX_DIGITS] + "..."
        raise PlanError(f"{what} {shown} needs more devices than there are; at most {max_devices} are available")
    value = int(digits)
    if value < 1:
        raise PlanError(f"{what} must be >= 1, got {value}")
    return value


class _DeviceBudget:
    """Devices a spec may still use: every group is charged before its instances are built."""

    def __init__(self, max_devices: int) -> None:
        self.max_devices = max_devices
        self.used = 0

    def charge(self, num_devices: int, part: str) -> None:
        self.used += num_devices
        if self.used > self.max_devices:
            raise PlanError(
                f"{_shown(part)} takes the deployment to {self.used} devices; at most {self.max_devices} are available"
            )


def _parse_group(text: str, role: Role, budget: _DeviceBudget, chunk: int | None = None) -> list[InstanceSpec]:
    out: list[InstanceSpec] = []
    for part in text.split("+"):
        m = _GROUP_RE.match(part)
        if not m:
            raise PlanError(f"bad {role} group {_shown(part)}: expected [Kx]tpA[ppB], e.g. 2xtp1 or tp2pp2")
        count = _number(m.group(1) or "1", "instance count", budget.max_devices)
        tp = _number(m.group(2), "tp", budget.max_devices)
        pp = _number(m.group(3) or "1", "pp", budget.max_devices)
        budget.charge(count * tp * pp, part)
        inst = InstanceSpec(role=role, tp=tp, pp=pp, chunk_size=chunk)
        out.extend([inst] * count)  # frozen: the same spec object K times
    return out


def parse_spec(spec: str, max_devices: int = MAX_PLAN_DEVICES) -> DeploymentPlan:
    """Parse a deployment spec string (never a file): a PlanError for a bad one or one of over `max_devices`."""
    spec = spec.strip()
    if spec.endswith(".json"):
        raise PlanError(
            f"{_shown(spec)} names a plan file; a spec string is expected here (send the plan's JSON itself)"
        )
    kind, sep, body = spec.partition(":")
    if not sep or not body:
        raise PlanError(
            f"bad deployment {_shown(spec)}: expected colocated:tp1[,chunk=N] or disagg:prefill=...,decode=..."
        )
    budget = _DeviceBudget(max_devices)
    if kind == "colocated":
        parts = body.split(",")
        chunk: int | None = None
        for extra in parts[1:]:
            key, eq, value = extra.partition("=")
            if key != "chunk" or not eq or not re.fullmatch(r"[0-9]{1,9}", value) or int(value) < 1:
                raise PlanError(f"bad colocated option {_shown(extra)}: the only option is chunk=N with N >= 1")
            chunk = int(value)
        return DeploymentPlan(instances=tuple(_parse_group(parts[0], "colocated", budget, chunk)))
    if kind == "disagg":
        fields: dict[str, str] = {}
        for part in body.split(","):
            key, eq, value = part.partition("=")
            if key not in ("prefill", "decode") or not eq or not value:
                raise PlanError(f"bad disagg field {_shown(part)}: expected prefill=GROUP and decode=GROUP")
            if key in fields:
                raise PlanError(f"disagg spec names {key} twice")
            fields[key] = value
        missing = {"prefill", "decode"} - set(fields)
        if missing:
            raise PlanError(f"disagg spec is missing {sorted(missing)}")
        prefill = _parse_group(fields["prefill"], "prefill", budget)
        decode = _parse_group(fields["decode"], "decode", budget)
        return DeploymentPlan(instances=tuple(prefill + decode))
    raise PlanError(f"bad deployment kind {_shown(kind)}: expected 'colocated' or 'disagg'")


def parse_deployment(spec: str) -> DeploymentPlan:
    """The command line's door: a spec string, or a plan file the operator names (a path ending in .json).

    Never for specs that arrive over the network: those go to `parse_spec`, which reads no file.
    """
    spec = spec.strip()
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise PlanError(f"plan file {spec!r} does not exist")
        return DeploymentPlan.from_json(path.read_text())
    return parse_spec(spec)
