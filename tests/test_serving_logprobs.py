"""`logprobs` / `top_logprobs` through the real servers (HTTP and gRPC on 127.0.0.1) and the official clients.

The server runs a random-weight OPT (`opt-tiny`, a Hugging Face checkpoint) disaggregated
(prefill tp1 -> KV hand-off -> decode tp1) with multi-step decoding (`decode_steps_per_call=4`), and
the tests' tiny BPE. Every logprob a client receives — completions, chat, streaming or not, gRPC — is
checked against Hugging Face's log_softmax of its own logits on the same tokens (greedy requests).
"""

from __future__ import annotations

import httpx
import jax
import numpy as np
import pytest
from serving_helpers import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ErrorBody,
    parse_sse,
    running_server,
    tiny_tokenizer,
)

from jaxserve.client import Client, InvalidArgumentError
from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.serving.openai_protocol import ChatMessage, render_chat
from jaxserve.testing.hf import hf_logprobs, make_hf_checkpoint, make_hf_model
from models.config import get_config

pytestmark = pytest.mark.timeout(300)

CFG = get_config("opt-tiny")
PROMPT = "def fib(n):"
MESSAGES = [{"role": "user", "content": "Write a stack class."}]
ABS = 2e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    path = make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-hf"), CFG, seed=3)
    config = ControllerConfig(
        limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64), decode_steps_per_call=4
    )
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    controller = Controller.from_plan(str(path), plan, devices=jax.devices()[4:6], config=config)
    controller.tokenizer = tiny_tokenizer()
    with running_server(controller) as s:
        yield s


@pytest.fixture(scope="module")
def hf_model():  # type: ignore[no-untyped-def]
    return make_hf_model(CFG, seed=3)


def _ids(text: str) -> list[int]:
    return list(tiny_tokenizer().encode(text).ids)


def _chat_ids() -> list[int]:
    return _ids(render_chat([ChatMessage.model_validate(m) for m in MESSAGES]))


def _text(token_id: int) -> str:
    return str(tiny_tokenizer().decode([token_id], skip_special_tokens=False))


def _check(
    hf_model: object, prompt: list[int], output: list[int], chosen: list[float], top: list[list[tuple[str, float]]]
) -> None:
    """`chosen[i]` is output[i]'s logprob and `top[i]` the most likely (token text, logprob) pairs, as transformers
    says. Texts, not ids: a byte-level BPE has several tokens whose lone text is U+FFFD."""
    expected = hf_logprobs(hf_model, prompt, output)
    assert len(chosen) == len(top) == len(output) > 0
    for row, tok, value, pairs in zip(expected, output, chosen, top, strict=True):
        assert value == pytest.approx(row[tok], abs=ABS)
        want = np.sort(row)[::-1][: len(pairs)]
        assert [v for _, v in pairs] == pytest.approx(want.tolist(), abs=ABS)
        for text, v in pairs:
            assert any(abs(row[i] - v) < ABS for i in range(CFG.vocab_size) if _text(i) == text)


def test_completions_logprobs_match_transformers(server, hf_model):  # type: ignore[no-untyped-def]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    body["return_token_ids"] = True
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = Completion.model_validate(r.json()).choices[0]
    output = choice.token_ids or []
    lp = choice.logprobs
    assert lp is not None and len(output) == 6
    assert lp.tokens == [_text(t) for t in output]
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(6)]
    assert all(1 <= len(d) <= 3 for d in lp.top_logprobs)  # 3 unless two of the top tokens share a text
    tops = [sorted(d.items(), key=lambda p: -p[1]) for d in lp.top_logprobs]
    _check(hf_model, _ids(PROMPT), output, lp.token_logprobs, [t if len(t) == 3 else [] for t in tops])

    # its own cache salt: the same prompt would otherwise hit the blocks the first request left in the prefix
    # cache (on by default), a different computation whose logprobs may differ in the last fp32 bit
    stream_body = {**body, "stream": True, "cache_salt": "streamed"}
    stream = httpx.post(f"{server.http_url}/v1/completions", json=stream_body, timeout=120)
    payloads, done = parse_sse(stream.text)
    assert done
    chunks = [CompletionChunk.model_validate(p).choices[0] for p in payloads]
    assert [t for c in chunks for t in c.token_ids or []] == output
    merged = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum(len(m.tokens) for m in merged) == sum(len(c.token_ids or []) for c in chunks)
    assert [v for m in merged for v in m.token_logprobs] == lp.token_logprobs  # the same numbers, streamed
    assert [o for m in merged for o in m.text_offset] == lp.text_offset  # offsets continue across chunks


def test_chat_logprobs_match_transformers(server, hf_model):  # type: ignore[no-untyped-def]
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    body |= {"logprobs": True, "top_logprobs": 4}
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = ChatCompletion.model_validate(r.json()).choices[0]
    output = choice.token_ids or []
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert [e.token for e in content] == [_text(t) for t in output]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    top = [[(x.token, x.logprob) for x in e.top_logprobs] for e in content]
    assert all(len(t) == 4 for t in top)
    _check(hf_model, _chat_ids(), output, [e.logprob for e in content], top)

    stream = httpx.post(f"{server.http_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    payloads, done = parse_sse(stream.text)
    assert done
    chunks = [ChatCompletionChunk.model_validate(p).choices[0] for p in payloads]
    streamed = [e for c in chunks if c.logprobs is not None for e in c.logprobs.content or []]
    # The same tokens; logprobs equal to fp32 rounding, not bit for bit: while the background warm-up compiles,
    # a batch may be stepped and sampled padded up to a compiled row count, and later on its own, and XLA:CPU's
    # reductions round differently per shape (a few 1e-7 here).
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], rel=1e-5, abs=1e-5)

    plain = httpx.post(
        f"{server.http_url}/v1/chat/completions", json={k: v for k, v in body.items() if "logprobs" not in k}
    )
    assert plain.json()["choices"][0]["logprobs"] is None  # not asked: none


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"logprobs": 1, "echo": True}, "logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_logprobs_get_400(server, path, extra, field):  # type: ignore[no-untyped-def]
    body = {"prompt": PROMPT} if path == "completions" else {"messages": MESSAGES}
    r = httpx.post(f"{server.http_url}/v1/{path}", json={**body, "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400
    assert ErrorBody.model_validate(r.json()).error.param == field


def test_openai_client_parses_logprobs(server, hf_model):  # type: ignore[no-untyped-def]
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
        )
        lp = out.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == 4 and all(len(d) == 2 for d in lp.top_logprobs)
        assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(4)]
        chat = client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 4
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
        output = [int(t) for t in chat.choices[0].model_extra["token_ids"]]  # type: ignore[index]
        top = [[(x.token, x.logprob) for x in e.top_logprobs] for e in content]
        _check(hf_model, _chat_ids(), output, [e.logprob for e in content], top)
        stream = client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = [e.logprob for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content or []]
        assert streamed == pytest.approx([e.logprob for e in content], rel=1e-5, abs=1e-5)  # see the chat test above
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True, top_logprobs=25)  # type: ignore[arg-type]
        assert "top_logprobs" in str(e.value)


def test_grpc_logprobs(server, hf_model):  # type: ignore[no-untyped-def]
    with Client(server.grpc_address) as client:
        prompt = [2, 100, 31, 7, 8]
        out = client.generate(prompt_ids=prompt, max_tokens=6, ignore_eos=True, logprobs=5)
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
        top = [[(_text(t), v) for t, v in x.top] for x in out.logprobs]
        _check(hf_model, prompt, list(out.token_ids), [x.logprob for x in out.logprobs], top)
        expected = hf_logprobs(hf_model, prompt, list(out.token_ids))  # gRPC carries ids: check them exactly
        for row, x in zip(expected, out.logprobs, strict=True):
            assert [t for t, _ in x.top] == np.argsort(-row, kind="stable")[:5].tolist()
        for chunk in client.stream(prompt_ids=prompt, max_tokens=6, ignore_eos=True, logprobs=0):
            assert chunk.logprobs is None or len(chunk.logprobs) == len(chunk.token_ids)
            assert all(x.top == () for x in chunk.logprobs or ())
        plain = client.generate(prompt_ids=prompt, max_tokens=3, ignore_eos=True)
        assert plain.logprobs is None and list(plain.token_ids) == list(out.token_ids[:3])
        for bad in (-1, 21):
            with pytest.raises(InvalidArgumentError) as e:
                client.generate(prompt_ids=prompt, max_tokens=2, logprobs=bad)
            assert e.value.field == "logprobs"
