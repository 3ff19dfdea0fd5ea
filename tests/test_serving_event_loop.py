"""The event loop never blocks: a slow `/metrics` scrape or a slow (huge) prompt's tokenization
does not freeze the other streams.

A gRPC stream of the fake engine yields a token every 20 ms. While it runs, a scrape whose
`controller.stats()` is slow (a backend whose stats are slow), or a request whose tokenization
is slow, is served. Both used to run on the event loop, so every open stream stalled for as long.
Here the slow call lasts until the running stream has received `CHUNKS_WHILE_SLOW` more chunks:
it ends only if streams move while it runs, so the check needs no clock (it was "the largest gap
between chunks stays under 0.5 s while a 1 s call runs", the machine's hour). A frozen loop
delivers no chunk; the slow call then gives up after `HANG_S` and the check fails.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from serving_helpers import fake_controller, running_server, tiny_tokenizer

from jaxserve.client import Client

pytestmark = pytest.mark.timeout(120)

CHUNKS_WHILE_SLOW = 5
HANG_S = 30.0


class SlowCall:
    """Once armed, a call through `wait()` lasts until the stream has seen `CHUNKS_WHILE_SLOW` chunks."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.released = threading.Event()
        self.released_by_stream: bool | None = None

    def wait(self) -> None:
        if not self.armed.is_set():
            return
        self.entered.set()
        self.released_by_stream = self.released.wait(timeout=HANG_S)


class SlowTokenizer:
    """The tiny BPE, but encoding is slow (as a very long prompt's would be)."""

    def __init__(self, slow: SlowCall) -> None:
        self._tok = tiny_tokenizer()
        self._slow = slow

    def encode(self, text: str):  # type: ignore[no-untyped-def]
        self._slow.wait()
        return self._tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


def _stream_moves_while(server, slow: SlowCall, side_effect) -> None:  # type: ignore[no-untyped-def]
    """Runs `side_effect` (which makes one slow call) on another thread while a stream runs; the slow call
    must end released by the stream's chunks."""
    with Client(server.grpc_address) as c:
        it = iter(c.stream(prompt_ids=[4, 5, 6], max_tokens=150, ignore_eos=True))
        for _ in range(5):
            next(it)
        slow.armed.set()
        side = threading.Thread(target=side_effect)
        side.start()
        seen = 0
        for chunk in it:
            if slow.entered.is_set():
                seen += 1
                if seen >= CHUNKS_WHILE_SLOW:
                    slow.released.set()
                    break
            assert not chunk.finished, "the stream ended before the slow call began"
        side.join(timeout=HANG_S + 30)
    assert slow.released_by_stream is True, "the stream stalled while the slow call ran"


def test_slow_stats_scrape_does_not_freeze_streams():
    controller = fake_controller(decode_delay_s=0.02, first_device=4)
    fast_stats = controller.stats
    slow = SlowCall()

    def slow_stats():  # type: ignore[no-untyped-def]
        slow.wait()
        return fast_stats()

    controller.stats = slow_stats  # type: ignore[method-assign]
    with running_server(controller) as server:
        scraped: list[int] = []
        _stream_moves_while(
            server,
            slow,
            lambda: scraped.append(httpx.get(f"http://{server.http_address}/metrics", timeout=60).status_code),
        )
    assert scraped == [200]


def test_slow_tokenization_does_not_freeze_streams():
    slow = SlowCall()
    controller = fake_controller(decode_delay_s=0.02, first_device=4, tokenizer=SlowTokenizer(slow))
    with running_server(controller) as server:
        done: list[int] = []
        body = {"prompt": "def fib(n):" * 20, "max_tokens": 2, "ignore_eos": True}
        _stream_moves_while(
            server,
            slow,
            lambda: done.append(httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60).status_code),
        )
    assert done == [200]
