"""Every documented error on both protocols, with the right status and field, and the server keeps serving.

gRPC: INVALID_ARGUMENT (+ `jaxserve-field`), RESOURCE_EXHAUSTED (+ `retry-after-s`), UNAVAILABLE.
HTTP: 400 (`param`), 404, 413, 429 (+ `Retry-After`), 503 — all with OpenAI's error body.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from serving_helpers import ErrorBody, expected_tokens, fake_controller, running_server, tiny_tokenizer

from jaxserve.client import (
    Client,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.runtime.controller import AdmissionConfig, ControllerConfig

pytestmark = pytest.mark.timeout(120)

NAN, INF = float("nan"), float("inf")

# (case, gRPC client kwargs, HTTP body, gRPC field, HTTP param)
CASES = [
    ("empty ids", {"prompt_ids": []}, {"prompt": []}, "prompt", "prompt"),
    ("empty text", {"prompt": ""}, {"prompt": ""}, "prompt", "prompt"),
    ("longer than the model", {"prompt_ids": [5] * 300}, {"prompt": [5] * 300}, "prompt_token_ids", "prompt"),
    ("long text", {"prompt": "while True: " * 200}, {"prompt": "while True: " * 200}, "prompt", "prompt"),
    ("id outside vocab", {"prompt_ids": [5, 512]}, {"prompt": [5, 512]}, "prompt_token_ids", "prompt"),
    ("negative id", {"prompt_ids": [-1, 5]}, {"prompt": [-1, 5]}, "prompt_token_ids", "prompt"),
    ("max_tokens 0", {"max_tokens": 0}, {"max_tokens": 0}, "max_tokens", "max_tokens"),
    ("max_tokens negative", {"max_tokens": -3}, {"max_tokens": -3}, "max_tokens", "max_tokens"),
    ("max_tokens too large", {"max_tokens": 100_000}, {"max_tokens": 100_000}, "max_tokens", "max_tokens"),
    (
        "prompt + max_tokens past positions",
        {"prompt_ids": [5] * 200, "max_tokens": 100},
        {"prompt": [5] * 200, "max_tokens": 100},
        "max_tokens",
        "max_tokens",
    ),
    ("temperature negative", {"temperature": -0.5}, {"temperature": -0.5}, "temperature", "temperature"),
    ("temperature NaN", {"temperature": NAN}, {"temperature": NAN}, "temperature", "temperature"),
    ("temperature inf", {"temperature": INF}, {"temperature": INF}, "temperature", "temperature"),
    ("temperature huge", {"temperature": 101.0}, {"temperature": 101.0}, "temperature", "temperature"),
    ("top_p 0", {"top_p": 0.0}, {"top_p": 0.0}, "top_p", "top_p"),
    ("top_p above 1", {"top_p": 1.5}, {"top_p": 1.5}, "top_p", "top_p"),
    ("top_p NaN", {"top_p": NAN}, {"top_p": NAN}, "top_p", "top_p"),
    ("top_k negative", {"top_k": -1}, {"top_k": -1}, "top_k", "top_k"),
    ("seed negative", {"seed": -1}, {"seed": -1}, "seed", "seed"),
    ("stop id outside vocab", {"stop_token_ids": [600]}, {"stop_token_ids": [600]}, "stop_token_ids", "stop_token_ids"),
    ("empty stop string", {"stop": [""]}, {"stop": [""]}, "stop", "stop"),
]


@pytest.fixture(scope="module")
def server():
    with running_server(fake_controller(tokenizer=tiny_tokenizer())) as s:
        yield s


def _valid_grpc(client: Client) -> None:
    assert client.generate(prompt_ids=[7, 8], max_tokens=3, ignore_eos=True).token_ids == tuple(
        expected_tokens([7, 8], 3)
    )


def _valid_http(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 3, "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected_tokens([7, 8], 3)


def _json_with_nan(body: dict) -> bytes:
    import json

    return json.dumps(body, allow_nan=True).encode()  # NaN/Infinity literals, as many clients send


@pytest.mark.parametrize(("case", "kwargs", "body", "field", "param"), CASES, ids=[c[0] for c in CASES])
def test_invalid_requests_on_both_protocols(server, case, kwargs, body, field, param):
    with Client(server.grpc_address, timeout_s=30) as client:
        request = {"prompt_ids": [5, 6], "max_tokens": 4, **kwargs}
        if "prompt" in kwargs:
            request.pop("prompt_ids")
        with pytest.raises(InvalidArgumentError) as e:
            client.generate(**request)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.field == field and field in e.value.details
        _valid_grpc(client)
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        payload = {"prompt": [5, 6], "max_tokens": 4, **body}
        r = http.post("/v1/completions", content=_json_with_nan(payload), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = ErrorBody.model_validate(r.json()).error
        assert err.param == param and err.type == "invalid_request_error" and param in err.message
        _valid_http(http)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": [5], "bogus": 1}, 400, "bogus"),
        ({"prompt": [5], "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options"),
        ({"prompt": [5], "max_tokens": "5"}, 400, "max_tokens"),
        ({"prompt": [5], "temperature": "hot"}, 400, "temperature"),
        ({"max_tokens": 5}, 400, "prompt"),
        ({"prompt": ["a", ""]}, 400, "prompt"),
        ({"prompt": [[5]] * 9, "n": 8}, 400, "n"),
        ({"prompt": [5], "n": 0}, 400, "n"),
        ({"prompt": [5], "n": 17}, 400, "n"),
        ({"prompt": [5], "logprobs": 2}, 400, "logprobs"),
        ({"prompt": [5], "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": [5], "model": "gpt-4"}, 404, "model"),
    ],
)
def test_http_only_errors(server, body, status, param):
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == status, r.text
        assert ErrorBody.model_validate(r.json()).error.param == param
        r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and ErrorBody.model_validate(r.json()).error.type == "invalid_request_error"
        _valid_http(http)


def test_grpc_unknown_fields_and_both_prompts(server):
    with grpc.insecure_channel(server.grpc_address) as channel:
        generate = channel.unary_stream(
            "/jaxserve.v1.JaxServe/Generate", response_deserializer=pb.GenerateResponse.FromString
        )
        raw = pb.GenerateRequest(prompt_token_ids=[5]).SerializeToString() + bytes([0x98, 0x06, 0x05])  # field 99
        with pytest.raises(grpc.RpcError) as e:
            list(generate(raw, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "#99" in e.value.details()
    with Client(server.grpc_address) as client:
        with pytest.raises(InvalidArgumentError) as e2:
            client.generate("x", prompt_ids=[5])
        assert e2.value.field == "prompt"
        _valid_grpc(client)


# ---- limits: configured prompt/max_tokens bounds, overload, sizes ------------------------
@pytest.fixture(scope="module")
def limited_server():
    config = ControllerConfig(
        admission=AdmissionConfig(max_prompt_tokens=32, max_tokens_limit=64, max_queued_requests=2)
    )
    controller = fake_controller(config=config, prefill_delay_s=0.3, first_device=2)
    with running_server(controller, max_request_bytes=4096) as s:
        yield s


def test_configured_limits_on_both_protocols(limited_server):
    with Client(limited_server.grpc_address, timeout_s=30) as client:
        with pytest.raises(InvalidArgumentError) as e:
            client.generate(prompt_ids=[5] * 33, max_tokens=2)
        assert e.value.field == "prompt_token_ids"
        with pytest.raises(InvalidArgumentError) as e:
            client.generate(prompt_ids=[5] * 32, max_tokens=65)
        assert e.value.field == "max_tokens"
        assert client.model_info().max_prompt_tokens == 32
        assert len(client.generate(prompt_ids=[5] * 32, max_tokens=2, ignore_eos=True).token_ids) == 2
    with httpx.Client(base_url=limited_server.http_url, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": [5] * 33, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = http.post("/v1/completions", json={"prompt": [5] * 32, "max_tokens": 2})
        assert r.status_code == 200


def test_overload_is_resource_exhausted_and_429_with_a_retry_hint(limited_server):
    def grpc_call(i: int):
        with Client(limited_server.grpc_address, timeout_s=30) as c:
            try:
                return c.generate(prompt_ids=[5, i + 3], max_tokens=2, ignore_eos=True)
            except ResourceExhaustedError as e:
                return e

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(grpc_call, range(10)))
    refused = [r for r in results if isinstance(r, ResourceExhaustedError)]
    served = [r for r in results if not isinstance(r, ResourceExhaustedError)]
    assert refused and served
    assert all(r.retry_after_s == 1.0 and r.code == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert all(len(r.token_ids) == 2 for r in served)

    def http_call(i: int) -> httpx.Response:
        return httpx.post(
            f"{limited_server.http_url}/v1/completions", json={"prompt": [5, i + 3], "max_tokens": 2}, timeout=30
        )

    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(http_call, range(10)))
    statuses = [r.status_code for r in responses]
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
    too_many = next(r for r in responses if r.status_code == 429)
    assert too_many.headers["retry-after"] == "1"
    assert ErrorBody.model_validate(too_many.json()).error.type == "rate_limit_error"
    # Once the queue drains, requests are served again.
    assert http_call(0).status_code == 200


def test_request_size_limits(limited_server):
    with httpx.Client(base_url=limited_server.http_url, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 2})
        assert r.status_code == 413 and ErrorBody.model_validate(r.json()).error.code == "request_too_large"

        def chunked():
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}).status_code == 200
    with Client(limited_server.grpc_address, timeout_s=30) as client:
        with pytest.raises(ResourceExhaustedError):
            client.generate(prompt_ids=[500] * 3000, max_tokens=2)  # ~6 KB > 4 KiB
        assert len(client.generate(prompt_ids=[5], max_tokens=2, ignore_eos=True).token_ids) == 2


# ---- shutdown ---------------------------------------------------------------------------
def test_shutdown_drains_refuses_new_requests_and_tells_in_flight_why():
    controller = fake_controller(decode_delay_s=0.04, first_device=4)  # 200 tokens: ~8 s
    with running_server(controller) as server:
        results: dict[str, object] = {}

        def in_flight():
            with Client(server.grpc_address, timeout_s=30) as c:
                results["chunks"] = list(c.stream(prompt_ids=[4, 5, 6], max_tokens=200, ignore_eos=True))

        reader = threading.Thread(target=in_flight)
        reader.start()
        time.sleep(0.5)
        stopper = threading.Thread(target=server.stop, kwargs={"drain_timeout_s": 3.0})
        stopper.start()
        time.sleep(0.3)
        with Client(server.grpc_address, timeout_s=10) as c:
            with pytest.raises(UnavailableError):
                c.generate(prompt_ids=[4, 5], max_tokens=2)
            assert c.health() is False
        with httpx.Client(base_url=server.http_url, timeout=10) as http:
            r = http.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 2})
            assert r.status_code == 503 and ErrorBody.model_validate(r.json()).error.type == "server_error"
            assert http.get("/health").status_code == 503
        stopper.join(30)
        reader.join(30)
        chunks = results["chunks"]
        assert chunks[-1].finish_reason == "abort"  # type: ignore[index]
        num_tokens = sum(len(c.token_ids) for c in chunks)  # type: ignore[attr-defined]
        assert 0 < num_tokens < 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.http_url}/health", timeout=2)
