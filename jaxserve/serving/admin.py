"""What the HTTP server needs from a replanning loop: workload gauges, `/debug/workload`, `/admin/deployment`.

A Protocol (the server never imports the planner): `jaxserve.tools.replan_loop.ReplanLoop` implements it.
`parse_plan_body` reads a `POST /admin/deployment` body.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Protocol

from jaxserve.core.plan import DeploymentPlan, PlanError, parse_deployment


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

    def apply_deployment(self, plan: DeploymentPlan) -> dict[str, object]:
        """Switch now (blocking); raises SwitchInProgressError, SwitchUnsupportedError, SwitchError, PlanError."""
        ...


def parse_plan_body(body: bytes) -> DeploymentPlan:
    """A `POST /admin/deployment` body: a plan file (JSON object), {"deployment": SPEC}, or a bare spec."""
    text = body.decode("utf-8", errors="replace").strip()
    if not text:
        raise PlanError("the body is empty: send a plan file (JSON) or a deployment spec")
    if text.startswith("{") or text.startswith('"'):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"the body is not valid JSON: {e}") from None
        if isinstance(raw, str):
            return parse_deployment(raw)
        if isinstance(raw, dict) and set(raw) == {"deployment"} and isinstance(raw["deployment"], str):
            return parse_deployment(raw["deployment"])
        return DeploymentPlan.from_json(text)
    return parse_deployment(text)
