"""The official `openai` Python package works unmodified against the server (completions and chat,
streaming and not, with an API key)."""

from __future__ import annotations

import pytest
from serving_helpers import expected_tokens, fake_controller, running_server, tiny_tokenizer

from jaxserve.serving.openai_protocol import ChatMessage, render_chat

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def client():
    controller = fake_controller(tokenizer=tiny_tokenizer(), first_device=6)
    with (
        running_server(controller, api_key=KEY) as server,
        openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0) as c,
    ):
        yield c


def _decode(ids: list[int]) -> str:
    return str(tiny_tokenizer().decode(ids, skip_special_tokens=True))


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["opt-tiny"]


def test_completions(client):
    prompt = "def fib(n):"
    want = expected_tokens(list(tiny_tokenizer().encode(prompt).ids), 6)
    out = client.completions.create(
        model="opt-tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == _decode(want) and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(
        model="opt-tiny", prompt=prompt, max_tokens=6, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in stream) == _decode(want)


def test_chat_completions(client):
    messages = [{"role": "user", "content": "Write a stack class."}]
    ids = list(tiny_tokenizer().encode(render_chat([ChatMessage.model_validate(m) for m in messages])).ids)
    want = _decode(expected_tokens(ids, 8))
    out = client.chat.completions.create(
        model="opt-tiny", messages=messages, max_completion_tokens=8, seed=1, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="opt-tiny",
        messages=messages,
        max_tokens=8,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == {0: want, 1: want}
    assert usage is not None and usage.completion_tokens == 16


def test_errors_become_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="opt-tiny", prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
