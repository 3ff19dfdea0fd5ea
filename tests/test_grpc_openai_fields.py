"""The gRPC API has the OpenAI features too: chat messages, n samples (responses carry their index),
echo, usage.cached_tokens (real server, fake engine + tiny BPE)."""

from __future__ import annotations

import pytest
from serving_helpers import expected_tokens, fake_controller, running_server, tiny_tokenizer

from jaxserve.client import Client, InvalidArgumentError
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.serving import wire
from jaxserve.serving.chat_template import render_chat

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]


@pytest.fixture(scope="module")
def client():
    with (
        running_server(fake_controller(tokenizer=tiny_tokenizer(), first_device=2)) as server,
        Client(server.grpc_address) as c,
    ):
        yield c


def _decode(ids: list[int]) -> str:
    return str(tiny_tokenizer().decode(ids, skip_special_tokens=True))


def test_chat_messages(client):
    ids = list(tiny_tokenizer().encode(render_chat((m["role"], m["content"]) for m in MESSAGES)).ids)
    out = client.generate(messages=MESSAGES, max_tokens=6, ignore_eos=True)
    assert list(out.token_ids) == expected_tokens(ids, 6)
    assert out.text == _decode(expected_tokens(ids, 6)) and out.num_prompt_tokens == len(ids)


def test_n_samples_carry_their_index(client):
    chunks = list(client.stream(prompt_ids=[4, 5, 6], n=3, max_tokens=4, ignore_eos=True))
    by_index: dict[int, list[int]] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).extend(c.token_ids)
    assert by_index == {i: expected_tokens([4, 5, 6], 4) for i in range(3)}
    finals = [c for c in chunks if c.finished]
    assert sorted(c.index for c in finals) == [0, 1, 2] and all(c.num_output_tokens == 4 for c in finals)
    with pytest.raises(ValueError):
        client.generate(prompt_ids=[4, 5, 6], n=2)


def test_echo(client):
    out = client.generate("def fib(n):", echo=True, max_tokens=3, ignore_eos=True)
    want = expected_tokens(list(tiny_tokenizer().encode("def fib(n):").ids), 3)
    assert out.text == "def fib(n):" + _decode(want)


def test_bad_fields(client):
    with pytest.raises(InvalidArgumentError) as e:
        client.generate(messages=[{"role": "robot", "content": "x"}])
    assert e.value.field == "messages"
    with pytest.raises(InvalidArgumentError) as e:
        list(client.stream(prompt_ids=[4], n=17))
    assert e.value.field == "n"
    with pytest.raises(InvalidArgumentError):
        client.generate("x", messages=MESSAGES)


def test_usage_reports_cached_tokens():
    chunk = wire.Chunk("r", (5,), finish_reason="length", num_prompt_tokens=3, num_output_tokens=1)
    msg = wire.chunk_to_proto(chunk)
    assert msg.usage.cached_tokens == 0 and msg.usage.prompt_tokens == 3
    assert pb.GenerateRequest(n=2, echo=True).n == 2


def test_logprobs_on_an_engine_without_them_is_invalid_argument(client):
    """The fake engine's tokens come from arithmetic: `logprobs` is refused, naming the field
    (real-model logprobs over gRPC: tests/test_serving_logprobs.py)."""
    with pytest.raises(InvalidArgumentError) as e:
        client.generate(prompt_ids=[4, 5, 6], max_tokens=2, logprobs=2)
    assert e.value.field == "logprobs"
    with pytest.raises(InvalidArgumentError) as e:
        client.generate(prompt_ids=[4, 5, 6], max_tokens=2, logprobs=21)
    assert e.value.field == "logprobs"
