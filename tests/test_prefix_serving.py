"""usage.prompt_tokens_details.cached_tokens (HTTP) and Usage.cached_tokens (gRPC) report the real hit
(real servers on 127.0.0.1, fake engine, prefix caching on, block size 4)."""

from __future__ import annotations

import httpx
import pytest
from serving_helpers import expected_tokens, fake_controller, running_server

from jaxserve.client import Client
from jaxserve.core.limits import ServingLimits
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import ControllerConfig

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(30, 48))  # 18 tokens: 4 full blocks of 4 + 2


@pytest.fixture(scope="module")
def server():
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True), limits=ServingLimits(block_size=4, num_kv_blocks=64)
    )
    with running_server(fake_controller(config=config, first_device=4)) as s:
        yield s


def test_http_and_grpc_report_the_cached_prompt_tokens(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        first = http.post("/v1/completions", json=body).json()
        second = http.post("/v1/completions", json=body).json()
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == expected_tokens(PROMPT, 4)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # 4 blocks; the last token is computed
    assert second["usage"]["prompt_tokens"] == 18
    with Client(server.grpc_address) as client:
        chunks = list(client.stream(prompt_ids=[*PROMPT, 99, 98], max_tokens=4, ignore_eos=True))
    final = chunks[-1]
    assert final.finished and final.num_cached_tokens == 16  # 20 tokens: the 4 cached blocks of PROMPT


def test_metrics_export_the_prefix_cache(server) -> None:
    from serving_helpers import metric_value

    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        for _ in range(2):  # the second finds the first's blocks
            http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
        text = http.get("/metrics").text
    labels = {"instance": "prefill-0", "role": "prefill"}
    assert metric_value(text, "jaxserve:prefix_cache_hit_tokens", labels) >= 16
    assert metric_value(text, "jaxserve:prefix_cache_query_tokens", labels) >= 18
    assert metric_value(text, "jaxserve:prefix_cache_blocks", labels) >= 4
