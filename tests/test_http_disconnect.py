"""An HTTP client that disconnects while its request is still queued gets it cancelled at once.

The fake prefill instance takes 1.5 s per batch. Request A occupies it; request B, sent
by a raw socket that then closes, waits in the prefill queue. B must leave the server
(no longer live, no longer queued) within a fraction of a second, while A is still being
prefilled: B's prompt is never prefilled. Before, the handler waited for B's first
token without watching the connection, so B stayed until its own prefill had run.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from serving_helpers import fake_controller, running_server

pytestmark = pytest.mark.timeout(120)

PREFILL_S = 1.5


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
    controller = fake_controller(prefill_delay_s=PREFILL_S, first_device=4)
    with running_server(controller) as server:
        url = f"{server.http_url}/v1/completions"
        body_a = {"prompt": [4, 5, 6], "max_tokens": 2, "ignore_eos": True}
        result: dict = {}
        a = threading.Thread(target=lambda: result.setdefault("a", httpx.post(url, json=body_a, timeout=30)))
        a.start()
        deadline = time.monotonic() + 5
        while controller.stats().instances[0].num_running == 0:  # A is in the prefill batch
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started_at = time.monotonic()
        body_b = {"prompt": [7, 8, 9], "max_tokens": 2, "ignore_eos": True, "stream": stream}
        _send_and_close(server.http_address, body_b, after_s=0.2)
        closed_at = time.monotonic()
        while controller.stats().num_live_requests > 1 or controller.stats().instances[0].num_waiting > 0:
            assert time.monotonic() - closed_at < 0.5, "the disconnected request is still queued"
            time.sleep(0.01)
        # Gone while A's prefill is still running: B was never prefilled.
        assert time.monotonic() - started_at < PREFILL_S
        assert controller.stats().instances[0].num_running == 1
        a.join(timeout=30)
        assert result["a"].status_code == 200
        assert controller.stats().num_live_requests == 0
