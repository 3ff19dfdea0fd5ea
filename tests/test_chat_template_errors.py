"""A checkpoint's chat template that is broken, or fails on a request, never becomes a 500.

A template that does not parse stops the server's start (naming the template and the line); one that
fails while rendering a request (its own code on messages it did not expect) is that request's 400 /
INVALID_ARGUMENT with the message; and rendering (untrusted code that may run long) runs off the event
loop, so other clients are answered meanwhile. Real HTTP and gRPC servers on loopback, fake engine.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import httpx
import pytest
from serving_helpers import fake_controller, running_server, tiny_tokenizer

from jaxserve.client import Client, InvalidArgumentError
from jaxserve.serving import chat_template
from jaxserve.serving.server import JaxServeServer, ServerConfig
from models.checkpoint import CheckpointChatTemplate

pytestmark = pytest.mark.timeout(120)

ECHO = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _controller(template: str):  # type: ignore[no-untyped-def]
    controller = fake_controller(tokenizer=tiny_tokenizer())
    controller.chat_template = CheckpointChatTemplate(template, "</s>", "</s>")
    return controller


def test_a_template_that_does_not_parse_stops_the_start_naming_it() -> None:
    controller = _controller("{% for m in messages %}{{ m['content'] }}\n{% if %}")
    try:
        with pytest.raises(ValueError, match=r"chat template does not parse \(line 2\).*tokenizer.chat_template"):
            JaxServeServer(controller, ServerConfig(grpc_port=0, http_port=0))
    finally:
        controller.shutdown(drain_timeout_s=0)


@pytest.mark.parametrize(
    "template, why",
    [
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),  # str + int
        ("{{ (1 / (messages | length - 1)) }}" + ECHO, "ZeroDivisionError"),
        ("{{ messages[0]['content'].index('zz') }}", "substring not found"),  # ValueError
    ],
)
def test_a_template_failing_on_a_request_is_that_requests_400(template: str, why: str) -> None:
    with running_server(_controller(template)) as s:
        r = httpx.post(
            s.http_url + "/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and why in error["message"] and "chat template" in error["message"]
        with Client(s.grpc_address, timeout_s=30) as c, pytest.raises(InvalidArgumentError) as e:
            c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details
        ok = httpx.post(s.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200  # the server goes on serving


def test_rendering_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real template renders, held at its start until /health has answered: on the event loop, /health
    could not answer (its timeout fails the test); and the render's thread runs no event loop."""
    real_compile = chat_template._compile
    rendering, release = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    class Held:  # the compiled template, its render held until the test releases it
        def __init__(self, compiled: Any) -> None:
            self._compiled = compiled

        def render(self, **context: Any) -> str:
            try:
                asyncio.get_running_loop()
                seen["on_a_loop"] = True
            except RuntimeError:
                seen["on_a_loop"] = False
            rendering.set()
            assert release.wait(60)
            return str(self._compiled.render(**context))

    monkeypatch.setattr(chat_template, "_compile", lambda source: Held(real_compile(source)))
    with running_server(_controller(ECHO)) as s:
        replies: list[httpx.Response] = []

        def chat() -> None:
            replies.append(
                httpx.post(
                    s.http_url + "/v1/chat/completions",
                    timeout=60,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                )
            )

        t = threading.Thread(target=chat)
        t.start()
        try:
            assert rendering.wait(30)
            assert httpx.get(s.http_url + "/health", timeout=10).status_code == 200  # while the render is held
        finally:
            release.set()
            t.join()
        assert replies[0].status_code == 200, replies[0].text
        assert seen == {"on_a_loop": False}
