"""An HTTP client that disconnects while its request is still queued gets it cancelled at once.

The fake prefill instance holds request A's prefill until the test opens its gate; request B,
sent by a raw socket that then closes, waits in the prefill queue. B must leave the server
(no longer live, no longer queued) while A is still being prefilled: B's prompt is never
prefilled (the engine's prefill calls are counted). Before, the handler waited for B's first
token without watching the connection, so B stayed until its own prefill had run. The order
is set by the gate, not by a clock (it was "within 0.5 s, before a 1.5 s prefill ends").
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from serving_helpers import PrefillGate, fake_controller, running_server

pytestmark = pytest.mark.timeout(120)


def _send_and_close(http_address: str, body: dict, after_s: float) -> None:
    host, port = http_address.rsplit(":", 1)
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        sock.sendall(head.encode() + payload)
        time.sleep(after_s)
    # closed here, before any byte of the answer


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_queued_cancels_the_request_at_once(stream):
    gate = PrefillGate()
    controller = fake_controller(first_device=4, prefill_gate=gate)
    try:
        with running_server(controller) as server:
            url = f"{server.http_url}/v1/completions"
            body_a = {"prompt": [4, 5, 6], "max_tokens": 2, "ignore_eos": True}
            result: dict = {}
            a = threading.Thread(target=lambda: result.setdefault("a", httpx.post(url, json=body_a, timeout=120)))
            a.start()
            _wait(lambda: gate.num_prefills == 1)  # A's prefill began and is held at the gate
            assert controller.stats().instances[0].num_running == 1
            body_b = {"prompt": [7, 8, 9], "max_tokens": 2, "ignore_eos": True, "stream": stream}
            _send_and_close(server.http_address, body_b, after_s=0.2)
            _wait(
                lambda: controller.stats().num_live_requests == 1 and controller.stats().instances[0].num_waiting == 0
            )
            # Gone while A's prefill is still held: B was never prefilled.
            assert controller.stats().instances[0].num_running == 1
            gate.opened.set()
            a.join(timeout=120)
            assert result["a"].status_code == 200
            assert controller.stats().num_live_requests == 0
            assert gate.num_prefills == 1  # A's prefill, none for B
    finally:
        gate.opened.set()  # never leave a prefill thread waiting


def _wait(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """A deadline for a hang only; the verdict is the state reached, not how soon."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"condition not reached within {timeout_s} s"
        time.sleep(0.01)
