"""What a web page may do to a server it can reach (real HTTP and gRPC servers on loopback, fake engine).

Browsers let any page send requests to loopback; DNS rebinding lets a page read the answers. A foreign
`Host` is refused on every route, the operator routes refuse cross-origin requests and non-JSON bodies, the
inference API answers cross-origin only for `--allowed-origins` (with CORS headers), and gRPC `GetDeployment`
follows the HTTP operator routes' credential rule. Keys no header can carry refuse to start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import httpx
import pytest
from serving_helpers import TINY, fake_controller

from jaxserve.client import Client, PermissionDeniedError, UnauthenticatedError
from jaxserve.runtime.engines.fake import fake_engine_factory
from jaxserve.runtime.switch import PlanSwitcher
from jaxserve.serving.browser_guard import BrowserPolicy
from jaxserve.serving.server import ServerConfig, ServerThread
from jaxserve.tools.replan_loop import ReplanLoop, ReplanLoopConfig

pytestmark = pytest.mark.timeout(120)

JSON = {"Content-Type": "application/json"}
EVIL = "http://evil.example"


@contextlib.contextmanager
def server(**config: object) -> Iterator[ServerThread]:
    """A loopback server with no keys (its operator routes are open to this machine) and a switchable plan."""
    controller = fake_controller()
    loop = ReplanLoop(
        controller, ReplanLoopConfig(mode="off"), switcher=PlanSwitcher(controller, fake_engine_factory(TINY))
    )
    cfg = ServerConfig(grpc_port=0, http_port=0, drain_timeout_s=5.0, **config)  # type: ignore[arg-type]
    s = ServerThread(controller, cfg, admin=loop).start()
    try:
        yield s
    finally:
        s.stop()


def _plan(url: str) -> str:
    return str(httpx.get(url + "/debug/workload", timeout=30).json()["plan"])


def test_a_web_page_cannot_switch_the_deployment_or_read_through_dns_rebinding() -> None:
    with server() as s:
        url = s.http_url
        before = _plan(url)
        # A page's form / fetch in no-cors mode: text/plain, no preflight (today: 200, plan changed).
        r = httpx.post(url + "/admin/deployment", content="disagg:prefill=2xtp1,decode=tp1",
                       headers={"Content-Type": "text/plain", "Origin": EVIL}, timeout=30)  # fmt: skip
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin", r.text
        r = httpx.post(url + "/admin/deployment", content="disagg:prefill=2xtp1,decode=tp1",
                       headers={"Content-Type": "text/plain"}, timeout=30)  # fmt: skip
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/admin/deployment", json="disagg:prefill=2xtp1,decode=tp1",
                       headers={"Origin": EVIL}, timeout=30)  # fmt: skip
        assert r.status_code == 403, r.text
        r = httpx.get(url + "/debug/steps", headers={"Sec-Fetch-Site": "cross-site"}, timeout=30)
        assert r.status_code == 403, r.text
        assert _plan(url) == before  # nothing changed
        # DNS rebinding: the page's own name now points here; its requests carry Host: evil.example.
        for method, path in (("GET", "/v1/models"), ("GET", "/debug/workload"), ("GET", "/health")):
            r = httpx.request(method, url + path, headers={"Host": "evil.example"}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", (path, r.text)
        r = httpx.post(url + "/admin/deployment", json="disagg:prefill=2xtp1,decode=tp1",
                       headers={"Host": "evil.example:8000"}, timeout=30)  # fmt: skip
        assert r.status_code == 400 and _plan(url) == before
        # The operator's own calls: JSON, same origin, loopback names.
        for host in ("localhost", f"localhost:{url.rsplit(':', 1)[1]}", "127.0.0.1"):
            assert httpx.get(url + "/v1/models", headers={"Host": host}, timeout=30).status_code == 200, host
        same = {"Origin": url, **JSON}
        r = httpx.post(url + "/admin/deployment", json="disagg:prefill=2xtp1,decode=tp1", headers=same, timeout=60)
        assert r.status_code == 200, r.text
        assert _plan(url) == "disagg:prefill=2xtp1,decode=tp1"


def test_cors_is_off_unless_origins_are_listed_and_never_for_the_operator_routes() -> None:
    app = "https://app.example"
    body = {"prompt": [5, 6], "max_tokens": 2}
    with server() as s:
        r = httpx.post(s.http_url + "/v1/completions", json=body, headers={"Origin": app}, timeout=30)
        assert r.status_code == 403 and "--allowed-origins" in r.json()["error"]["message"], r.text
        assert "access-control-allow-origin" not in r.headers
        assert httpx.post(s.http_url + "/v1/completions", json=body, timeout=30).status_code == 200  # no Origin
    with server(allowed_origins=(app,), allowed_hosts=("api.example",)) as s:
        r = httpx.post(s.http_url + "/v1/completions", json=body, headers={"Origin": app}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app, r.text
        pre = httpx.options(s.http_url + "/v1/completions", timeout=30, headers={
            "Origin": app, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == app
        assert httpx.post(s.http_url + "/v1/completions", json=body, headers={"Origin": EVIL}).status_code == 403
        r = httpx.get(s.http_url + "/debug/workload", headers={"Origin": app}, timeout=30)  # listed, still refused
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        r = httpx.get(s.http_url + "/v1/models", headers={"Host": "API.example:443"}, timeout=30)
        assert r.status_code == 200, r.text  # a name --allowed-hosts lists (a proxy's public name)


def test_host_rules() -> None:
    p = BrowserPolicy("127.0.0.1")
    assert all(p.host_ok(h, "127.0.0.1") for h in ("localhost:8000", "127.0.0.1", "[::1]:80", "127.9.9.9:1"))
    assert not any(p.host_ok(h, "127.0.0.1") for h in ("evil.example", "localhost.evil.example", "", "10.0.0.1"))
    wild = BrowserPolicy("0.0.0.0")
    assert wild.host_ok("10.1.2.3:8000", "10.1.2.3") and not wild.host_ok("evil.example", "10.1.2.3")
    assert BrowserPolicy("0.0.0.0", allowed_hosts=("*",)).host_ok("anything.example", None)
    proxied = BrowserPolicy("127.0.0.1", allowed_hosts=("API.example.com:443", "[2001:db8::1]"))
    assert proxied.host_ok("api.example.com", None) and proxied.host_ok("[2001:db8::1]:8000", None)
    with pytest.raises(ValueError, match="empty entry"):
        ServerConfig(allowed_hosts=(" ",))


def test_grpc_get_deployment_takes_the_admin_credential_as_http_does() -> None:
    with server(api_key="inference", admin_key="admin") as s:
        with Client(s.grpc_address, api_key="inference", timeout_s=10) as c:
            with pytest.raises(PermissionDeniedError) as e:
                c.deployment()  # today: answered to the inference key
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert c.model_info().vocab_size == TINY.vocab_size  # inference calls are unaffected
        with Client(s.grpc_address, timeout_s=10) as c, pytest.raises(UnauthenticatedError):
            c.deployment()
        with Client(s.grpc_address, api_key="admin", timeout_s=10) as c:
            assert c.deployment().describe() == "disagg:prefill=tp1,decode=tp1"
        assert (
            httpx.get(s.http_url + "/debug/workload", headers={"Authorization": "Bearer inference"}).status_code == 403
        )
    with (
        server(api_key="inference") as s,
        Client(s.grpc_address, api_key="inference", timeout_s=10) as c,
        pytest.raises(PermissionDeniedError, match="--admin-key"),
    ):
        c.deployment()  # no admin key: off, as the HTTP operator routes are


@pytest.mark.parametrize("key", ["clé", "k\u00a0ey", "tab\tkey"])
def test_a_key_no_header_can_carry_refuses_to_start(key: str) -> None:
    with pytest.raises(ValueError, match="non-ASCII or control"):
        ServerConfig(api_key=key)
    with pytest.raises(ValueError, match="non-ASCII or control"):
        ServerConfig(admin_key=key)
