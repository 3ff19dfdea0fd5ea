"""After a live switch every view of the deployment is the new one (issue 27).

A real server on loopback (fake engine, `disagg:prefill=tp1,decode=tp1`) is switched to
`disagg:prefill=2xtp1,decode=tp1` through `POST /admin/deployment`; then gRPC `GetDeployment`
(through `Client.deployment()`), the `/metrics` instance labels and `/debug/steps` and `/debug/workload`
all name the new plan and its three instances, never the start-up plan.
"""

from __future__ import annotations

import re

import httpx

from jaxserve.client import Client
from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.fake import fake_engine_factory
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.switch import PlanSwitcher
from jaxserve.serving.server import ServerConfig, ServerThread
from jaxserve.tools.replan_loop import ReplanLoop, ReplanLoopConfig
from models.config import get_config

OLD = "disagg:prefill=tp1,decode=tp1"
NEW = "disagg:prefill=2xtp1,decode=tp1"
ADMIN_KEY = "admin-secret"
AUTH_MD = (("authorization", f"Bearer {ADMIN_KEY}"),)  # gRPC GetDeployment: the admin key
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}


def _instance_labels(metrics: str) -> set[tuple[str, str]]:
    """(instance, role) of every `jaxserve:instance_alive` sample."""
    found = set()
    for line in metrics.splitlines():
        m = re.match(r"^jaxserve:instance_alive\{([^}]*)\}", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            found.add((labels["instance"], labels["role"]))
    return found


def test_every_view_reports_the_plan_a_live_switch_made() -> None:
    factory = fake_engine_factory(get_config("opt-tiny"))
    plan = parse_deployment(OLD).assign_devices()
    c = Controller(
        build_engines(plan, factory), plan, ControllerConfig(limits=ServingLimits(block_size=8, num_kv_blocks=64))
    )
    c.start()
    loop = ReplanLoop(c, ReplanLoopConfig(mode="off"), switcher=PlanSwitcher(c, factory, drain_timeout_s=30))
    loop.start()
    config = ServerConfig(grpc_port=0, http_port=0, admin_key=ADMIN_KEY, warmup=False, drain_timeout_s=5.0)
    try:
        with ServerThread(c, config, admin=loop) as server, Client(server.grpc_address, api_key=ADMIN_KEY) as client:
            url = server.http_url
            before = client.deployment(timeout_s=30)
            assert before.describe() == OLD
            assert _instance_labels(httpx.get(f"{url}/metrics", timeout=30).text) == {
                ("prefill-0", "prefill"),
                ("decode-0", "decode"),
            }

            r = httpx.post(f"{url}/admin/deployment", content=NEW, headers=AUTH, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["added"] == ["prefill-1"] and r.json()["retired"] == []

            after = client.deployment(timeout_s=30)
            assert after.describe() == NEW
            assert [(i.role, i.devices) for i in after.instances] == [
                ("prefill", (0,)),
                ("prefill", (2,)),
                ("decode", (1,)),
            ]
            assert after == c.plan.assign_devices()
            # the names come only on the wire (a DeploymentPlan has none)
            wire_names = [
                i.name
                for i in client._stub.GetDeployment(pb.GetDeploymentRequest(), timeout=30, metadata=AUTH_MD).instances
            ]
            assert wire_names == ["prefill-0", "prefill-1", "decode-0"]

            expected = {("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")}
            assert _instance_labels(httpx.get(f"{url}/metrics", timeout=30).text) == expected
            steps = httpx.get(f"{url}/debug/steps", headers=AUTH, timeout=30).json()
            assert {(i["name"], i["role"]) for i in steps["instances"]} == expected
            workload = httpx.get(f"{url}/debug/workload", headers=AUTH, timeout=30).json()
            assert workload["plan"] == NEW and workload["num_switches"] == 1
    finally:
        loop.stop()
        c.shutdown()
