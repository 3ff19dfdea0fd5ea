"""OPT shapes against published sizes, Hugging Face config round trips, and the deployment spec parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError, parse_deployment
from models.config import PRESETS, OPTConfig, get_config

# Parameter counts of the published checkpoints, in millions (OPT paper, Table 1 naming).
_PUBLISHED_M = {
    "opt-125m": 125,
    "opt-350m": 331,
    "opt-1.3b": 1316,
    "opt-2.7b": 2652,
    "opt-6.7b": 6658,
    "opt-13b": 12853,
    "opt-30b": 29975,
    "opt-66b": 65718,
    "opt-175b": 174593,
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED_M))
def test_param_counts_match_published_checkpoints(name: str) -> None:
    count_m = PRESETS[name].num_params / 1e6
    assert count_m == pytest.approx(_PUBLISHED_M[name], rel=0.01)


def test_opt_13b_derived_sizes_by_hand() -> None:
    cfg = get_config("opt-13b", dtype="float16")
    assert cfg.head_dim == 128
    # K and V, 40 layers, 5120 wide, 2 bytes.
    assert cfg.kv_bytes_per_token == 2 * 40 * 5120 * 2
    matmuls = 40 * (4 * 5120**2 + 2 * 5120 * 20480) + 50272 * 5120
    assert cfg.flops_per_token(0) == 2 * matmuls
    assert cfg.flops_per_token(100) - cfg.flops_per_token(0) == 40 * 4 * 5120 * 100


def test_presets_by_alias_and_errors() -> None:
    assert get_config("13b") is PRESETS["opt-13b"]
    assert get_config("facebook/opt-350m").word_embed_proj_dim == 512
    with pytest.raises(KeyError, match="unknown model preset"):
        get_config("opt-7b")
    with pytest.raises(ValueError, match="not divisible"):
        OPTConfig(name="bad", hidden_size=10, ffn_dim=4, num_layers=1, num_heads=3)


def test_hf_config_round_trip(tmp_path: Path) -> None:
    for cfg in (PRESETS["opt-tiny"], PRESETS["opt-tiny-postln"], PRESETS["opt-350m"]):
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
        back = OPTConfig.from_hf_config(tmp_path, name=cfg.name)
        assert back == cfg
    with pytest.raises(ValueError, match="model_type"):
        OPTConfig.from_hf_config({"model_type": "llama", "hidden_size": 8})


def test_hf_config_matches_transformers_fields() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = PRESETS["opt-tiny-postln"]
    hf = transformers.OPTConfig(
        **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("model_type", "architectures")}
    )
    assert OPTConfig.from_hf_config(hf.to_dict(), name=cfg.name) == cfg


def test_parse_specs() -> None:
    plan = parse_deployment("disagg:prefill=2xtp1,decode=tp2pp2")
    assert plan.kind == "disagg"
    assert [(i.role, i.tp, i.pp) for i in plan.instances] == [
        ("prefill", 1, 1),
        ("prefill", 1, 1),
        ("decode", 2, 2),
    ]
    assert plan.num_devices == 6
    assert plan.describe() == "disagg:prefill=2xtp1,decode=tp2pp2"
    colo = parse_deployment("colocated:tp2,chunk=256")
    assert colo.kind == "colocated" and colo.instances[0].chunk_size == 256
    assert colo.describe() == "colocated:tp2,chunk=256"


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "colocated",
        "colocated:tp0",
        "colocated:tp2,chunk=0",
        "colocated:tp2,chunks=4",
        "disagg:prefill=tp1",
        "disagg:prefill=tp1,decode=tp1,prefill=tp2",
        "disagg:prefill=tpx,decode=tp1",
        "mixed:tp1",
        "missing.json",
    ],
)
def test_bad_specs_raise_plan_error(spec: str) -> None:
    with pytest.raises(PlanError):
        parse_deployment(spec)


def test_device_assignment_and_json_round_trip(tmp_path: Path) -> None:
    plan = parse_deployment("disagg:prefill=tp2,decode=tp1pp2").assign_devices(num_available=8)
    assert [i.devices for i in plan.instances] == [(0, 1), (2, 3)]
    assert plan.instances[1].stage_devices(1) == (3,)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert parse_deployment(str(path)) == plan
    with pytest.raises(PlanError, match="only 3 are available"):
        parse_deployment("disagg:prefill=tp2,decode=tp2").assign_devices(num_available=3)


def test_per_phase_quantization_round_trips_and_is_checked(tmp_path: Path) -> None:
    plan = DeploymentPlan(
        instances=(InstanceSpec("prefill", quantization="w8a8"), InstanceSpec("decode", quantization="int4"))
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    again = parse_deployment(str(path))
    assert [i.quantization for i in again.instances] == ["w8a8", "int4"]
    assert "quantization" not in InstanceSpec("colocated").to_dict()  # the checkpoint's own precision
    with pytest.raises(PlanError, match="unknown quantization 'int3'"):
        DeploymentPlan.from_dict({"instances": [{"role": "colocated", "quantization": "int3"}]})
    with pytest.raises(PlanError, match="unknown quantization 8"):
        DeploymentPlan.from_dict({"instances": [{"role": "colocated", "quantization": 8}]})


def test_plan_validation() -> None:
    with pytest.raises(PlanError, match="disjoint"):
        DeploymentPlan(
            instances=(InstanceSpec("prefill", devices=(0,)), InstanceSpec("decode", devices=(0,))),
        )
    with pytest.raises(PlanError, match="needs 2 devices"):
        InstanceSpec("decode", tp=2, devices=(0,))
    with pytest.raises(PlanError, match="unknown plan fields"):
        DeploymentPlan.from_dict({"instances": [{"role": "colocated"}], "extra": 1})


def test_planner_contracts_import_no_jax() -> None:
    code = (
        "import sys, models.config, jaxserve.core.plan, jaxserve.core.scheduling;"
        "bad = [m for m in ('jax', 'flax') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
