"""`POST /admin/deployment`, `GET /debug/workload` and the workload gauges on a real server (tiny OPT).

A real HTTP server on loopback serves the tiny random OPT (`disagg:prefill=tp1,decode=tp1`). The
admin route needs the admin key (the API key gets 403), answers 400 for bad plans (naming what is
wrong) and 409 while a switch runs; a good switch to `prefill=tp1,decode=tp2` happens while requests stream, and every
request completes with the greedy tokens of a run without the switch.
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from serving_helpers import metric_value

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.workload_monitor import MonitorConfig
from jaxserve.runtime.controller import Controller, ControllerConfig, RequestStream
from jaxserve.runtime.engines.model import model_engine_factory
from jaxserve.runtime.instances import build_engines
from jaxserve.runtime.switch import PlanSwitcher
from jaxserve.serving.server import ServerConfig, ServerThread
from jaxserve.tools.replan_loop import ReplanLoop, ReplanLoopConfig, plan_id

PLAN = "disagg:prefill=tp1,decode=tp1"
NEW = "disagg:prefill=tp1,decode=tp2"
KEY = "secret"
ADMIN_KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}  # admin bodies: JSON only


def _controller(factory) -> Controller:  # type: ignore[no-untyped-def]
    plan = parse_deployment(PLAN).assign_devices()
    c = Controller(
        build_engines(plan, factory), plan, ControllerConfig(limits=ServingLimits(block_size=8, num_kv_blocks=128))
    )
    c.start()
    return c


def _requests(n: int) -> list[GenerateRequest]:
    rng = np.random.default_rng(7)
    out = []
    for k in range(n):
        prompt = tuple(int(t) for t in rng.integers(3, 500, size=int(rng.integers(4, 40))))
        out.append(
            GenerateRequest(f"q{k}", prompt, SamplingParams(max_tokens=int(rng.integers(6, 20)), ignore_eos=True))
        )
    return out


@pytest.mark.slow  # ~40 s: a live switch under load; the default run stays well under 15 minutes
def test_admin_deployment_auth_bad_plans_conflict_and_a_switch_under_load() -> None:
    factory = model_engine_factory("opt-tiny")
    requests = _requests(30)
    reference = _controller(factory)  # the same requests without a switch
    try:
        expected = {r.request_id: reference.submit(r).collect(timeout_s=120)[0] for r in requests}
    finally:
        reference.shutdown()

    c = _controller(factory)
    switcher = PlanSwitcher(c, factory, drain_timeout_s=60)
    loop = ReplanLoop(
        c, ReplanLoopConfig(mode="off", monitor=MonitorConfig(window_s=120.0, slice_s=0.5)), switcher=switcher
    )
    loop.start()
    server = ServerThread(
        c, ServerConfig(grpc_port=0, http_port=0, api_key=KEY, admin_key=ADMIN_KEY, drain_timeout_s=5.0), admin=loop
    )
    server.start()
    url = server.http_url
    try:
        # auth first: without the admin key neither route says anything; the inference key is not it
        assert httpx.post(f"{url}/admin/deployment", content=NEW).status_code == 401
        assert httpx.get(f"{url}/debug/workload").status_code == 401
        inference = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{url}/admin/deployment", content=NEW, headers=inference).status_code == 403
        # bad plans: 400 with the reason, nothing changes
        for body, why in [
            ("", "empty"),
            ("disagg:prefill=tp3", "decode"),
            ('{"instances": []', "not valid JSON"),
            ('{"instances": [], "kind": "disagg"}', "at least one instance"),
            ("colocated:tp1", "cannot switch a disagg deployment to a colocated one"),
            ("disagg:prefill=9xtp1,decode=tp1", "at most 8 are available"),  # the process has 8 devices
        ]:
            r = httpx.post(f"{url}/admin/deployment", content=body, headers=AUTH, timeout=60)
            assert r.status_code == 400, (body, r.text)
            assert why in r.json()["error"]["message"], (body, r.text)
        assert c.plan.describe() == PLAN

        # a good switch while requests stream; a second switch meanwhile gets 409
        streams: list[RequestStream] = []

        def feed() -> None:
            for req in requests:
                streams.append(c.submit(req))
                time.sleep(0.05)

        feeder = threading.Thread(target=feed)
        feeder.start()
        time.sleep(0.3)
        answer: dict[str, httpx.Response] = {}
        poster = threading.Thread(
            target=lambda: answer.setdefault(
                "r", httpx.post(f"{url}/admin/deployment", json={"deployment": NEW}, headers=AUTH, timeout=300)
            )
        )
        poster.start()
        deadline = time.monotonic() + 60
        while not switcher.busy and poster.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        if switcher.busy:
            busy = httpx.post(f"{url}/admin/deployment", content=PLAN, headers=AUTH, timeout=60)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "switch_running"
        poster.join(timeout=300)
        feeder.join()
        r = answer["r"]
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["from_plan"] == PLAN and report["to_plan"] == NEW
        assert report["kept"] == ["prefill-0"] and report["added"] == ["decode-1"]
        assert [s["name"] for s in report["retired"]] == ["decode-0"]
        assert report["retired"][0]["num_kv_blocks_used"] == 0
        assert c.plan.describe() == NEW and report["plan_id"] == plan_id(c.plan)

        # no request lost; greedy tokens as without the switch
        for stream in streams:
            ids, last = stream.collect(timeout_s=120)
            assert last.finish_reason == "length"
            assert ids == expected[stream.request_id], stream.request_id

        # what the monitor saw, and the gauges
        time.sleep(1.1)  # let the slices holding the requests complete
        snap = httpx.get(f"{url}/debug/workload", headers=AUTH).json()
        assert snap["mode"] == "off" and snap["plan"] == NEW and snap["num_switches"] == 1
        assert {"monitor", "detector", "last_decision", "last_switch"} <= set(snap)
        assert snap["monitor"]["window"]["num_arrivals"] > 0
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "jaxserve:deployment_plan_info", {"plan": NEW, "plan_id": plan_id(c.plan)}) == 1
        assert metric_value(metrics, "jaxserve:workload_arrival_rate") > 0
        assert metric_value(metrics, "jaxserve:workload_mean_prompt_tokens") > 0
        assert metric_value(metrics, "jaxserve:replan_last_timestamp_seconds") > time.time() - 600
        assert metric_value(metrics, "jaxserve:latency_correction_factor", {"role": "decode"}) == 1.0  # no profile
    finally:
        server.stop()
        loop.stop()


def test_a_backend_without_a_switcher_refuses_live_switches() -> None:
    """A loop without a switcher (a library user's; `serve` always builds one) refuses auto; the admin route answers 501."""
    import pytest

    from jaxserve.runtime.engines.fake import fake_engine_factory
    from jaxserve.runtime.switch import SwitchUnsupportedError
    from models.config import get_config

    c = _controller(fake_engine_factory(get_config("opt-tiny")))
    try:
        with pytest.raises(SwitchUnsupportedError):
            ReplanLoop(c, ReplanLoopConfig(mode="auto"), switcher=None, context=object())  # type: ignore[arg-type]
        loop = ReplanLoop(c, ReplanLoopConfig(mode="off"), switcher=None)
        with ServerThread(c, ServerConfig(grpc_port=0, http_port=0), admin=loop) as server:
            r = httpx.post(
                f"{server.http_url}/admin/deployment",
                content=NEW,
                headers={"Content-Type": "application/json"},
                timeout=30,
            )
            assert r.status_code == 501 and "cannot switch" in r.json()["error"]["message"]
    finally:
        c.shutdown()


def test_serve_cli_wires_the_replan_loop_and_the_admin_route() -> None:
    """`jaxserve serve --engine fake --replan advise`: /debug/workload, a manual switch, the plan gauge."""
    import os
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # let serve size the virtual devices
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--engine", "fake", "--model", "opt-tiny", "--deployment", PLAN,
           "--grpc-port", "0", "--http-port", "0", "--no-warmup", "--compile-cache", "off", "--replan", "advise",
           "--window", "10", "--slice", "1", "--api-key", KEY, "--admin-key", ADMIN_KEY]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready "), proc.stderr.read() if proc.stderr else line
        http = "http://" + line.split("http=")[1].strip()
        snap = httpx.get(f"{http}/debug/workload", headers=AUTH, timeout=30).json()
        assert snap["mode"] == "advise" and snap["plan"] == PLAN and snap["detector"]["last_check"] is None
        r = httpx.post(f"{http}/admin/deployment", content="disagg:prefill=2xtp1,decode=tp1", headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["added"] == ["prefill-1"] and r.json()["retired"] == []
        metrics = httpx.get(f"{http}/metrics", timeout=30).text
        assert metric_value(metrics, "jaxserve:deployment_plan_info", {"plan": "disagg:prefill=2xtp1,decode=tp1"}) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
