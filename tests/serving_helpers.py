"""Shared pieces of the serving tests: fake-engine controllers, servers on loopback, OpenAI's schema.

Not a test module (no `test_` prefix); the serving test files import it.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Literal

import jax
from pydantic import BaseModel, ConfigDict

from jaxserve.core.plan import parse_deployment
from jaxserve.runtime.api import ServingController
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.fake import FakeEngine
from jaxserve.serving.server import ServerConfig, ServerThread
from models.config import get_config

TINY = get_config("opt-tiny")


class PrefillGate:
    """Holds every prefill until the test opens it, and counts the prefills that began: an order without a clock."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.num_prefills = 0

    def pass_through(self) -> None:
        self.num_prefills += 1
        assert self.opened.wait(timeout=120), "the test never opened the prefill gate"


class SlowFakeEngine(FakeEngine):
    """The fake engine with a fixed delay per prefill and per decode step, so requests stay in flight."""

    def __init__(
        self,
        *args,
        prefill_delay_s: float = 0.0,
        decode_delay_s: float = 0.0,
        prefill_gate: PrefillGate | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.prefill_delay_s = prefill_delay_s
        self.decode_delay_s = decode_delay_s
        self.prefill_gate = prefill_gate

    def prefill(self, items):  # type: ignore[no-untyped-def]
        if self.prefill_gate is not None:
            self.prefill_gate.pass_through()
        time.sleep(self.prefill_delay_s)
        return super().prefill(items)

    def decode_step(self, batch, pages):  # type: ignore[no-untyped-def]
        time.sleep(self.decode_delay_s)
        return super().decode_step(batch, pages)


def fake_controller(
    spec: str = "disagg:prefill=tp1,decode=tp1",
    config: ControllerConfig | None = None,
    *,
    prefill_delay_s: float = 0.0,
    decode_delay_s: float = 0.0,
    first_device: int = 0,
    tokenizer: object | None = None,
    prefill_gate: PrefillGate | None = None,
) -> Controller:
    plan = parse_deployment(spec)

    def factory(inst, devices):  # type: ignore[no-untyped-def]
        return SlowFakeEngine(
            TINY,
            devices,
            tp=inst.tp,
            pp=inst.pp,
            prefill_delay_s=prefill_delay_s,
            decode_delay_s=decode_delay_s,
            prefill_gate=prefill_gate,
        )

    devices = jax.devices()[first_device : first_device + plan.num_devices]
    controller = Controller.from_plan("opt-tiny", plan, devices=devices, engine_factory=factory, config=config)
    controller.tokenizer = tokenizer
    return controller


@contextlib.contextmanager
def running_server(controller: ServingController, **config: object) -> Iterator[ServerThread]:
    """Both servers on 127.0.0.1, free ports; drained and stopped on exit."""
    cfg = ServerConfig(grpc_port=0, http_port=0, drain_timeout_s=5.0, **config)  # type: ignore[arg-type]
    server = ServerThread(controller, cfg).start()
    try:
        yield server
    finally:
        server.stop()


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample's value from a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels is None or all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


# ---- OpenAI's completion schema (as in openai-python's `types/completion*.py`), strict -----
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PromptTokensDetails(_Strict):
    audio_tokens: int | None = None
    cached_tokens: int | None = None


class CompletionUsage(_Strict):
    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Strict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Strict):
    finish_reason: Literal["stop", "length", "content_filter"]
    index: int
    logprobs: CompletionLogprobs | None = None
    text: str
    token_ids: list[int] | None = None  # jaxserve/vLLM extension, only with return_token_ids


class Completion(_Strict):
    id: str
    choices: list[CompletionChoice]
    created: int
    model: str
    object: Literal["text_completion"]
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None


class StreamChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class CompletionChunk(Completion):
    choices: list[StreamChoice]  # type: ignore[assignment]


# ---- OpenAI's chat completion schema (as in openai-python's `types/chat/chat_completion*.py`), strict ----
class ChatMessageOut(_Strict):
    role: Literal["assistant"]
    content: str | None


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Strict):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(_Strict):
    finish_reason: Literal["stop", "length", "content_filter"]
    index: int
    logprobs: ChatLogprobs | None = None
    message: ChatMessageOut
    token_ids: list[int] | None = None


class ChatCompletion(_Strict):
    id: str
    choices: list[ChatChoice]
    created: int
    model: str
    object: Literal["chat.completion"]
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None


class ChoiceDelta(_Strict):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Strict):
    delta: ChoiceDelta
    finish_reason: Literal["stop", "length", "content_filter"] | None
    index: int
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Strict):
    id: str
    choices: list[ChatStreamChoice]
    created: int
    model: str
    object: Literal["chat.completion.chunk"]
    usage: CompletionUsage | None = None


class ErrorDetail(_Strict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Strict):
    error: ErrorDetail


class Model(_Strict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Strict):
    object: Literal["list"]
    data: list[Model]


def parse_sse(text: str) -> tuple[list[dict], bool]:
    """The JSON payloads of an SSE body and whether it ended with `data: [DONE]`."""
    import json

    events = [block for block in text.split("\n\n") if block.strip()]
    payloads: list[dict] = []
    done = False
    for block in events:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        if data == "[DONE]":
            done = True
        else:
            assert not done, "event after [DONE]"
            payloads.append(json.loads(data))
    return payloads, done


def expected_tokens(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The fake engine's output with ignore_eos (see jaxserve.runtime.engines.fake.reference_tokens)."""
    from jaxserve.runtime.engines.fake import reference_tokens

    return reference_tokens(list(prompt), max_tokens, TINY.vocab_size)


@functools.cache
def tiny_tokenizer():  # type: ignore[no-untyped-def]
    """A byte-level BPE with exactly opt-tiny's 512 ids, trained in milliseconds on this package's source.

    Ids 0-3 are OPT's specials (`<s>`, `<pad>`, `</s>` = BOS/EOS, `<unk>`); encoding prepends `</s>`
    like OPT's tokenizer. Deterministic: same corpus, same merges.
    """
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    import jaxserve

    corpus = [p.read_text() for p in sorted(Path(jaxserve.__file__).parent.glob("*.py"))[:6]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY.vocab_size,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    assert tok.get_vocab_size() == TINY.vocab_size
    return tok


def pick_stop_string(text: str, start: int = 0, length: int = 3) -> tuple[str, int]:
    """A stop string that first occurs in `text` at or after `start` (no U+FFFD, not blank); (string, position).

    The tiny BPE is trained on this package's source, so outputs' text shifts when the
    source changes: tests derive their stop strings from the text instead of hard-coding them.
    """
    for at in range(max(start, 1), len(text) - length):
        s = text[at : at + length]
        if "\ufffd" not in s and s.strip() and text.find(s) == at:
            return s, at
    raise AssertionError(f"no usable stop string in {text!r}")
