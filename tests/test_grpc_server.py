"""The gRPC service through a real server on loopback, over the hand-computable fake engine.

The fake engine's tokens are known in closed form (`reference_tokens`), so every test
checks exact token ids, not just that something came back.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from serving_helpers import expected_tokens, fake_controller, metric_value, running_server

from jaxserve.client import AsyncClient, Client, InvalidArgumentError
from jaxserve.proto import SERVICE_NAME

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    with running_server(fake_controller()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_address, timeout_s=30) as c:
        yield c


def test_generate_returns_the_engines_tokens_and_timings(client):
    for prompt in ([5, 6, 7], [100, 200, 300, 400, 17], list(range(3, 40))):
        result = client.generate(prompt_ids=prompt, max_tokens=12, ignore_eos=True)
        assert list(result.token_ids) == expected_tokens(prompt, 12)
        assert result.finish_reason == "length"
        assert result.num_prompt_tokens == len(prompt)
        t = result.timings
        assert t is not None and t.ttft_s is not None and t.tpot_s is not None and t.e2e_s is not None
        assert 0 < t.ttft_s <= t.e2e_s
        assert len(t.token_times_s) == 12
        assert t.kv_transfer_bytes > 0 and t.kv_transfer_s is not None
        assert (t.prefill_instance, t.decode_instance) == ("prefill-0", "decode-0")


def test_stream_yields_new_tokens_once_and_a_final_chunk(client):
    prompt = [9, 8, 7, 6]
    chunks = list(client.stream(prompt_ids=prompt, max_tokens=10, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(prompt, 10)
    assert chunks[0].token_ids == (expected_tokens(prompt, 1)[0],)  # the prefill instance's token comes first
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length" and chunks[-1].timings is not None
    assert chunks[-1].num_output_tokens == 10 and chunks[-1].num_prompt_tokens == 4


def test_stop_token_ids_end_the_request_with_stop(client):
    prompt = [11, 12, 13]
    full = expected_tokens(prompt, 12)
    stop = full[4]
    result = client.generate(prompt_ids=prompt, max_tokens=12, stop_token_ids=[stop], ignore_eos=True)
    assert result.finish_reason == "stop"
    assert list(result.token_ids) == full[: full.index(stop) + 1]


def test_model_info_and_deployment(client):
    info = client.model_info()
    assert (info.name, info.vocab_size, info.max_position_embeddings) == ("opt-tiny", 512, 256)
    assert info.max_prompt_tokens == 255 and info.max_tokens_limit == 256
    assert info.has_tokenizer is False
    plan = client.deployment()
    assert plan.describe() == "disagg:prefill=tp1,decode=tp1"
    assert [i.devices for i in plan.instances] == [(0,), (1,)]


def test_64_concurrent_streams_all_complete(server):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(1 + i % 9)] for i in range(64)]

    async def main():
        async with AsyncClient(server.grpc_address, timeout_s=60) as ac:

            async def one(prompt):
                return [c async for c in ac.stream(prompt_ids=prompt, max_tokens=16, ignore_eos=True)]

            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, chunks in zip(prompts, results, strict=True):
        assert [t for c in chunks for t in c.token_ids] == expected_tokens(prompt, 16)
        assert chunks[-1].finish_reason == "length"


def test_health_and_reflection(server, client):
    assert client.health() and client.health(service="")
    with grpc.insecure_channel(server.grpc_address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
        service = DescriptorPool(db).FindServiceByName(SERVICE_NAME)
        assert {m.name for m in service.methods} == {"Generate", "GetModelInfo", "GetDeployment"}
        generate = service.methods_by_name["Generate"]
        assert generate.server_streaming and not generate.client_streaming


def test_metrics_histograms_move_with_traffic(server, client):
    url = f"http://{server.http_address}/metrics"
    names = [
        "jaxserve:time_to_first_token_seconds_count",
        "jaxserve:request_time_per_output_token_seconds_count",
        "jaxserve:e2e_request_latency_seconds_count",
        "jaxserve:kv_transfer_time_seconds_count",
        "jaxserve:kv_transfer_bytes_count",
        "jaxserve:request_prefill_time_seconds_count",
    ]
    before = httpx.get(url).text
    client.generate(prompt_ids=[3, 4, 5], max_tokens=6, ignore_eos=True)
    client.generate(prompt_ids=[3, 4, 5, 6], max_tokens=4, ignore_eos=True)
    after = httpx.get(url).text
    for name in names:
        assert metric_value(after, name) - metric_value(before, name) == 2, name
    itl = "jaxserve:inter_token_latency_seconds_count"
    assert metric_value(after, itl) - metric_value(before, itl) == (6 - 1) + (4 - 1)
    for phase in ("prefill", "decode"):
        q = "jaxserve:request_queue_time_seconds_count"
        assert metric_value(after, q, {"phase": phase}) - metric_value(before, q, {"phase": phase}) == 2
    gen = "jaxserve:generation_tokens_total"
    assert metric_value(after, gen) - metric_value(before, gen) == 10
    assert metric_value(after, "jaxserve:kv_blocks_free", {"instance": "decode-0", "role": "decode"}) == 256
    assert metric_value(after, "jaxserve:prefill_buffer_capacity", {"instance": "prefill-0"}) == 8
    assert metric_value(after, "jaxserve:instance_alive", {"instance": "prefill-0"}) == 1


def test_invalid_request_names_the_field_and_server_keeps_serving(client):
    with pytest.raises(InvalidArgumentError) as e:
        client.generate(prompt_ids=[5, 6], max_tokens=0)
    assert e.value.field == "max_tokens"
    assert client.generate(prompt_ids=[5, 6], max_tokens=2, ignore_eos=True).token_ids == tuple(
        expected_tokens([5, 6], 2)
    )


def test_client_refuses_a_misspelled_keyword_and_n_on_generate_before_sending(client):
    with pytest.raises(TypeError, match="max_token"):
        client.generate(prompt_ids=[5, 6], max_token=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="stream"):
        client.generate(prompt_ids=[5, 6], max_tokens=2, n=2)
    samples = list(client.stream(prompt_ids=[5, 6], max_tokens=2, n=2, ignore_eos=True))
    assert {c.index for c in samples} == {0, 1}


def test_async_client_takes_the_same_parameters(server):
    async def main():
        async with AsyncClient(server.grpc_address, timeout_s=30) as c:
            result = await c.generate(prompt_ids=[5, 6, 7], max_tokens=4, ignore_eos=True, stop_token_ids=[])
            with pytest.raises(TypeError, match="max_token"):
                await c.generate(prompt_ids=[5, 6], max_token=2)  # type: ignore[call-arg]
            return result

    assert list(asyncio.run(main()).token_ids) == expected_tokens([5, 6, 7], 4)
