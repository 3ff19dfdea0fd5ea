"""OpenAI API features through a real server (fake engine + tiny BPE): chat completions (streaming
and not), n > 1, echo, a list of prompts, stop as string or list, max_completion_tokens,
usage.prompt_tokens_details.cached_tokens. Outputs are checked against the fake engine's
closed form (`expected_tokens`); responses against strict copies of OpenAI's schemas."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from serving_helpers import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    expected_tokens,
    fake_controller,
    parse_sse,
    pick_stop_string,
    running_server,
    tiny_tokenizer,
)

from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.serving.frontend import Frontend, PreparedRequest
from jaxserve.serving.openai_protocol import ChatMessage, render_chat

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    with running_server(fake_controller(tokenizer=tiny_tokenizer(), first_device=2)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=30) as c:
        yield c


def _decode(ids: list[int]) -> str:
    return str(tiny_tokenizer().decode(ids, skip_special_tokens=True))


def _chat_prompt_ids(messages: list[dict]) -> list[int]:
    text = render_chat([ChatMessage.model_validate(m) for m in messages])
    return list(tiny_tokenizer().encode(text).ids)


MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]


def test_chat_template_is_the_documented_one():
    assert render_chat([ChatMessage.model_validate(m) for m in MESSAGES]) == (
        "### System:\nYou write Python.\n\n### User:\ndef fib(n):\n\n### Assistant:\n"
    )


def test_chat_completion(http):
    ids = _chat_prompt_ids(MESSAGES)
    want = expected_tokens(ids, 7)
    r = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_completion_tokens": 7, "ignore_eos": True, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    body = ChatCompletion.model_validate(r.json())
    assert body.id.startswith("chatcmpl-")
    (choice,) = body.choices
    assert choice.token_ids == want and choice.message.content == _decode(want)
    assert choice.finish_reason == "length"
    assert body.usage is not None and body.usage.prompt_tokens == len(ids) and body.usage.completion_tokens == 7
    assert body.usage.prompt_tokens_details is not None and body.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_completion_stream(http):
    ids = _chat_prompt_ids(MESSAGES)
    want = expected_tokens(ids, 6)
    body = {
        "messages": MESSAGES,
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    payloads, done = parse_sse(r.text)
    assert done
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads]
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == _decode(want)
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_n_samples_and_a_list_of_prompts(http):
    prompts = [[4, 5, 6], [7, 8]]
    r = http.post(
        "/v1/completions",
        json={"prompt": prompts, "n": 3, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    body = Completion.model_validate(r.json())
    assert [c.index for c in body.choices] == list(range(6))
    for c in body.choices:  # choice i * n + j is sample j of prompt i (the fake engine is greedy)
        assert c.token_ids == expected_tokens(prompts[c.index // 3], 4)
    assert body.usage is not None
    assert body.usage.prompt_tokens == 3 + 2  # each prompt counted once, as OpenAI does
    assert body.usage.completion_tokens == 6 * 4


def test_n_samples_stream(http):
    r = http.post(
        "/v1/completions", json={"prompt": [4, 5, 6], "n": 2, "max_tokens": 5, "ignore_eos": True, "stream": True}
    )
    payloads, done = parse_sse(r.text)
    assert done
    texts = {0: "", 1: ""}
    for p in payloads:
        (choice,) = CompletionChunk.model_validate(p).choices
        texts[choice.index] += choice.text
    assert texts[0] == texts[1] == _decode(expected_tokens([4, 5, 6], 5))


def test_echo(http):
    want = expected_tokens(list(tiny_tokenizer().encode("def fib(n):").ids), 4)
    r = http.post("/v1/completions", json={"prompt": "def fib(n):", "echo": True, "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "def fib(n):" + _decode(want)
    r = http.post(
        "/v1/completions",
        json={"prompt": "def fib(n):", "echo": True, "max_tokens": 4, "ignore_eos": True, "stream": True},
    )
    payloads, _ = parse_sse(r.text)
    assert payloads[0]["choices"][0]["text"].startswith("def fib(n):")
    assert "".join(p["choices"][0]["text"] for p in payloads) == "def fib(n):" + _decode(want)


def test_stop_as_a_list(http):
    full = _decode(expected_tokens([4, 5, 6], 30))
    late, late_at = pick_stop_string(full, start=2 * len(full) // 3)
    early, cut = pick_stop_string(full, start=len(full) // 3)
    assert cut < late_at
    r = http.post(
        "/v1/completions",
        json={"prompt": [4, 5, 6], "max_tokens": 30, "ignore_eos": True, "stop": [late, early]},
    )
    assert r.json()["choices"][0]["text"] == full[:cut]


def test_max_completion_tokens_wins_over_max_tokens(http):
    r = http.post(
        "/v1/completions",
        json={"prompt": [4, 5, 6], "max_tokens": 9, "max_completion_tokens": 3, "ignore_eos": True},
    )
    assert r.json()["usage"]["completion_tokens"] == 3


def test_chat_without_max_tokens_fills_the_context():
    controller = fake_controller(tokenizer=tiny_tokenizer(), first_device=4)
    with running_server(controller) as server:
        r = httpx.post(f"{server.http_url}/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ids = _chat_prompt_ids(MESSAGES)
    assert r.json()["usage"]["completion_tokens"] == controller.model_config.max_position_embeddings - len(ids)


def test_fork_gives_each_sample_its_own_id_and_seed():
    front = Frontend(fake_controller(first_device=4))
    base = PreparedRequest(GenerateRequest("cmpl-a", (4, 5), SamplingParams(seed=2**63 - 2)), 0.0)
    samples = [front.fork(base, j) for j in range(3)]
    assert samples[0] is base
    assert len({s.request.request_id for s in samples}) == 3
    assert [s.request.sampling.seed for s in samples] == [2**63 - 2, 2**63 - 1, 0]
    unseeded = dataclasses.replace(base, request=dataclasses.replace(base.request, sampling=SamplingParams()))
    assert front.fork(unseeded, 1).request.sampling.seed is None  # drawn from its own request id
