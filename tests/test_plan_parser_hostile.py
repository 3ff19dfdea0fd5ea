"""The deployment-spec and plan parsers under hostile input: bounded, no files, PlanError for every bad value.

Specs and plans also arrive from the network (`POST /admin/deployment`), so the parsers must refuse
before they allocate per instance, never read a file a spec names, and say what is wrong with a
`PlanError` (the server's 400), never another exception (the server's 500).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.core.plan import MAX_PLAN_DEVICES, DeploymentPlan, PlanError, parse_deployment, parse_spec
from jaxserve.serving.admin import parse_plan_body

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "spec",
    [
        "colocated:1000000000xtp1",
        "disagg:prefill=1000000000xtp1,decode=tp1",
        "disagg:prefill=tp1,decode=99999999999999999999999999999999999999xtp1",
        "colocated:tp" + "9" * 5000,  # int() of this would raise ValueError (over 4300 digits)
        "colocated:4097xtp1",
        "colocated:tp64pp65",
        "colocated:" + "+".join(["tp1"] * 5000),
    ],
)
def test_huge_counts_are_refused_before_anything_is_built(spec: str) -> None:
    started = time.process_time()
    with pytest.raises(PlanError, match="devices"):
        parse_spec(spec)
    assert time.process_time() - started < 5.0  # generous: the point is 10^9 objects are never made


def test_the_bound_is_the_devices_there_are() -> None:
    assert parse_spec("disagg:prefill=2xtp2,decode=tp4", max_devices=8).num_devices == 8
    with pytest.raises(PlanError, match="at most 8 are available"):
        parse_spec("disagg:prefill=2xtp2,decode=tp4pp2", max_devices=8)
    assert parse_spec(f"colocated:{MAX_PLAN_DEVICES}xtp1").num_devices == MAX_PLAN_DEVICES
    body = json.dumps({"instances": [{"role": "colocated", "tp": 4}, {"role": "colocated", "tp": 8}]})
    with pytest.raises(PlanError, match="at most 8"):
        parse_plan_body(body.encode(), max_devices=8)
    many = json.dumps({"instances": [{"role": "colocated"}] * 9})
    with pytest.raises(PlanError, match="9 instances"):
        parse_plan_body(many.encode(), max_devices=8)


def test_a_spec_naming_a_file_is_never_read(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(parse_spec("disagg:prefill=tp1,decode=tp1").to_json())
    for body in (str(path), json.dumps({"deployment": str(path)}), json.dumps(str(path))):
        with pytest.raises(PlanError, match="names a plan file"):
            parse_plan_body(body.encode())
    with pytest.raises(PlanError, match="names a plan file"):
        parse_spec(str(path))
    assert parse_deployment(str(path)).describe() == "disagg:prefill=tp1,decode=tp1"  # the CLI's door reads it


@pytest.mark.parametrize(
    "body",
    [
        "colocated:tp1,chunk=\u00b2",  # str.isdigit() says yes, int() says no
        "colocated:tp\u0661",  # an Arabic-Indic one: a regex \d matches it
        "colocated:0xtp1",
        "colocated:tp0",
        '{"instances": 5}',
        '{"instances": [1, 2]}',
        '{"instances": [{"role": ["prefill"]}]}',
        '{"instances": [{"role": "colocated", "tp": "2"}]}',
        '{"instances": [{"role": "colocated", "tp": 1.5}]}',
        '{"instances": [{"role": "colocated", "tp": true}]}',
        '{"instances": [{"role": "colocated", "tp": null}]}',
        '{"instances": [{"role": "colocated", "tp": 1e400}]}',
        '{"instances": [{"role": "colocated", "tp": ' + "9" * 5000 + "}]}",
        '{"instances": [{"role": "colocated", "devices": [-1]}]}',
        '{"instances": [{"role": "colocated", "devices": 3}]}',
        '{"instances": [{"role": "colocated", "devices": ["a"]}]}',
        '{"instances": [{"role": "colocated", "nodes": {"0": 1}}]}',
        '{"instances": [{"role": "colocated", "chunk_size": "big"}]}',
        '{"instances": [{"role": "colocated"}], "expected": {"goodput": "high"}}',
        '{"instances": [{"role": "colocated"}], "expected": [1]}',
        '{"instances": [{"role": "colocated"}], "expected": {"rate": 1' + "0" * 400 + "}}",
        '{"instances": [{"role": "colocated", "chunk_size": 1' + "0" * 400 + "}]}",
        '{"instances": [{"role": "colocated"}], "model": 7}',
        '{"instances": [{"role": "colocated"}], "limits": [1]}',
        '{"instances": [{"role": "colocated"}], "limits": {"block_size": "x"}}',
        '{"instances": [{"role": "colocated"}], "kind": ["colocated"]}',
        '{"deployment": 5}',
        '{"instances": ' + "[" * 100_000 + "]" * 100_000 + "}",  # nesting past the recursion limit
        "\x00\xff\xfe",
    ],
)
def test_bad_values_are_plan_errors(body: str) -> None:
    with pytest.raises(PlanError):
        parse_plan_body(body.encode("utf-8", "surrogatepass"))


_SPEC_CHARS = "colocatedisg:prefl=,+xtp0123456789chunk\u00b2\u0661 .json"
_spec_text = st.text(alphabet=_SPEC_CHARS, max_size=60)
_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**400), 10**400), st.floats(), st.text(max_size=12),
    st.sampled_from(["prefill", "decode", "colocated", "tp", "pp", "devices", "instances", "kind", "limits"]),
)  # fmt: skip
_KEYS = ["role", "tp", "pp", "devices", "nodes", "chunk_size", "instances", "kind", "model", "expected", "limits", "x"]
_json_value = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from([*_KEYS, "deployment"]), inner, max_size=6)
    ),
    max_leaves=30,
)


def _only_plans_or_plan_errors(body: bytes, max_devices: int) -> None:
    try:
        plan = parse_plan_body(body, max_devices)
    except PlanError as e:
        assert str(e)  # a message that says why
        return
    assert isinstance(plan, DeploymentPlan) and 1 <= plan.num_devices <= max_devices


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_spec_text, max_devices=st.integers(1, 64))
def test_fuzzed_specs_give_a_plan_within_the_bound_or_a_plan_error(spec: str, max_devices: int) -> None:
    _only_plans_or_plan_errors(spec.encode(), max_devices)
    _only_plans_or_plan_errors(json.dumps({"deployment": spec}).encode(), max_devices)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=st.one_of(
        _json_value,
        st.fixed_dictionaries({"instances": st.lists(_json_value, max_size=4)}, optional={"kind": _json_value}),
    ),
    max_devices=st.integers(1, 64),
)
def test_fuzzed_json_bodies_give_a_plan_within_the_bound_or_a_plan_error(raw: object, max_devices: int) -> None:
    _only_plans_or_plan_errors(json.dumps(raw).encode(), max_devices)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=80))
def test_fuzzed_bytes_give_a_plan_error(body: bytes) -> None:
    _only_plans_or_plan_errors(body, 8)
