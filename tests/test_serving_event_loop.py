"""The event loop never blocks: a slow `/metrics` scrape or a slow (huge) prompt's tokenization
does not freeze the other streams.

A gRPC stream of the fake engine yields a token every 20 ms. While it runs, a scrape whose
`controller.stats()` takes 1 s (a backend whose stats are slow), or a request whose
tokenization takes 1 s, is served. Both used to run on the event loop, so every open stream
stalled for the whole second; now they run on worker threads and the stream's largest gap
between chunks stays far below that.
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest
from serving_helpers import fake_controller, running_server, tiny_tokenizer

from jaxserve.client import Client

pytestmark = pytest.mark.timeout(120)

SLOW_S = 1.0


class SlowTokenizer:
    """The tiny BPE, but encoding takes SLOW_S (as a very long prompt would)."""

    def __init__(self) -> None:
        self._tok = tiny_tokenizer()

    def encode(self, text: str):  # type: ignore[no-untyped-def]
        time.sleep(SLOW_S)
        return self._tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


def _max_gap_while(server, side_effect) -> float:  # type: ignore[no-untyped-def]
    """Largest gap between a running stream's chunks while `side_effect` runs on another thread."""
    arrivals: list[float] = []
    with Client(server.grpc_address) as c:
        it = iter(c.stream(prompt_ids=[4, 5, 6], max_tokens=150, ignore_eos=True))
        for _ in range(5):
            next(it)
        side = threading.Thread(target=side_effect)
        side_started = time.monotonic()
        side.start()
        for chunk in it:
            arrivals.append(time.monotonic())
            if chunk.finished or (not side.is_alive() and arrivals[-1] - side_started > SLOW_S + 0.3):
                break
        side.join(timeout=30)
        assert time.monotonic() - side_started >= SLOW_S  # the side effect really was slow
    return max(b - a for a, b in itertools.pairwise(arrivals))


def test_slow_stats_scrape_does_not_freeze_streams():
    controller = fake_controller(decode_delay_s=0.02, first_device=4)
    fast_stats = controller.stats

    def slow_stats():  # type: ignore[no-untyped-def]
        time.sleep(SLOW_S)
        return fast_stats()

    controller.stats = slow_stats  # type: ignore[method-assign]
    with running_server(controller) as server:
        scraped: list[int] = []
        gap = _max_gap_while(
            server, lambda: scraped.append(httpx.get(f"http://{server.http_address}/metrics", timeout=30).status_code)
        )
    assert scraped == [200]
    assert gap < SLOW_S / 2, f"a stream stalled {gap:.2f} s during a scrape"


def test_slow_tokenization_does_not_freeze_streams():
    controller = fake_controller(decode_delay_s=0.02, first_device=4, tokenizer=SlowTokenizer())
    with running_server(controller) as server:
        done: list[int] = []
        body = {"prompt": "def fib(n):" * 20, "max_tokens": 2, "ignore_eos": True}
        gap = _max_gap_while(
            server,
            lambda: done.append(httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=30).status_code),
        )
    assert done == [200]
    assert gap < SLOW_S / 2, f"a stream stalled {gap:.2f} s during a tokenization"
