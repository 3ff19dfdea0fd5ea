"""The operator routes' trust boundary, through real HTTP servers on this machine (fake engine).

`POST /admin/deployment` and `GET /debug/*` have their own credential: the inference API key never
grants them (403), without an admin key they are off (404) unless the server is a loopback-only one
with no API key, and a posted plan is parsed off the event loop, bounded by the server's devices,
with a 400 for every bad body. Empty keys refuse to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import TINY, fake_controller

from jaxserve.core.plan import parse_spec
from jaxserve.runtime.engines.fake import fake_engine_factory
from jaxserve.runtime.switch import PlanSwitcher
from jaxserve.serving.admin import AdminAccess, is_loopback
from jaxserve.serving.server import ServerConfig, ServerThread
from jaxserve.tools.replan_loop import ReplanLoop, ReplanLoopConfig

pytestmark = pytest.mark.timeout(120)

API_KEY, ADMIN_KEY = "inference-key", "admin-key"
OPERATOR_ROUTES = (("POST", "/admin/deployment"), ("GET", "/debug/workload"), ("GET", "/debug/steps"))


@contextlib.contextmanager
def admin_server(host: str = "127.0.0.1", **keys: str) -> Iterator[str]:
    """A fake-engine server with a switchable deployment (all 8 virtual devices); yields its URL on loopback."""
    controller = fake_controller()
    loop = ReplanLoop(
        controller, ReplanLoopConfig(mode="off"), switcher=PlanSwitcher(controller, fake_engine_factory(TINY))
    )
    config = ServerConfig(host=host, grpc_port=0, http_port=0, drain_timeout_s=5.0, **keys)  # type: ignore[arg-type]
    server = ServerThread(controller, config, admin=loop).start()
    try:
        yield f"http://127.0.0.1:{server.http_address.rsplit(':', 1)[1]}"
    finally:
        server.stop()


def _call(url: str, method: str, path: str, key: str | None, body: str = "colocated:tp1") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    if method == "POST":  # the operator routes take JSON only (a bare spec is still read under that type)
        headers["Content-Type"] = "application/json"
    content = body if method == "POST" else None
    return httpx.request(method, url + path, headers=headers, content=content, timeout=30)


def test_the_inference_key_never_grants_admin_and_without_an_admin_key_the_routes_are_off() -> None:
    with admin_server(api_key=API_KEY) as url:
        for method, path in OPERATOR_ROUTES:
            for key in (API_KEY, None, "guess"):
                r = _call(url, method, path, key)
                assert r.status_code == 404, (path, key, r.text)
                assert r.json()["error"]["code"] == "admin_off" and "--admin-key" in r.json()["error"]["message"]
        assert _call(url, "GET", "/v1/models", API_KEY).status_code == 200  # inference is unaffected


def test_the_admin_key_guards_the_operator_routes_and_grants_only_them() -> None:
    with admin_server(api_key=API_KEY, admin_key=ADMIN_KEY) as url:
        for method, path in OPERATOR_ROUTES:
            assert _call(url, method, path, None).status_code == 401
            assert _call(url, method, path, ADMIN_KEY + "x").status_code == 401
            r = _call(url, method, path, API_KEY)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
        assert _call(url, "GET", "/debug/workload", ADMIN_KEY).json()["plan"] == "disagg:prefill=tp1,decode=tp1"
        assert "instances" in _call(url, "GET", "/debug/steps", ADMIN_KEY).json()
        assert _call(url, "POST", "/admin/deployment", ADMIN_KEY, "colocated:tp1").status_code == 400  # parsed
        r = _call(url, "POST", "/admin/deployment", ADMIN_KEY, "disagg:prefill=2xtp1,decode=tp1")
        assert r.status_code == 200 and r.json()["added"] == ["prefill-1"], r.text
        assert _call(url, "GET", "/v1/models", ADMIN_KEY).status_code == 401  # admin is not inference


def test_beyond_loopback_the_routes_need_an_admin_key_even_with_no_keys_at_all() -> None:
    with admin_server(host="0.0.0.0") as url:
        for method, path in OPERATOR_ROUTES:
            assert _call(url, method, path, None).status_code == 404
        assert _call(url, "GET", "/v1/models", None).status_code == 200
    with admin_server(host="0.0.0.0", admin_key=ADMIN_KEY) as url:
        assert _call(url, "GET", "/debug/workload", None).status_code == 401
        assert _call(url, "GET", "/debug/workload", ADMIN_KEY).status_code == 200


def test_a_loopback_server_with_no_keys_keeps_them_open_and_bad_bodies_get_400(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(parse_spec("disagg:prefill=2xtp1,decode=tp1").to_json())
    nasty = [
        ("colocated:1000000000xtp1", "devices"),  # once: 10^9 objects built on the event loop
        ("disagg:prefill=9xtp1,decode=tp1", "at most 8 are available"),  # this server has 8 devices
        (str(plan_file), "names a plan file"),  # once: read from the server's disk and switched to
        (json.dumps({"deployment": str(plan_file)}), "names a plan file"),
        ("colocated:tp1,chunk=\u00b2", "chunk=N"),
        ('{"instances": [{"role": "prefill", "tp": "2"}, {"role": "decode"}]}', "tp must be an integer"),
        ('{"instances": 5}', "must be a list"),
        ('{"instances": ' + "[" * 50_000 + "]" * 50_000 + "}", "not a usable JSON document"),
        ('{"instances": [{"role": "decode", "tp": ' + "9" * 5000 + "}]}", "not a usable JSON document"),
    ]
    with admin_server() as url:
        for body, why in nasty:
            r = _call(url, "POST", "/admin/deployment", None, body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_plan", (body[:40], r.text)
            assert why in r.json()["error"]["message"], (body[:40], r.text)
        assert _call(url, "GET", "/debug/workload", None).json()["plan"] == "disagg:prefill=tp1,decode=tp1"
        assert httpx.get(url + "/health", timeout=10).status_code == 200


_SPEC = st.text(alphabet="colocatedisg:prefl=,+xtp0123456789\u00b2 .json", max_size=50)
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(10**40), 10**40), st.floats(), st.text(max_size=8))
_JSON = st.recursive(
    _LEAF,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["instances", "role", "tp", "pp", "devices", "kind", "deployment"]), inner)
    ),
    max_leaves=20,
)


def test_fuzzed_bodies_over_http_get_400_or_a_switch() -> None:
    """A little fuzzing through the real server: never a 500, and the server keeps answering."""
    with admin_server() as url:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=st.one_of(_SPEC, _SPEC.map(lambda s: json.dumps({"deployment": s})), _JSON.map(json.dumps)))
        def post(body: str) -> None:
            r = _call(url, "POST", "/admin/deployment", None, body)
            assert r.status_code in (200, 400), (body[:80], r.status_code, r.text)
            assert r.json() and (
                r.status_code == 200 or r.json()["error"]["message"].startswith(("bad plan", "cannot"))
            )

        post()
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_admin_access_rules() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "example.com"))
    assert AdminAccess().check(None) == "off"  # fails closed: no key and a host not known to be loopback
    assert AdminAccess(loopback_only=True).check(None) == "ok"
    assert AdminAccess(api_key=API_KEY, loopback_only=True).check(f"Bearer {API_KEY}") == "off"
    assert AdminAccess(loopback_only=False).check(None) == "off"
    both = AdminAccess(admin_key=ADMIN_KEY, api_key=API_KEY, loopback_only=False)
    assert both.check(f"Bearer {ADMIN_KEY}") == "ok" and both.check(f"Bearer {API_KEY}") == "forbidden"
    assert both.check(None) == "unauthenticated" and both.check(f"Basic {ADMIN_KEY}") == "unauthenticated"


@pytest.mark.parametrize(
    "keys, why",
    [
        ({"api_key": ""}, "API key is empty"),
        ({"api_key": "   "}, "API key is empty"),
        ({"admin_key": ""}, "admin key is empty"),
        ({"api_key": " k"}, "whitespace"),
        ({"api_key": "same", "admin_key": "same"}, "must differ"),
    ],
)
def test_empty_or_unusable_keys_refuse_to_start(keys: dict[str, str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ServerConfig(**keys)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "flags, env, why",
    [
        (["--api-key", ""], {}, "--api-key / JAXSERVE_API_KEY is empty"),
        ([], {"JAXSERVE_API_KEY": ""}, "--api-key / JAXSERVE_API_KEY is empty"),
        ([], {"JAXSERVE_ADMIN_KEY": ""}, "--admin-key / JAXSERVE_ADMIN_KEY is empty"),
        (["--api-key", "k"], {"JAXSERVE_ADMIN_KEY": "k"}, "must differ"),
    ],
)
def test_serve_refuses_an_empty_key_instead_of_serving_without_authentication(
    flags: list[str], env: dict[str, str], why: str
) -> None:
    base = {k: v for k, v in os.environ.items() if k not in ("JAXSERVE_API_KEY", "JAXSERVE_ADMIN_KEY")}
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--engine", "fake", "--model", "opt-tiny", "--grpc-port", "0",
           "--http-port", "0", "--no-warmup", "--compile-cache", "off", *flags]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**base, **env}, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert why in proc.stderr and "ready" not in proc.stdout


def test_the_servers_devices_bound_the_plan() -> None:
    """The replan loop bounds a posted plan by its switcher's devices (the embedded backend's)."""
    controller = fake_controller()
    try:
        loop = ReplanLoop(
            controller, ReplanLoopConfig(mode="off"), switcher=PlanSwitcher(controller, fake_engine_factory(TINY))
        )
        assert loop.max_plan_devices() == len(jax.devices()) == 8
    finally:
        controller.shutdown()
