"""The checked-in gRPC stubs are what `grpc_tools.protoc` makes of `jaxserve.proto`, and wire conversion round-trips."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import RequestTimings, TokenLogprobs
from jaxserve.proto import PROTO_PATH
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.serving import wire

GENERATED = ("jaxserve_pb2.py", "jaxserve_pb2.pyi", "jaxserve_pb2_grpc.py")
# Version stamps differ between grpcio-tools releases without changing the schema.
_VERSION_LINES = re.compile(r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|\s*\d+,\s*$)", re.MULTILINE)


def test_checked_in_stubs_match_a_fresh_protoc_run(tmp_path: Path):
    from grpc_tools import protoc

    src = tmp_path / "jaxserve" / "proto"
    src.mkdir(parents=True)
    shutil.copy(PROTO_PATH, src / "jaxserve.proto")
    rc = protoc.main(
        [
            "protoc",
            f"-I{tmp_path}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(src / "jaxserve.proto"),
        ]
    )
    assert rc == 0
    for name in GENERATED:
        fresh = (src / name).read_text()
        checked_in = (PROTO_PATH.parent / name).read_text()
        assert _VERSION_LINES.sub("", fresh) == _VERSION_LINES.sub("", checked_in), (
            f"jaxserve/proto/{name} is stale: regenerate it (see jaxserve/proto/__init__.py)"
        )


def test_request_round_trip_keeps_unset_fields_unset():
    req = wire.request_to_proto(prompt_ids=[2, 3], max_tokens=5, temperature=0.0, stop="\n")
    params = wire.params_from_proto(pb.GenerateRequest.FromString(req.SerializeToString()))
    assert params.prompt_token_ids == (2, 3) and params.prompt_text is None
    assert params.prompt_field == "prompt_token_ids"
    assert params.sampling.max_tokens == 5 and params.sampling.temperature == 0.0
    assert params.sampling.top_p == 1.0 and params.sampling.seed is None
    assert params.stop == ("\n",)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(prompt="a", prompt_token_ids=[1]), "prompt"),
        (pb.GenerateRequest(prompt="a", stop=[""]), "stop"),
        (pb.GenerateRequest(prompt="a", stop=["x"] * 17), "stop"),
        (pb.GenerateRequest(prompt="a", stop_token_ids=list(range(65))), "stop_token_ids"),
    ],
)
def test_request_shape_errors_name_the_field(message, field):
    with pytest.raises(InvalidRequestError) as e:
        wire.params_from_proto(message)
    assert e.value.field == field


def test_unknown_fields_are_refused():
    raw = pb.GenerateRequest(prompt_token_ids=[5]).SerializeToString() + bytes([0x98, 0x06, 0x05])  # field 99 = 5
    with pytest.raises(InvalidRequestError) as e:
        wire.params_from_proto(pb.GenerateRequest.FromString(raw))
    assert e.value.field == "#99"


def test_chunk_and_timings_round_trip():
    t = RequestTimings(arrival_at=10.0, prefill_start_at=10.5, prefill_end_at=11.0, transfer_start_at=11.0)
    t.transfer_end_at, t.decode_start_at, t.first_token_at, t.finished_at = 11.25, 11.5, 11.0, 13.0
    t.token_times, t.kv_transfer_bytes, t.kv_transfer_s = [11.0, 12.0, 13.0], 4096, 0.25
    timings = wire.Timings.from_request_timings(t)
    assert (timings.ttft_s, timings.tpot_s, timings.e2e_s) == (1.0, 1.0, 3.0)
    assert (timings.prefill_queue_s, timings.prefill_s, timings.decode_queue_s) == (0.5, 0.5, 0.25)
    chunk = wire.Chunk("r1", (7, 8), "ab", "length", timings, num_prompt_tokens=3, num_output_tokens=3)
    back = wire.chunk_from_proto(pb.GenerateResponse.FromString(wire.chunk_to_proto(chunk).SerializeToString()))
    assert back == chunk
    assert back.timings is not None and math.isclose(back.timings.inter_token_latencies_s[0], 1.0)


def test_logprobs_round_trip():
    """`logprobs` set travels (0 included: each token's own logprob, no alternatives); unset stays unset;
    each response's `TokenLogprobs` come back as sent (values exactly representable in a double)."""
    for k in (0, 3):
        req = wire.request_to_proto(prompt_ids=[2, 3], logprobs=k)
        assert wire.params_from_proto(pb.GenerateRequest.FromString(req.SerializeToString())).sampling.logprobs == k
    assert wire.params_from_proto(wire.request_to_proto(prompt_ids=[2])).sampling.logprobs is None
    lps = (TokenLogprobs(-0.5, ((7, -0.5), (9, -1.25))), TokenLogprobs(-2.0, ((4, -0.75), (8, -2.0))))
    chunk = wire.Chunk("r1", (7, 8), "ab", logprobs=lps, num_output_tokens=2)
    back = wire.chunk_from_proto(pb.GenerateResponse.FromString(wire.chunk_to_proto(chunk).SerializeToString()))
    assert back == chunk
    plain = wire.Chunk("r1", (7,), "a", num_output_tokens=1)
    assert wire.chunk_from_proto(wire.chunk_to_proto(plain)).logprobs is None


def test_deployment_round_trip():
    plan = parse_deployment("disagg:prefill=2xtp1,decode=tp2").assign_devices()
    m = wire.deployment_to_proto(plan, ["prefill-0", "prefill-1", "decode-0"])
    assert [i.devices for i in m.instances] == [[0], [1], [2, 3]]
    assert wire.deployment_from_proto(m) == plan
