"""A checkpoint's chat template that is broken, or fails on a request, never becomes a 500.

A template that does not parse stops the server's start (naming the template and the line); one that
fails while rendering a request (its own code on messages it did not expect) is that request's 400 /
INVALID_ARGUMENT with the message; and rendering (untrusted code that may run long) runs off the event
loop, so other clients are answered meanwhile. Real HTTP and gRPC servers on loopback, fake engine.
"""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from serving_helpers import fake_controller, running_server, tiny_tokenizer

from jaxserve.client import Client, InvalidArgumentError
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
        r = httpx.post(s.http_url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and why in error["message"] and "chat template" in error["message"]
        with Client(s.grpc_address, timeout_s=30) as c, pytest.raises(InvalidArgumentError) as e:
            c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details
        ok = httpx.post(s.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200  # the server goes on serving


def test_rendering_runs_off_the_event_loop() -> None:
    slow = "{% for i in range(100000) %}{% for j in range(900) %}{% endfor %}{% endfor %}" + ECHO  # ~3 s of Jinja quiet
    with running_server(_controller(slow)) as s:
        done: dict[str, float] = {}

        def chat() -> None:
            started = time.monotonic()
            r = httpx.post(s.http_url + "/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200, r.text
            done["chat_s"] = time.monotonic() - started

        t = threading.Thread(target=chat)
        t.start()
        time.sleep(0.2)
        waits = []
        while t.is_alive() and len(waits) < 50:
            started = time.monotonic()
            assert httpx.get(s.http_url + "/health", timeout=30).status_code == 200
            waits.append(time.monotonic() - started)
            time.sleep(0.05)
        t.join()
        assert done["chat_s"] > 1.0 and len(waits) >= 3  # it rendered long enough to be asked meanwhile
        assert max(waits) < done["chat_s"] / 2, (waits, done)  # on the loop, /health would wait for the render
