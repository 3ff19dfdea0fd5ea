"""Stop semantics as vLLM documents them, through both APIs (real servers, fake engine, tiny BPE).

* A stop string's text is left out of the output, unless `include_stop_str_in_output`.
* A stop token id's text stays in the output, unless the token is special (EOS and the like
  are never rendered); the token id itself is always the last one returned.
"""

from __future__ import annotations

import httpx
import pytest
from serving_helpers import expected_tokens, fake_controller, pick_stop_string, running_server, tiny_tokenizer

from jaxserve.client import Client

pytestmark = pytest.mark.timeout(120)

PROMPT = [4, 5, 6]
SPECIAL_PROMPT = [17, 18, 19]  # the fake engine's 22nd output token for this prompt is 0 (`<s>`, special)
SPECIAL_AT = 21


@pytest.fixture(scope="module")
def server():
    with running_server(fake_controller(tokenizer=tiny_tokenizer(), first_device=5)) as s:
        yield s


def _full_text(prompt: list[int], n: int) -> str:
    return str(tiny_tokenizer().decode(expected_tokens(prompt, n), skip_special_tokens=True))


def _http(server, **body) -> dict:  # type: ignore[no-untyped-def]
    r = httpx.post(f"{server.http_url}/v1/completions", json={"return_token_ids": True, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_left_out_unless_included(server, include):
    full = _full_text(PROMPT, 30)
    stop, at = pick_stop_string(full, start=len(full) // 3)
    want = full[: at + len(stop)] if include else full[:at]
    choice = _http(server, prompt=PROMPT, max_tokens=30, ignore_eos=True, stop=stop, include_stop_str_in_output=include)
    assert (choice["text"], choice["finish_reason"]) == (want, "stop")
    with Client(server.grpc_address) as c:
        out = c.generate(
            prompt_ids=PROMPT, max_tokens=30, ignore_eos=True, stop=stop, include_stop_str_in_output=include
        )
    assert (out.text, out.finish_reason) == (want, "stop")


def test_stop_token_text_stays_in_the_output(server):
    ids = expected_tokens(PROMPT, 30)
    k = 5
    assert ids[k] >= 4 and ids[k] not in ids[:k]  # an ordinary token, first seen here
    want_text = str(tiny_tokenizer().decode(ids[: k + 1], skip_special_tokens=True))
    assert want_text != str(tiny_tokenizer().decode(ids[:k], skip_special_tokens=True))  # it renders to something
    choice = _http(server, prompt=PROMPT, max_tokens=30, ignore_eos=True, stop_token_ids=[ids[k]])
    assert (choice["token_ids"], choice["text"], choice["finish_reason"]) == (ids[: k + 1], want_text, "stop")
    with Client(server.grpc_address) as c:
        out = c.generate(prompt_ids=PROMPT, max_tokens=30, ignore_eos=True, stop_token_ids=[ids[k]])
    assert (list(out.token_ids), out.text, out.finish_reason) == (ids[: k + 1], want_text, "stop")


def test_special_stop_token_is_never_rendered(server):
    ids = expected_tokens(SPECIAL_PROMPT, 30)
    special = ids[SPECIAL_AT]
    assert special < 4 and all(t >= 4 for t in ids[:SPECIAL_AT])
    want_text = str(tiny_tokenizer().decode(ids[:SPECIAL_AT], skip_special_tokens=True))
    choice = _http(server, prompt=SPECIAL_PROMPT, max_tokens=30, ignore_eos=True, stop_token_ids=[special])
    assert choice["token_ids"] == ids[: SPECIAL_AT + 1]
    assert (choice["text"], choice["finish_reason"]) == (want_text, "stop")
    assert tiny_tokenizer().id_to_token(special) not in choice["text"]
    with Client(server.grpc_address) as c:
        out = c.generate(prompt_ids=SPECIAL_PROMPT, max_tokens=30, ignore_eos=True, stop_token_ids=[special])
    assert (list(out.token_ids), out.text) == (ids[: SPECIAL_AT + 1], want_text)
