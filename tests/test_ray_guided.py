"""Guided decoding on the Ray backend, on a real local Ray cluster: the prefill and decode engines run in actor
processes, each with a `GuidedDecoder` of its own built from the controller's tokenizer (nothing else travels: a
matcher is replayed from the tokens each call carries). A guided request gives the embedded deployment's output,
token for token, and the output is valid against its schema.
"""

from __future__ import annotations

import json
import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import pytest
from ray_cluster import local_cluster
from serving_helpers import tiny_tokenizer

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, GuidedSpec, SamplingParams
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.testing.hf import make_hf_checkpoint
from models.config import get_config

ray = pytest.importorskip("ray")

from jaxserve.runtime.ray_backend.deployment import RayConfig, RayController  # noqa: E402
from jaxserve.runtime.ray_backend.placement_groups import ResourceConfig  # noqa: E402

pytestmark = pytest.mark.timeout(900)
CFG = get_config("opt-tiny")
PLAN = "disagg:prefill=tp1,decode=tp1"
CONFIG = ControllerConfig(limits=ServingLimits(num_kv_blocks=64, block_size=16, max_decode_batch=4))
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 50}, "kind": {"enum": ["x", "yy", "zzz"]}},
    "required": ["id", "kind"],
}
PROMPTS = [(2, 100, 31, 7, 8), (2, 5, 6, 300, 301, 302, 17)]


def _requests(tag: str) -> list[GenerateRequest]:
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA), strict=True)
    return [
        GenerateRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=40, temperature=1.0, seed=20 + i, guided=spec))
        for i, p in enumerate(PROMPTS)
    ]


def _run(controller: Controller, tag: str) -> list[list[int]]:
    controller.tokenizer = tiny_tokenizer()
    streams = [controller.submit(r) for r in _requests(tag)]
    return [s.collect(timeout_s=300)[0] for s in streams]


def test_a_guided_request_on_ray_actors_matches_embedded(tmp_path) -> None:
    checkpoint = str(make_hf_checkpoint(tmp_path / "opt-tiny-hf", CFG, seed=5))
    with Controller.from_plan(checkpoint, parse_deployment(PLAN), config=CONFIG) as embedded:
        reference = _run(embedded, "ref")
    with local_cluster(4):
        rc = RayConfig(resources=ResourceConfig(num_cpus_per_actor=0.5))
        controller = RayController.launch(checkpoint, parse_deployment(PLAN), CONFIG, rc)
        controller.start()
        try:
            assert _run(controller, "ray") == reference
        finally:
            controller.shutdown(drain_timeout_s=5)
    tok = tiny_tokenizer()
    for ids in reference:
        value = json.loads(tok.decode([t for t in ids if t not in CFG.eos_token_ids]))
        assert set(value) == {"id", "kind"} and value["kind"] in ("x", "yy", "zzz")
