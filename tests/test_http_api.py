"""The OpenAI-compatible HTTP API through a real uvicorn server on loopback (fake engine + a tiny BPE).

Responses are parsed with a strict copy of OpenAI's completion schema (serving_helpers),
and token ids / text are checked against the fake engine's closed-form output.
"""

from __future__ import annotations

import httpx
import pytest
from serving_helpers import (
    Completion,
    CompletionChunk,
    ErrorBody,
    ModelList,
    expected_tokens,
    fake_controller,
    parse_sse,
    running_server,
    tiny_tokenizer,
)

from jaxserve.client import Client

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    with running_server(fake_controller(tokenizer=tiny_tokenizer())) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=30) as c:
        yield c


def test_completion_with_token_ids(http):
    r = http.post(
        "/v1/completions",
        json={"model": "opt-tiny", "prompt": [5, 6, 7], "max_tokens": 9, "ignore_eos": True, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    body = Completion.model_validate(r.json())
    (choice,) = body.choices
    assert choice.token_ids == expected_tokens([5, 6, 7], 9)
    assert choice.text == tiny_tokenizer().decode(choice.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert body.usage is not None
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (3, 9, 12)
    assert body.id.startswith("cmpl-") and body.model == "opt-tiny"


def test_completion_with_text_prompt_uses_the_tokenizer(http):
    tok = tiny_tokenizer()
    prompt = "def main(args):"
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = Completion.model_validate(r.json())
    ids = tok.encode(prompt).ids
    assert body.choices[0].text == tok.decode(expected_tokens(ids, 20), skip_special_tokens=True)
    assert body.usage is not None and body.usage.prompt_tokens == len(ids) and body.usage.completion_tokens == 20


def test_streaming_matches_non_streaming_and_reports_usage(http):
    payload = {"prompt": "import os\n", "max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
    whole = Completion.model_validate(http.post("/v1/completions", json=payload).json())
    r = http.post("/v1/completions", json={**payload, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, done = parse_sse(r.text)
    assert done
    chunks = [CompletionChunk.model_validate(e) for e in events]
    *token_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (
        whole.usage.prompt_tokens,  # type: ignore[union-attr]
        24,
    )
    assert all(c.usage is None for c in token_chunks)
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert [t for c in token_chunks for t in c.choices[0].token_ids or []] == whole.choices[0].token_ids
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streaming_without_include_usage_has_no_usage(http):
    r = http.post("/v1/completions", json={"prompt": [9, 9], "max_tokens": 3, "stream": True})
    events, done = parse_sse(r.text)
    assert done and len(events) >= 1
    assert all("usage" not in e for e in events)
    assert sum(len(CompletionChunk.model_validate(e).choices) for e in events) == len(events)


def test_stop_strings_cut_the_text_on_both_protocols(server, http):
    tok = tiny_tokenizer()
    prompt = "def main(args):"
    full = tok.decode(expected_tokens(tok.encode(prompt).ids, 40), skip_special_tokens=True)
    stop = next(full[i : i + 2] for i in range(8, len(full)) if full[i : i + 2].isalpha())
    expected = full[: full.index(stop)]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "stop": stop, "ignore_eos": True})
    body = Completion.model_validate(r.json())
    assert body.choices[0].text == expected and body.choices[0].finish_reason == "stop"
    r = http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 40, "stop": [stop], "stream": True, "ignore_eos": True}
    )
    events, _ = parse_sse(r.text)
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    with Client(server.grpc_address) as c:
        result = c.generate(prompt, max_tokens=40, stop=[stop], ignore_eos=True)
    assert result.text == expected and result.finish_reason == "stop"
    assert tok.decode(list(result.token_ids), skip_special_tokens=True).startswith(expected + stop)


def test_grpc_text_equals_decoded_tokens(server):
    tok = tiny_tokenizer()
    with Client(server.grpc_address) as c:
        chunks = list(c.stream("class Foo:", max_tokens=30, ignore_eos=True))
    ids = [t for ch in chunks for t in ch.token_ids]
    assert ids == expected_tokens(tok.encode("class Foo:").ids, 30)
    assert "".join(ch.text for ch in chunks) == tok.decode(ids, skip_special_tokens=True)


def test_models_health_and_metrics_endpoints(http):
    models = ModelList.model_validate(http.get("/v1/models").json())
    assert [m.id for m in models.data] == ["opt-tiny"]
    assert http.get("/health").json() == {"status": "ok"}
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE jaxserve:time_to_first_token_seconds histogram" in r.text
    assert "# TYPE jaxserve:kv_blocks_used gauge" in r.text


def test_unknown_route_has_an_openai_error_body(http):
    r = http.get("/v1/chat/nothing")
    assert r.status_code == 404
    ErrorBody.model_validate(r.json())
