"""Property test over request fields on both protocols: every answer is a result or a documented error.

Random field values (NaN, infinities, negative and huge numbers, empty and long prompts,
ids outside the vocabulary, odd stop strings, unknown HTTP fields) go through the real
servers. The server must never crash or hang (client deadlines would fail the test),
each response must be a well-formed result or an INVALID_ARGUMENT / 400 naming a
documented field, and afterwards no KV block may be left allocated.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_helpers import (
    Completion,
    ErrorBody,
    fake_controller,
    metric_value,
    parse_sse,
    running_server,
    tiny_tokenizer,
)

from jaxserve.client import Client, InvalidArgumentError

pytestmark = pytest.mark.timeout(300)

FIELDS = {"prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids"}
HTTP_EXTRA = {"bogus", "logprobs_x"}
PROPERTY = settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Each strategy mixes mostly-valid values (listed several times: one_of picks branches
# evenly) with every kind of invalid one, so results and errors both get exercised.
_good_float = st.floats(0.01, 1.0)
floats = st.one_of(st.none(), st.none(), _good_float, _good_float, st.floats(allow_nan=True, allow_infinity=True))
good_ids = st.lists(st.integers(3, 511), min_size=1, max_size=20)
token_ids = st.one_of(good_ids, good_ids, good_ids, st.lists(st.integers(-3, 520), max_size=40), st.just([5] * 300))
texts = st.one_of(st.text(min_size=1, max_size=30), st.just("def f(x):\n    return x\n"), st.just(""))
max_tokens_st = st.one_of(st.none(), st.integers(1, 40), st.integers(1, 40), st.integers(-5, 300))
stops = st.one_of(st.just([]), st.just([]), st.lists(st.text(min_size=1, max_size=3), max_size=2), st.just([""]))
stop_ids = st.one_of(st.just([]), st.lists(st.integers(0, 511), max_size=2), st.lists(st.integers(-2, 600), max_size=3))
small_ints = st.one_of(st.none(), st.none(), st.integers(0, 50), st.integers(-5, -1))
seeds = st.one_of(st.none(), st.none(), st.integers(0, 2**63 - 1), st.integers(-(2**63), -1))


@pytest.fixture(scope="module")
def server():
    with running_server(fake_controller(tokenizer=tiny_tokenizer())) as s:
        yield s


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.grpc_address, timeout_s=30) as c:
        yield c


@given(
    prompt=st.one_of(token_ids, texts),
    max_tokens=max_tokens_st,
    temperature=floats,
    top_p=floats,
    top_k=small_ints,
    seed=seeds,
    stop=stops,
    stop_token_ids=stop_ids,
    ignore_eos=st.booleans(),
)
@PROPERTY
def test_grpc_answers_with_a_result_or_a_documented_error(grpc_client, prompt, max_tokens, **kwargs):
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    try:
        result = grpc_client.generate(text, prompt_ids=ids, max_tokens=max_tokens, **kwargs)
    except InvalidArgumentError as e:
        assert e.field in FIELDS, e
        event(f"INVALID_ARGUMENT {e.field}")
        return
    event(f"result {result.finish_reason}")
    assert result.finish_reason in ("stop", "length")
    assert 1 <= len(result.token_ids) <= (16 if max_tokens is None else max_tokens)
    assert all(0 <= t < 512 for t in result.token_ids)
    assert result.timings is not None and result.timings.e2e_s is not None


@given(
    prompt=st.one_of(token_ids, texts, st.lists(texts, max_size=2), st.integers(), st.none()),
    max_tokens=st.one_of(max_tokens_st, st.just("7")),
    temperature=floats,
    top_p=floats,
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1), st.integers(-(2**64), 2**64)),
    stop=st.one_of(st.none(), st.text(min_size=1, max_size=3), stops),
    stream=st.booleans(),
    extra=st.sampled_from([None, None, None, None, *sorted(HTTP_EXTRA)]),
)
@PROPERTY
def test_http_answers_with_a_result_or_a_documented_error(server, prompt, extra, **fields):
    body = {"prompt": prompt, **{k: v for k, v in fields.items() if v is not None}}
    if extra:
        body[extra] = 1
    r = httpx.post(
        f"{server.http_url}/v1/completions",
        content=json.dumps(body, allow_nan=True),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    if r.status_code == 400:
        param = ErrorBody.model_validate(r.json()).error.param
        assert param in FIELDS | HTTP_EXTRA, r.text
        event(f"400 {param}")
        return
    event(f"200 stream={bool(body.get('stream'))}")
    assert r.status_code == 200, r.text
    if body.get("stream"):
        events, done = parse_sse(r.text)
        assert done and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        completion = Completion.model_validate(r.json())
        assert completion.usage is not None and completion.usage.completion_tokens >= 1


def test_nothing_leaked_and_still_healthy(server, grpc_client):
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    assert metric_value(text, "jaxserve:kv_blocks_used", {"instance": "decode-0"}) == 0
    assert metric_value(text, "jaxserve:prefill_buffer_used", {"instance": "prefill-0"}) == 0
    assert grpc_client.health()
    assert len(grpc_client.generate(prompt_ids=[5], max_tokens=2, ignore_eos=True).token_ids) == 2
