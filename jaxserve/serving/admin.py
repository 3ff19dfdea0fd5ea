"""The operator surface: who may use it, and what the HTTP server needs from a replanning loop.

Operator routes are `POST /admin/deployment` (a live switch) and `GET /debug/*` (step records, the
workload monitor: deployment internals and other clients' request shapes). They have their own
credential, never the inference API key (`AdminAccess`): with an admin key they need
`Authorization: Bearer ADMIN_KEY` (401 without it, 403 for the inference key); without one they are
off (404), except on a server that listens on loopback only and has no API key either (a
development server: whoever can reach it is on this machine).

`DeploymentAdmin` is a Protocol (the server never imports the planner):
`jaxserve.tools.replan_loop.ReplanLoop` implements it. `parse_plan_body` reads a
`POST /admin/deployment` body: it reads no file and bounds the plan by the devices there are.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
from typing import Literal, Protocol

from jaxserve.core.plan import MAX_PLAN_DEVICES, DeploymentPlan, PlanError, parse_spec

ADMIN_KEY_ENV = "JAXSERVE_ADMIN_KEY"


def bearer_ok(header: str | bytes | None, api_key: str | None) -> bool:
    """True when no key is configured or `header` is `Bearer <key>` (constant-time comparison).

    An empty key matches nothing (`ServerConfig` refuses one; a library caller's must not open the door)."""
    if api_key is None:
        return True
    if header is None or not api_key:
        return False
    if isinstance(header, str):
        header = header.encode("utf-8", "surrogateescape")
    scheme, _, token = header.partition(b" ")
    # Compare even on a wrong scheme so timing does not reveal which part was wrong.
    same = hmac.compare_digest(token.strip(), api_key.encode())
    return same and scheme.lower() == b"bearer"


def check_key(key: str | None, what: str) -> None:
    """Refuse a key that cannot mean what the operator wants: empty (would switch authentication off or
    match an empty token), with whitespace at an edge (a Bearer token is stripped: it could never match), or
    with a non-ASCII or control character (no header carries it as such: it could never match either)."""
    if key is None:
        return
    if not key.strip():
        raise ValueError(f"{what} is empty: set a non-empty key, or leave it unset")
    if key != key.strip():
        raise ValueError(f"{what} starts or ends with whitespace, which a Bearer header cannot carry")
    if not (key.isascii() and key.isprintable()):
        # HTTP reads header bytes as Latin-1 and gRPC metadata is ASCII: such a key could never match.
        raise ValueError(f"{what} holds a non-ASCII or control character, which an Authorization header cannot carry")


def is_loopback(host: str) -> bool:
    """True when binding `host` listens on this machine only (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


@dataclasses.dataclass(frozen=True)
class AdminAccess:
    """Who may use the operator routes (see the module docstring)."""

    admin_key: str | None = None
    api_key: str | None = None  # the inference key: recognised only to answer 403 instead of 401
    loopback_only: bool = False  # the server binds loopback addresses only (default: assume not; fail closed)

    @property
    def enabled(self) -> bool:
        return self.admin_key is not None or (self.loopback_only and self.api_key is None)

    def check(self, authorization: str | bytes | None) -> Literal["ok", "off", "unauthenticated", "forbidden"]:
        """The verdict for one request's Authorization header (constant-time comparisons)."""
        if self.admin_key is None:
            return "ok" if self.enabled else "off"
        if bearer_ok(authorization, self.admin_key):
            return "ok"
        if self.api_key is not None and bearer_ok(authorization, self.api_key):
            return "forbidden"
        return "unauthenticated"

    @property
    def off_reason(self) -> str:
        if self.api_key is not None:
            return "operator routes are off: this server has an API key but no admin key (start it with --admin-key)"
        return "operator routes are off: this server listens beyond loopback without an admin key (--admin-key)"


@dataclasses.dataclass(frozen=True)
class WorkloadGauges:
    """The monitor's window, read at scrape time."""

    window_rate_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    correction_factors: dict[str, float]  # role -> Σ observed / Σ predicted step time (1.0: no data)
    last_replan_at: float | None  # unix time of the last replan round or switch
    plan_id: str
    plan: str


class DeploymentAdmin(Protocol):
    def gauges(self) -> WorkloadGauges: ...

    def workload_snapshot(self) -> dict[str, object]:
        """JSON: the monitor's windows, the detector's state, the last decision."""
        ...

    def switch_busy(self) -> bool: ...

    def max_plan_devices(self) -> int:
        """The most devices a plan posted to `/admin/deployment` may use (the devices the backend has)."""
        ...

    def apply_deployment(self, plan: DeploymentPlan) -> dict[str, object]:
        """Switch now (blocking); raises SwitchInProgressError, SwitchUnsupportedError, SwitchError, PlanError."""
        ...


def parse_plan_body(body: bytes, max_devices: int = MAX_PLAN_DEVICES) -> DeploymentPlan:
    """A `POST /admin/deployment` body: a plan (JSON object), {"deployment": SPEC}, a JSON string SPEC or a bare
    SPEC. Never reads a file; a PlanError (the server's 400) for anything else, or a plan of over `max_devices`."""
    max_devices = min(max_devices, MAX_PLAN_DEVICES)
    text = body.decode("utf-8", errors="replace").strip()
    if not text:
        raise PlanError("the body is empty: send a plan file (JSON) or a deployment spec")
    if text.startswith("{") or text.startswith('"'):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"the body is not valid JSON: {e}") from None
        except (ValueError, RecursionError) as e:  # an integer of thousands of digits; nesting past the stack
            raise PlanError(f"the body is not a usable JSON document: {type(e).__name__}") from None
        if isinstance(raw, str):
            return parse_spec(raw, max_devices)
        if isinstance(raw, dict) and set(raw) == {"deployment"}:
            if not isinstance(raw["deployment"], str):
                raise PlanError("'deployment' must be a spec string, e.g. disagg:prefill=tp1,decode=tp1")
            return parse_spec(raw["deployment"], max_devices)
        return DeploymentPlan.from_dict(raw, max_devices)
    return parse_spec(text, max_devices)
