"""Prefix-cache isolation: vLLM's `cache_salt`, and salting by API key by default (issue 27).

Blocks cached for one salt are never found under another (nor under none), so `cached_tokens` and TTFT no
longer let one client confirm another's prompt. Real servers on 127.0.0.1 (fake engine, prefix caching on,
block size 4): HTTP's `cache_salt` body field and gRPC's `cache_salt` field; requests made with two API keys
never share blocks; a server without keys salts nothing.
"""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from serving_helpers import PrefillGate, expected_tokens, fake_controller, running_server

from jaxserve.core.limits import ServingLimits
from jaxserve.core.prefix_cache import block_hashes
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy, prompts_to_defer
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.runtime.controller import ControllerConfig
from jaxserve.serving.frontend import Frontend
from jaxserve.serving.wire import CompletionParams

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(30, 48))  # 18 tokens: 4 full blocks of 4 + 2
KEY = "inference-key"


def test_a_salt_gives_a_chain_of_its_own() -> None:
    plain = block_hashes(PROMPT, 4)
    assert block_hashes(PROMPT, 4, None) == block_hashes(PROMPT, 4, "") == plain
    a, b = block_hashes(PROMPT, 4, "a"), block_hashes(PROMPT, 4, "b")
    assert a == block_hashes(PROMPT, 4, "a") and len(a) == len(plain) == 4
    assert not ({*a} & {*b}) and not ({*a} & {*plain})


@pytest.fixture(scope="module")
def server():
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True), limits=ServingLimits(block_size=4, num_kv_blocks=64)
    )
    with running_server(fake_controller(config=config, first_device=4), api_key=KEY) as s:
        yield s


def _http(server, prompt: list[int], salt: str | None = None) -> int:  # type: ignore[no-untyped-def]
    body: dict[str, object] = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(
        f"{server.http_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == expected_tokens(prompt, 4)
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _grpc(server, prompt: list[int], salt: str | None) -> int:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.grpc_address) as channel:
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=4, ignore_eos=True)
        if salt is not None:
            request.cache_salt = salt
        responses = list(
            pb_grpc.JaxServeStub(channel).Generate(request, timeout=30, metadata=[("authorization", f"Bearer {KEY}")])
        )
    assert [t for r in responses for t in r.token_ids] == expected_tokens(prompt, 4)
    return int(responses[-1].usage.cached_tokens)


def test_cache_salt_over_http_and_grpc(server) -> None:  # type: ignore[no-untyped-def]
    assert _http(server, PROMPT) == 0
    assert _http(server, PROMPT) == 16  # same key, no salt of its own: shared
    assert _http(server, PROMPT, "alice") == 0  # a salt of its own: not the unsalted blocks
    assert _http(server, PROMPT, "alice") == 16
    assert _grpc(server, PROMPT, "alice") == 16  # the same salt over gRPC
    assert _grpc(server, PROMPT, "bob") == 0
    assert _grpc(server, PROMPT, None) == 16  # the key's own blocks


def test_bad_salts_get_400_naming_the_field(server) -> None:  # type: ignore[no-untyped-def]
    for bad in ("", "x" * 257, 7):
        body = {"prompt": PROMPT, "max_tokens": 2, "cache_salt": bad}
        r = httpx.post(
            f"{server.http_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_a_repeat_waits_for_its_twin_only_under_the_same_salt() -> None:
    a, b, short = tuple(range(10, 19)), tuple(range(20, 29)), (1, 2, 3)
    assert prompts_to_defer([a, a], [], 4) == [False, True]  # unsalted: the twin waits
    assert prompts_to_defer([a, a, a], [], 4, salts=["x", "y", "x"]) == [False, False, True]
    assert prompts_to_defer([a, b], [a], 4, salts=["x", None], in_flight_salts=["y"]) == [False, False]
    assert prompts_to_defer([a], [a], 4, salts=["y"], in_flight_salts=["y"]) == [True]
    assert prompts_to_defer([short, short], [], 4, salts=["x", "x"]) == [False, False]


def test_another_tenants_identical_prompt_does_not_delay_a_request() -> None:
    """Prefills counted at the engine: a held first prefill, then two requests with one prompt under two salts.
    Once they were one batch after the other (the second deferred behind the first, and its client could
    time that); now they are one batch, and the second computes its whole prompt (nothing shared)."""
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True), limits=ServingLimits(block_size=4, num_kv_blocks=64)
    )
    gate = PrefillGate()
    controller = fake_controller(config=config, first_device=6, prefill_gate=gate)
    controller.start()
    try:
        sampling = SamplingParams(max_tokens=2, ignore_eos=True)
        blocker = controller.submit(GenerateRequest("blocker", tuple(range(60, 70)), sampling))
        deadline = time.monotonic() + 30
        while gate.num_prefills < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        streams = [controller.submit(GenerateRequest(f"tenant-{s}", tuple(PROMPT), sampling, s)) for s in "ab"]
        time.sleep(0.3)  # both queued behind the held prefill
        gate.opened.set()
        blocker.collect(timeout_s=30)
        lasts = [stream.collect(timeout_s=30)[1] for stream in streams]
        assert [last.timings.cached_prompt_tokens for last in lasts if last.timings] == [0, 0]
        assert gate.num_prefills == 2  # the blocker's, then both tenants' in one batch
    finally:
        gate.opened.set()
        controller.shutdown(drain_timeout_s=1)


def test_two_api_keys_never_share_blocks_and_no_key_salts_nothing() -> None:
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True), limits=ServingLimits(block_size=4, num_kv_blocks=64)
    )
    controller = fake_controller(config=config, first_device=6)
    controller.start()
    try:
        params = CompletionParams(None, tuple(PROMPT), SamplingParams(max_tokens=2, ignore_eos=True))
        keys = ("sk-first-secret", "sk-second-secret")
        one, two, none = (
            Frontend(controller, api_key=keys[0]),
            Frontend(controller, api_key=keys[1]),
            Frontend(controller),
        )
        assert none.check(params, tuple(PROMPT)).cache_salt is None  # no keys: no salt
        salts = [f.check(params, tuple(PROMPT)).cache_salt for f in (one, two)]
        assert salts[0] is not None and salts[1] is not None and salts[0] != salts[1]
        assert not any("secret" in salt for salt in salts)  # a digest, never the configured key itself

        def cached(frontend: Frontend) -> int:
            request = frontend.check(params, tuple(PROMPT))
            _, last = controller.submit(request).collect(timeout_s=30)
            return last.timings.cached_prompt_tokens if last.timings is not None else -1

        assert cached(one) == 0 and cached(one) == 16
        assert cached(two) == 0  # another key: its own chain
        assert cached(none) == 0 and cached(none) == 16
        assert cached(two) == 16
    finally:
        controller.shutdown(drain_timeout_s=1)


def test_the_python_client_passes_cache_salt(server) -> None:  # type: ignore[no-untyped-def]
    """`Client` / `AsyncClient` (`jaxserve.client`) over real gRPC: `cache_salt=` on generate and stream reaches
    the server (its blocks are that salt's alone), `Completion.num_cached_tokens` shows it, and a bad salt is the
    server's INVALID_ARGUMENT naming the field."""
    import asyncio

    from jaxserve.client import AsyncClient, Client, InvalidArgumentError

    prompt = list(range(60, 78))  # a prompt of this test's own: 4 full blocks of 4
    want = tuple(expected_tokens(prompt, 4))

    def cached(completion) -> int:  # type: ignore[no-untyped-def]
        assert completion.token_ids == want
        return int(completion.num_cached_tokens)

    with Client(server.grpc_address, api_key=KEY, timeout_s=30) as client:
        assert cached(client.generate(prompt_ids=prompt, max_tokens=4, ignore_eos=True, cache_salt="carol")) == 0
        assert cached(client.generate(prompt_ids=prompt, max_tokens=4, ignore_eos=True, cache_salt="carol")) == 16
        assert cached(client.generate(prompt_ids=prompt, max_tokens=4, ignore_eos=True)) == 0  # unsalted: not carol's
        chunks = list(client.stream(prompt_ids=prompt, max_tokens=4, ignore_eos=True, cache_salt="dave"))
        assert chunks[-1].num_cached_tokens == 0  # another salt
        with pytest.raises(InvalidArgumentError) as info:
            client.generate(prompt_ids=prompt, max_tokens=4, cache_salt="")
        assert info.value.field == "cache_salt"

    async def salted_async() -> int:
        async with AsyncClient(server.grpc_address, api_key=KEY, timeout_s=30) as client:
            return cached(await client.generate(prompt_ids=prompt, max_tokens=4, ignore_eos=True, cache_salt="dave"))

    assert asyncio.run(salted_async()) == 16
