"""What a web browser may do to this server: the HTTP server's defence against web pages and DNS rebinding.

A browser lets any page it shows send requests to any address, loopback included; it only stops the page
from *reading* the answer, unless the server allows it (CORS). Two attacks follow, and this ASGI
middleware (outermost, before any route or body is read) refuses both:

* **DNS rebinding**: a page on `evil.example` re-points its own name at 127.0.0.1 and then reads this
  server's answers as same-origin. Its requests carry `Host: evil.example`, so a request whose `Host` is
  not this server's own address, a loopback name (`localhost`, 127.0.0.0/8, `::1`) or a name
  `--allowed-hosts` lists (`*`: any) gets a 400 (`host_not_allowed`). A request without `Host` (HTTP/1.0
  tools) is let through: browsers always send one.
* **Cross-site requests**: a page may POST a "simple" request (`text/plain`, no preflight) anywhere. The
  operator routes (`/admin/*`, `/debug/*`) refuse every cross-origin request (403, `cross_origin`), whatever
  `--allowed-origins` says, and `POST /admin/deployment` takes `application/json` bodies only (a type no page
  can send cross-origin without a preflight, checked in `http_api`). A request that carries an `Origin` other
  than the server's own is refused everywhere else too (403), unless `--allowed-origins` lists it (`*`: any);
  then, and only then, the inference API answers it with CORS headers (starlette's `CORSMiddleware`, which
  this module puts behind the guard). Clients that are not browsers send no `Origin` and are unaffected.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.serving.admin import is_loopback

OPERATOR_PREFIXES = ("/admin/", "/debug/")
_WILDCARD_BINDS = ("0.0.0.0", "::", "")


def _host_name(host_header: str) -> str:
    """`Host` without its port, lower case, IPv6 brackets removed (`[::1]:8000` -> `::1`)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def check_names(names: Sequence[str], what: str) -> tuple[str, ...]:
    """`--allowed-hosts` / `--allowed-origins` entries, stripped; refuse an empty one (it would match nothing)."""
    out = tuple(n.strip() for n in names)
    if any(not n for n in out):
        raise ValueError(f"{what}: an empty entry; list host names or origins, or '*' for any")
    return out


@dataclasses.dataclass(frozen=True)
class BrowserPolicy:
    """The server's own address and what the operator allowed (`ServerConfig` builds it)."""

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # extra `Host` names ('*': any)
    allowed_origins: tuple[str, ...] = ()  # origins the inference API answers cross-origin, with CORS ('*': any)

    def host_ok(self, host_header: str, local_address: str | None) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = _host_name(host_header)
        if not name:
            return False
        if name in (_host_name(h) for h in self.allowed_hosts):  # an entry may carry a port: names compare
            return True
        if is_loopback(name):
            return True
        own = {_host_name(self.bind_host)} - set(_WILDCARD_BINDS)
        if local_address:  # the address this connection reached (on a 0.0.0.0 server: the interface's)
            own.add(_host_name(local_address))
        return name in own

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/") in (o.rstrip("/") for o in self.allowed_origins)


def same_origin(origin: str, host_header: str) -> bool:
    """The page that sent the request was served by this very host and port."""
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == host_header.strip().lower()


class BrowserGuard:
    """ASGI middleware enforcing `BrowserPolicy` (see the module docstring)."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy) -> None:
        self.policy = policy
        self.app: ASGIApp = app
        if policy.allowed_origins:
            self.app = CORSMiddleware(
                app,
                allow_origins=["*"] if "*" in policy.allowed_origins else list(policy.allowed_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        host = headers.get(b"host")
        server = scope.get("server")
        if host is not None and not self.policy.host_ok(host, server[0] if server else None):
            await _refuse(
                send, 400, f"the Host header {host!r} is not this server's; start it with --allowed-hosts to allow "
                "a name (refused: a DNS-rebinding page would send it)", "host_not_allowed",
            )  # fmt: skip
            return
        origin = headers.get(b"origin")
        operator = scope["path"].startswith(OPERATOR_PREFIXES)
        cross = origin is not None and not (host is not None and same_origin(origin, host))
        if operator and (cross or headers.get(b"sec-fetch-site") in ("cross-site", "same-site")):
            await _refuse(send, 403, "cross-origin requests to the operator routes are refused", "cross_origin")
            return
        if cross and origin is not None and not self.policy.origin_allowed(origin):
            await _refuse(
                send, 403, f"cross-origin request from {origin!r} refused: list the origin in --allowed-origins",
                "cross_origin",
            )  # fmt: skip
            return
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})
