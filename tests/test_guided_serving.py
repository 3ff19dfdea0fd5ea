"""Structured outputs (`response_format`) through the real HTTP server, with the official `openai` package, on
a tiny random-weight model (opt-tiny's shapes, the real `ModelEngine`, a 512-id BPE): every output parses and is
valid against its schema (an independent validator, `jsonschema`), colocated and disaggregated, chat and
completions, streaming and not, greedy and sampled, `n > 1`; logprobs are those of the masked distribution;
bad schemas are a 400 and the server goes on."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import pytest
from serving_helpers import running_server, tiny_tokenizer

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.testing.hf import make_hf_checkpoint
from models.config import get_config

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(600)

# The test set: objects, arrays, enums, bounded numbers, nested objects, optional fields. Strings are bounded
# (a random model, free inside a string, would otherwise write until max_tokens).
SCHEMAS = {
    "object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["point", "tags"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 3},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["id"],
    },
}
DEPLOYMENTS = {"colocated": ("colocated:tp1", 4), "disagg": ("disagg:prefill=tp1,decode=tp1", 5)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """Random opt-tiny weights with 1024 positions (a tools system message takes ~400 of the tiny BPE's tokens)."""
    cfg = dataclasses.replace(get_config("opt-tiny"), max_position_embeddings=1024)
    return str(make_hf_checkpoint(tmp_path_factory.mktemp("guided") / "opt-tiny-1k", cfg, seed=11))


def _controller(checkpoint: str, spec: str, first_device: int) -> Controller:
    plan = parse_deployment(spec)
    devices = jax.devices()[first_device : first_device + plan.num_devices]
    config = ControllerConfig(limits=ServingLimits(block_size=16, num_kv_blocks=128))
    controller = Controller.from_plan(checkpoint, plan, devices=devices, config=config)
    controller.tokenizer = tiny_tokenizer()  # the checkpoint has none; its 512 ids are the model's
    return controller


@pytest.fixture(scope="module", params=sorted(DEPLOYMENTS))
def server(request, checkpoint):
    spec, first = DEPLOYMENTS[request.param]
    with running_server(_controller(checkpoint, spec, first), model_name="opt-tiny") as s:
        yield s


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def _schema_format(name: str, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": strict}}


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_output_is_valid_against_its_schema(client, name):
    out = client.chat.completions.create(
        model="opt-tiny",
        messages=[{"role": "user", "content": f"Give me {name} JSON."}],
        max_tokens=120,
        temperature=1.0,
        seed=7,
        n=2,
        response_format=_schema_format(name),
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        _valid(choice.message.content, SCHEMAS[name])


@pytest.mark.parametrize("name", ["nested", "optional"])
def test_completions_greedy_and_streamed_are_valid_and_equal(client, name):
    kwargs = {"model": "opt-tiny", "prompt": "def f(x):", "max_tokens": 120, "temperature": 0}
    body = {"response_format": _schema_format(name, strict=False)}
    out = client.completions.create(**kwargs, extra_body=body)
    assert out.choices[0].finish_reason == "stop"
    _valid(out.choices[0].text, SCHEMAS[name])
    stream = client.completions.create(**kwargs, stream=True, extra_body=body)
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text


def test_chat_stream_json_object(client):
    stream = client.chat.completions.create(
        model="opt-tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=200,
        temperature=0.7,
        seed=3,
        stream=True,
        response_format={"type": "json_object"},
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a random model may write one long string: whatever it wrote is still the start of an object
        assert finish == "length" and text.startswith("{")


def test_logprobs_are_of_the_masked_distribution(client):
    out = client.chat.completions.create(
        model="opt-tiny",
        messages=[{"role": "user", "content": "an enum"}],
        max_tokens=60,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        response_format=_schema_format("enum"),
    )
    content = out.choices[0].logprobs.content
    first = content[0]
    # The grammar allows only an opening brace first: every possible alternative is one, and they hold all the
    # mass; the masked tokens have probability 0 (reported as vLLM does, at the JSON floor -9999).
    possible = [alt for alt in first.top_logprobs if alt.logprob > -9999.0]
    assert possible and all(alt.token.startswith("{") for alt in possible)
    assert all(alt.logprob == -9999.0 for alt in first.top_logprobs if alt not in possible)
    assert sum(math.exp(alt.logprob) for alt in possible) == pytest.approx(1.0, abs=1e-3)
    _valid(out.choices[0].message.content, SCHEMAS["enum"])


@pytest.mark.parametrize(
    ("response_format", "says"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}, "'not'"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}, "invalid schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema"),
        ({"type": "xml"}, "response_format"),
    ],
)
def test_bad_schemas_are_400_and_the_server_goes_on(client, response_format, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="opt-tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=8,
            response_format=response_format,
        )
    assert says in str(e.value)
    out = client.chat.completions.create(
        model="opt-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=60, temperature=0,
        response_format=_schema_format("enum"),
    )  # fmt: skip
    _valid(out.choices[0].message.content, SCHEMAS["enum"])


# ---- forced tool calls (the generic format: tools in a system message, the output constrained to the call) ----

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, names=("get_weather", "add")) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_a_named_tool_choice_forces_that_call(client):
    out = client.chat.completions.create(
        model="opt-tiny",
        messages=ASK,
        max_tokens=80,
        temperature=0,
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], names=("add",))


def test_required_calls_one_of_the_tools_sampled_and_streamed(client):
    out = client.chat.completions.create(
        model="opt-tiny", messages=ASK, max_tokens=80, temperature=1.0, seed=5, n=3,
        tools=[WEATHER, ADD], tool_choice="required",
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        _check_call(choice.message.tool_calls[0])
    stream = client.chat.completions.create(
        model="opt-tiny", messages=ASK, max_tokens=80, temperature=0, stream=True,
        tools=[WEATHER, ADD], tool_choice="required",
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():  # accumulated as OpenAI's clients do
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] in PARAMS
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])


def test_a_tool_result_follow_up_renders_and_answers(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    plain = client.chat.completions.create(
        model="opt-tiny", messages=messages, max_tokens=5, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    again = client.chat.completions.create(
        model="opt-tiny", messages=messages, max_tokens=80, temperature=0, tools=[WEATHER], tool_choice="required"
    )
    _check_call(again.choices[0].message.tool_calls[0], names=("get_weather",))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"tools": [WEATHER]}, "auto"),  # tool_choice defaults to auto with tools
        ({"tools": [WEATHER], "tool_choice": "auto"}, "auto"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
          "tool_choice": "required"}, "'not'"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400(client, kwargs, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="opt-tiny", messages=ASK, max_tokens=8, **kwargs)
    assert says in str(e.value)


# ---- the same option on gRPC (proto field), through the Python client ----


def test_grpc_client_response_format(server):
    from jaxserve.client import Client, InvalidArgumentError

    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMAS["nested"], "strict": True}}
    with Client(server.grpc_address) as c:
        out = c.generate(prompt="def f(x):", max_tokens=120, temperature=0.8, seed=2, response_format=fmt)
        assert out.finish_reason == "stop"
        _valid(out.text, SCHEMAS["nested"])
        streamed = "".join(ch.text for ch in c.stream(prompt="def f(x):", max_tokens=120, temperature=0.8, seed=2,
                                                        response_format=fmt))  # fmt: skip
        assert streamed == out.text
        with pytest.raises(InvalidArgumentError, match="'uniqueItems'") as e:
            c.generate(prompt="x", max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                "schema": {"type": "array", "uniqueItems": True}}})  # fmt: skip
        assert e.value.field == "response_format"
        # a forced tool call (proto fields `tools`, `tool_choice`): the reply is the call, parsed
        forced = c.generate(messages=ASK, tools=[WEATHER, ADD], tool_choice="add", max_tokens=80, temperature=0)
        assert forced.finish_reason == "stop" and [t.name for t in forced.tool_calls] == ["add"]
        jsonschema.validate(json.loads(forced.tool_calls[0].arguments), PARAMS["add"])
        with pytest.raises(InvalidArgumentError, match="auto") as e:
            c.generate(messages=ASK, tools=[WEATHER], max_tokens=8)
        assert e.value.field == "tool_choice"
