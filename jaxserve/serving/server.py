"""One process serving a deployment: the controller, the gRPC server and the HTTP server.

Both servers run on one asyncio event loop and share one `Frontend` (request path,
metrics); the controller's instances run on their own threads. The life of a server:

* `start()`: start the controller's instances, let it warm up (`controller.warmup()`:
  compile every shape before the first client arrives; the time to ready is logged), bind gRPC (insecure, or TLS when a
  certificate is given) and HTTP (uvicorn, same TLS files), mark health SERVING, and
  return once both accept connections (`grpc_address`, `http_address` then hold the
  bound `HOST:PORT`; port 0 picks a free port).
* `stop()`: mark health NOT_SERVING, shut the controller down (new requests get
  UNAVAILABLE / 503 while in-flight ones drain for `drain_timeout_s`, then are ended
  with finish reason "abort"), then close both servers.

`run_until_signal` is the foreground form (`jaxserve serve`): it installs SIGINT and
SIGTERM handlers on the main thread and stops cleanly on either (a second signal
during the drain exits at once; a signal during start-up, while the warm-up compiles,
exits at once too: nothing has been served). Before it runs, `serve` holds both signals
with `start_up_signals.StartUpSignals` (loading, building: exit at once as well), which
`run_until_signal` takes over from once its own handlers are in place; after the stop, a
further signal leaves at once too (the exit may still wait for a background compile in
progress, `runtime/compilation/background.py`). `ServerThread` runs the same server on a background
thread (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import uvicorn

from jaxserve.runtime.api import ServingController
from jaxserve.serving.admin import AdminAccess, DeploymentAdmin, check_key, is_loopback
from jaxserve.serving.browser_guard import BrowserPolicy, check_names
from jaxserve.serving.frontend import Frontend
from jaxserve.serving.grpc_service import build_grpc_server, set_serving
from jaxserve.serving.http_api import create_app
from jaxserve.serving.metrics import ServingMetrics, WorkloadCollector
from jaxserve.serving.start_up_signals import SIGNALS, StartUpSignals

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # 0: any free port
    http_port: int = 8000  # 0: any free port
    api_key: str | None = None  # None: no authentication
    admin_key: str | None = None  # /admin/*, /debug/*; None: off, unless on loopback with no api_key either
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, gRPC and HTTP use TLS
    tls_key: Path | None = None
    max_request_bytes: int = 1 << 20  # HTTP body and gRPC message limit
    drain_timeout_s: float = 30.0
    model_name: str | None = None  # the name clients see; default: the model config's name
    warmup: bool = False  # controller.warmup() before accepting traffic (compiles every shape)
    allowed_hosts: tuple[str, ...] = ()  # HTTP Host names served besides our own address and loopback ('*': any)
    allowed_origins: tuple[str, ...] = ()  # origins the inference API answers cross-origin, with CORS ('*': any)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key")
        check_key(self.api_key, "the API key")
        check_key(self.admin_key, "the admin key")
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError("the admin key must differ from the API key: an inference key never grants admin")
        object.__setattr__(self, "allowed_hosts", check_names(self.allowed_hosts, "--allowed-hosts"))
        object.__setattr__(self, "allowed_origins", check_names(self.allowed_origins, "--allowed-origins"))

    @property
    def browser_policy(self) -> BrowserPolicy:
        return BrowserPolicy(self.host, self.allowed_hosts, self.allowed_origins)

    @property
    def admin_access(self) -> AdminAccess:
        return AdminAccess(admin_key=self.admin_key, api_key=self.api_key, loopback_only=is_loopback(self.host))


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's owner decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class JaxServeServer:
    def __init__(
        self, controller: ServingController, config: ServerConfig | None = None, admin: DeploymentAdmin | None = None
    ) -> None:
        self.controller = controller
        self.config = config or ServerConfig()
        self.frontend = Frontend(controller, model_name=self.config.model_name, api_key=self.config.api_key)
        self.metrics: ServingMetrics = self.frontend.metrics
        self.admin = admin  # the replanning loop: workload gauges, /debug/workload, /admin/deployment
        if admin is not None:
            self.metrics.registry.register(WorkloadCollector(admin.gauges))
        self.grpc_address = ""
        self.http_address = ""
        self._serving = False
        self._grpc: grpc.aio.Server | None = None
        self._health: Any = None
        self._http: _UvicornServer | None = None
        self._http_task: asyncio.Task[None] | None = None

    @property
    def instance_names(self) -> tuple[str, ...]:
        return self.controller.instance_names

    async def start(self) -> None:
        cfg = self.config
        started_at = time.monotonic()
        self.controller.start()
        warmup_s = 0.0
        if cfg.warmup:
            log.info("warming up: compiling before the first client (a signal now stops without serving)")
            warmup = partial(self.controller.warmup, start_background=False)  # started once serving, below
            warmup_s = await asyncio.get_running_loop().run_in_executor(None, warmup)
        self._grpc, self._health = build_grpc_server(
            self.frontend,
            api_key=cfg.api_key,
            max_message_bytes=cfg.max_request_bytes,
            admin_access=cfg.admin_access,
        )
        target = format_address(cfg.host, cfg.grpc_port)
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            creds = grpc.ssl_server_credentials([(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())])
            grpc_port = self._grpc.add_secure_port(target, creds)
        else:
            grpc_port = self._grpc.add_insecure_port(target)
        if not grpc_port:
            raise OSError(f"cannot bind gRPC to {target}")
        await self._grpc.start()
        self.grpc_address = format_address(cfg.host, grpc_port)

        sock = _bind(cfg.host, cfg.http_port)
        self.http_address = format_address(cfg.host, sock.getsockname()[1])
        app = create_app(
            self.frontend,
            api_key=cfg.api_key,
            max_request_bytes=cfg.max_request_bytes,
            is_serving=lambda: self._serving,
            admin=self.admin,
            admin_access=cfg.admin_access,
            browser=cfg.browser_policy,
        )
        uv_config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=str(cfg.tls_cert) if cfg.tls_cert else None,
            ssl_keyfile=str(cfg.tls_key) if cfg.tls_key else None,
            timeout_graceful_shutdown=5,
        )
        self._http = _UvicornServer(uv_config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()  # raises the start-up error
                raise OSError(f"HTTP server on {self.http_address} stopped during start-up")
            await asyncio.sleep(0.01)
        self._serving = True
        await set_serving(self._health, True)
        log.info("ready in %.2f s (warm-up %.2f s)", time.monotonic() - started_at, warmup_s)
        if cfg.warmup:
            self.controller.start_background_compiles()
        access = cfg.admin_access
        log.info(
            "operator routes (/admin/*, /debug/*): %s",
            "admin key" if access.admin_key else ("open (loopback, no keys)" if access.enabled else "off"),
        )

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain and stop: health NOT_SERVING, controller shutdown (drains), then both servers."""
        drain = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self._serving = False
        if self._health is not None:
            await set_serving(self._health, False)
        await asyncio.get_running_loop().run_in_executor(None, self.controller.shutdown, drain)
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._http_task


def _bind(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, address = infos[0]
    sock = socket.socket(family, socktype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_until_signal(
    controller: ServingController,
    config: ServerConfig,
    on_ready: Callable[[JaxServeServer], None] | None = None,
    admin: DeploymentAdmin | None = None,
    start_up: StartUpSignals | None = None,
) -> None:
    """Serve in the foreground until SIGINT or SIGTERM, then drain and stop (main thread only).

    `start_up`: the guard that held both signals until now (`serve`), handed over once this loop's are in place.
    Once stopped, a further signal leaves the process at once (status 1), whatever its exit still waits for."""

    async def main() -> None:
        server = JaxServeServer(controller, config, admin)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        if start_up is not None:
            start_up.hand_over()
        try:
            # A signal during start-up (the warm-up compiles for minutes on a big model) is obeyed at once:
            # no client has been served, so there is nothing to drain, and the compiling thread cannot be
            # interrupted, only left behind.
            starting = asyncio.ensure_future(server.start())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                _exit_during_start_up(controller, timeout_s=2.0)
            stopping.cancel()
            starting.result()  # a start-up error propagates
            if on_ready is not None:
                on_ready(server)
            await stop.wait()
            log.info(
                "stopping: draining in-flight requests (up to %.0f s; signal again to quit now)",
                config.drain_timeout_s,
            )
            for sig in SIGNALS:
                loop.add_signal_handler(sig, _force_exit)
        finally:
            await server.stop()  # the loop's handlers stay until `asyncio.run` closes it: no default meanwhile

    asyncio.run(main())
    for sig in SIGNALS:  # stopped: what is left is the process's exit (it may wait for a compile in progress)
        signal.signal(sig, _exit_now)


def _exit_during_start_up(controller: ServingController, timeout_s: float) -> None:
    """Stop a server that is still starting (warming up): cancel the warm-up's own requests and stop the
    instances (in a daemon thread, for `timeout_s` at most), then leave the process with status 0, as a stop
    does. A warm-up compile in progress holds its instance's lock until it ends (seconds; minutes for a big
    model), and it need not be waited for: `os._exit` does not finalize the interpreter, so a thread left
    inside XLA is no hazard (an exit that finalized would have to join it, `runtime/compilation/background.py`)."""
    log.warning("signal during start-up (warm-up): stopping without serving; no request was accepted")
    done = threading.Event()

    def shutdown() -> None:
        try:
            controller.shutdown(drain_timeout_s=0.0)  # in flight: the warm-up's requests only
        finally:
            done.set()

    threading.Thread(target=shutdown, name="jaxserve-stop", daemon=True).start()
    if not done.wait(timeout_s):
        log.info("the instances still compile after %.0f s; exiting without waiting for them", timeout_s)
    log.info("stopped")
    logging.shutdown()
    os._exit(0)


def _force_exit() -> None:
    log.warning("second signal: exiting without waiting for in-flight requests")
    os._exit(1)


def _exit_now(signum: int, frame: FrameType | None) -> None:
    log.warning("signal after the stop: exiting at once (not waiting for a background compile in progress)")
    logging.shutdown()
    os._exit(1)


class ServerThread:
    """A `JaxServeServer` on its own event loop in a background thread.

    `with ServerThread(controller, config) as server:` starts it (returns when both
    servers accept requests) and stops it (drain, shutdown) on exit.
    """

    def __init__(
        self, controller: ServingController, config: ServerConfig | None = None, admin: DeploymentAdmin | None = None
    ) -> None:
        self.server = JaxServeServer(controller, config, admin)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxserve-server", daemon=True)

    @property
    def grpc_address(self) -> str:
        return self.server.grpc_address

    @property
    def http_address(self) -> str:
        return self.server.http_address

    @property
    def http_url(self) -> str:
        scheme = "https" if self.server.config.tls_cert else "http"
        return f"{scheme}://{self.server.http_address}"

    def start(self) -> ServerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=60)
        return self

    def stop(self, drain_timeout_s: float | None = None) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(drain_timeout_s), self._loop).result(timeout=120)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
