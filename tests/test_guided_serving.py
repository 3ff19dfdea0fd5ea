"""Structured outputs (`response_format`) through the real HTTP server, with the official `openai` package, on
a tiny random-weight model (opt-tiny's shapes, the real `ModelEngine`, a 512-id BPE): every output parses and is
valid against its schema (an independent validator, `jsonschema`), colocated and disaggregated, chat and
completions, streaming and not, greedy and sampled, `n > 1`; logprobs are those of the masked distribution;
bad schemas are a 400 and the server goes on."""

from __future__ import annotations

import json

import jax
import pytest
from serving_helpers import running_server, tiny_tokenizer

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.runtime.controller import Controller, ControllerConfig

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


def _controller(spec: str, first_device: int) -> Controller:
    plan = parse_deployment(spec)
    devices = jax.devices()[first_device : first_device + plan.num_devices]
    config = ControllerConfig(limits=ServingLimits(block_size=16, num_kv_blocks=64))
    controller = Controller.from_plan("opt-tiny", plan, devices=devices, config=config)  # random weights
    controller.tokenizer = tiny_tokenizer()
    return controller


@pytest.fixture(scope="module", params=sorted(DEPLOYMENTS))
def client(request):
    spec, first = DEPLOYMENTS[request.param]
    with (
        running_server(_controller(spec, first)) as server,
        openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0) as c,
    ):
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
    # The grammar allows only an opening brace first: every alternative is one, and they hold all the mass.
    assert first.top_logprobs and all(alt.token.startswith("{") for alt in first.top_logprobs)
    assert sum(2.718281828459045**alt.logprob for alt in first.top_logprobs) == pytest.approx(1.0, abs=1e-3)
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
