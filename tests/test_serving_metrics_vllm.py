"""Metrics follow vLLM's definitions (docs/serving.md lists both side by side).

* TTFT's clock starts when the request arrives at the server, before tokenization and
  validation: a tokenizer that takes 0.4 s shows up in TTFT (and end-to-end latency).
* A request ended by a stop string reports the same engine timestamps as any other
  (prefill queue, prefill, transfer, decode queue, one token time per returned token),
  not a frontend-only approximation.
* `inter_token_latency_seconds` counts token gaps; `request_time_per_output_token_seconds`
  counts requests (checked in test_grpc_server.py too).
"""

from __future__ import annotations

import time

import httpx
import pytest
from serving_helpers import (
    expected_tokens,
    fake_controller,
    metric_value,
    pick_stop_string,
    running_server,
    tiny_tokenizer,
)

from jaxserve.client import Client

pytestmark = pytest.mark.timeout(120)

TOKENIZE_S = 0.4


class SlowTokenizer:
    def __init__(self) -> None:
        self._tok = tiny_tokenizer()

    def encode(self, text: str):  # type: ignore[no-untyped-def]
        time.sleep(TOKENIZE_S)
        return self._tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


def test_ttft_clock_starts_before_tokenization():
    with running_server(fake_controller(tokenizer=SlowTokenizer(), first_device=6)) as server:
        with Client(server.grpc_address) as c:
            out = c.generate("def fib(n):", max_tokens=3, ignore_eos=True)
        assert out.timings is not None and out.timings.ttft_s is not None and out.timings.e2e_s is not None
        assert out.timings.ttft_s >= TOKENIZE_S
        assert out.timings.e2e_s >= out.timings.ttft_s
        assert out.timings.token_times_s[0] == pytest.approx(out.timings.ttft_s)
        text = httpx.get(f"http://{server.http_address}/metrics").text
        assert metric_value(text, "jaxserve:time_to_first_token_seconds_sum") >= TOKENIZE_S
        assert metric_value(text, "jaxserve:time_to_first_token_seconds_count") == 1


def test_stop_string_requests_get_engine_timestamps():
    tok = tiny_tokenizer()
    prompt = [4, 5, 6]
    full = str(tok.decode(expected_tokens(prompt, 30), skip_special_tokens=True))
    stop, at = pick_stop_string(full, start=len(full) // 3)
    with running_server(fake_controller(tokenizer=tok, first_device=6)) as server:
        with Client(server.grpc_address) as c:
            out = c.generate(prompt_ids=prompt, max_tokens=30, ignore_eos=True, stop=stop)
            plain = c.generate(prompt_ids=prompt, max_tokens=4, ignore_eos=True)
        text = httpx.get(f"http://{server.http_address}/metrics").text
    assert out.finish_reason == "stop" and out.text == full[:at]
    assert 1 < out.num_output_tokens < 30
    t = out.timings
    assert t is not None and plain.timings is not None
    # Every engine phase is there, as for the request that ended by itself.
    for name in ("ttft_s", "tpot_s", "e2e_s", "prefill_queue_s", "prefill_s", "kv_transfer_s", "decode_queue_s"):
        assert getattr(t, name) is not None, name
        assert getattr(plain.timings, name) is not None, name
    assert t.kv_transfer_bytes > 0 and t.prefill_instance == "prefill-0" and t.decode_instance == "decode-0"
    assert len(t.token_times_s) == out.num_output_tokens  # the tokens returned, none after the stop
    assert t.tpot_s == pytest.approx((t.token_times_s[-1] - t.token_times_s[0]) / (out.num_output_tokens - 1))
    # Both requests reach every phase histogram.
    assert metric_value(text, "jaxserve:request_prefill_time_seconds_count") == 2
    assert metric_value(text, "jaxserve:kv_transfer_time_seconds_count") == 2
    assert metric_value(text, "jaxserve:request_time_per_output_token_seconds_count") == 2
    assert metric_value(text, "jaxserve:inter_token_latency_seconds_count") == (out.num_output_tokens - 1) + 3
