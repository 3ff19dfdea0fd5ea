"""Llama-style models through the planner: the tp rule for grouped K/V heads, per-device sizes with split and
replicated K/V heads, the latency model's shapes, the KV transfer term, and `jaxserve plan` / `simulate` on a
Llama preset. Sizes are computed by hand from the published shapes (models/config.py presets)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxserve.cli import main
from jaxserve.core.plan import DeploymentPlan, InstanceSpec
from models.config import (
    LLAMA_PRESETS,
    PRESETS,
    LlamaConfig,
    ModelConfig,
    get_config,
    get_model_config,
    kv_heads_per_device,
    kv_heads_split,
    supports_tp,
    tp_problems,
)
from placement.context import build_base_workload, build_cluster, build_latency, build_options
from placement.hardware import GIB, ClusterSpec, DeviceSpec, get_device
from placement.latency import (
    LatencyProvider,
    attention_width,
    kv_bytes_per_token_per_device,
    kv_capacity_tokens,
    layer_gemm_macs,
    weight_bytes_per_device,
)
from placement.planner import choose_plan
from placement.search import SearchContext, instance_shapes, tp_degrees
from placement.simulator import SimOptions, simulate
from placement.slo import SloSpec
from placement.workload import Workload

A100 = get_device("a100-80gb")


# ---- the tp rule ---------------------------------------------------------------------------------------
def test_tp_rule_splits_or_replicates_kv_heads() -> None:
    l70 = get_model_config("llama-3.1-70b")  # 64 query heads, 8 K/V heads
    assert [tp for tp in range(1, 17) if supports_tp(l70, tp)] == [1, 2, 4, 8, 16]
    assert kv_heads_split(l70, 8) and not kv_heads_split(l70, 16)  # tp 16: every device holds all 8
    qwen = get_model_config("qwen2-7b")  # 28 query heads, 4 K/V heads
    assert tp_degrees(qwen, 8) == [1, 2, 4]
    assert "neither split" in " ".join(tp_problems(qwen, 7))  # 28 query heads split 7 ways, 4 K/V heads do not
    with pytest.raises(ValueError, match="neither split"):
        kv_heads_split(qwen, 6)
    tiny = get_model_config("llama-tiny")  # 4 query heads, 2 K/V heads
    assert [kv_heads_per_device(tiny, tp) for tp in (1, 2, 4)] == [2, 1, 2]  # tp 4 replicates them


def test_tp_rule_is_the_runtime_sharding_rule() -> None:
    """The planner's pure restatement agrees with `models.sharding.validate_parallelism` (what serve checks)."""
    from models.sharding import validate_parallelism

    configs: list[ModelConfig] = [*PRESETS.values(), *LLAMA_PRESETS.values()]
    for cfg in configs:
        for tp in range(1, 17):
            try:
                validate_parallelism(cfg, tp, 1)
                runtime_ok = True
            except ValueError:
                runtime_ok = False
            assert supports_tp(cfg, tp) == runtime_ok, (cfg.name, tp)


def test_one_lookup_for_both_families() -> None:
    l70 = get_model_config("llama-3.1-70b")
    assert isinstance(l70, LlamaConfig) and l70.num_kv_heads == 8
    assert get_model_config("meta-llama/llama-3.1-8b").name == "llama-3.1-8b"
    assert get_model_config("opt-66b") == get_config("opt-66b")
    assert get_model_config("13b", "float16") == get_config("opt-13b", "float16")
    with pytest.raises(KeyError, match=r"llama-3\.1-70b"):
        get_model_config("gpt-2")


# ---- sizes ---------------------------------------------------------------------------------------------
def test_kv_bytes_per_token_follow_kv_heads() -> None:
    l70, o66 = get_model_config("llama-3.1-70b", "float16"), get_config("opt-66b", "float16")
    assert l70.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB: 8 K/V heads of 128
    assert o66.kv_bytes_per_token == 2 * 64 * 9216 * 2 == 2_359_296  # 2.25 MiB: 72 heads of 128
    # per device: the K/V heads it stores, over the layers of its stage
    assert kv_bytes_per_token_per_device(l70, 8, 1) == 2 * 80 * 1 * 128 * 2
    assert kv_bytes_per_token_per_device(l70, 4, 2) == 2 * 40 * 2 * 128 * 2
    assert kv_bytes_per_token_per_device(l70, 16, 1) == 2 * 80 * 8 * 128 * 2  # replicated: all 8 heads
    assert kv_bytes_per_token_per_device(o66, 8, 1) == 2 * 64 * 9216 / 8 * 2


def test_memory_with_replicated_kv_heads() -> None:
    """llama-tiny (h 64, 4 query heads, 2 K/V heads of 16, SwiGLU 128, 2 layers, vocab 512) at tp 4: the k/v
    projections and the KV cache are whole on every device."""
    cfg = get_model_config("llama-tiny", "float16")
    q, kv, o, mlp, norms = 64 * 64, 2 * 64 * 32, 64 * 64, 3 * 64 * 128, 2 * 64
    assert cfg.num_layer_params == q + kv + o + mlp + norms == 36_992
    embeddings = 512 * 64 + 64 + 512 * 64  # tokens, final norm, untied LM head
    split_params = 2 * (36_992 - kv) + embeddings
    assert weight_bytes_per_device(cfg, 4, 1) == split_params * 2 / 4 + 2 * kv * 2 == 82_080
    assert weight_bytes_per_device(cfg, 2, 1) == (2 * 36_992 + embeddings) * 2 / 2  # split: all of it halves
    per_token = {tp: kv_bytes_per_token_per_device(cfg, tp, 1) for tp in (1, 2, 4)}
    assert per_token == {1: 256, 2: 128, 4: 256}
    device = DeviceSpec("small", 1e12, 1e11, 1 * GIB, 1e10, usable_memory_fraction=1.0)
    for tp in (1, 2, 4):
        expected = int((GIB - weight_bytes_per_device(cfg, tp, 1)) // per_token[tp])
        assert kv_capacity_tokens(cfg, device, tp, 1) == expected
    # tp 4 holds fewer KV tokens than tp 2: its devices replicate the K/V heads
    assert kv_capacity_tokens(cfg, device, 4, 1) < kv_capacity_tokens(cfg, device, 2, 1)


def test_llama_70b_shapes_that_fit_on_a100() -> None:
    """141 GB of fp16 weights: tp 1 cannot hold them, tp 2 leaves too little for one 131k-token sequence."""
    latency = LatencyProvider(get_model_config("llama-3.1-70b", "float16"), A100)
    ctx = SearchContext(latency, ClusterSpec(A100, 1, 8), build_base_workload("sharegpt", latency, 20), SloSpec(1, 1))
    ctx_pp1 = SearchContext(ctx.latency, ctx.cluster, ctx.workload, ctx.slo, max_pp=1)
    assert instance_shapes(ctx_pp1, "disagg", 8) == [(4, 1), (8, 1)]
    assert kv_capacity_tokens(latency.cfg, A100, 2, 1) < latency.cfg.max_position_embeddings


def test_latency_terms_use_the_generic_shape() -> None:
    l70, o13 = get_model_config("llama-3.1-70b", "float16"), get_config("opt-13b", "float16")
    h, q, kv, m = 8192, 8192, 1024, 28672
    assert layer_gemm_macs(l70, 8, 3) == 3 * (h * q + 2 * h * kv + q * h + 3 * h * m) / 8
    # tp 16 replicates k/v: each device does all of their multiply-adds
    assert layer_gemm_macs(l70, 16, 3) == 3 * (h * q + q * h + 3 * h * m) / 16 + 3 * 2 * h * kv
    assert attention_width(l70, 8) == q / 8 + 2 * 128  # 8 query heads read 1 K/V head of 128
    assert attention_width(l70, 16) == q / 16 + 2 * 128  # 4 query heads of one group: still 1 K/V head read
    h13, m13 = 5120, 20480
    assert layer_gemm_macs(o13, 2, 10) == 10 * (4 * h13 * h13 + 2 * h13 * m13) / 2  # OPT: unchanged
    assert attention_width(o13, 2) == 3 * h13 / 2


# ---- simulator: the KV transfer --------------------------------------------------------------------------
def _one_request_transfer_s(decode_tp: int) -> float:
    cfg = get_model_config("llama-tiny", "float16")
    cluster = ClusterSpec(A100, 1, 8)
    latency = LatencyProvider(cfg, A100)
    plan = DeploymentPlan((InstanceSpec("prefill", 1), InstanceSpec("decode", decode_tp))).assign_devices(8)
    one = Workload(np.array([0.0]), np.array([100]), np.array([4]), rate=1.0)
    result = simulate(plan, latency, cluster, one, None, SimOptions.planning(num_kv_blocks=64))
    return float(result.transfer_end_at[0] - result.transfer_start_at[0])


def test_transfer_moves_kv_bytes_per_token_and_copies_replicated_heads() -> None:
    cfg = get_model_config("llama-tiny", "float16")
    link = A100.link_bandwidth
    lat_s = ClusterSpec(A100).link_latency_s
    assert cfg.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # 2 layers x K,V x 2 heads x 16 x fp16
    # prefill tp1 -> decode tp2 (split): one device pair moves the request's KV once
    assert _one_request_transfer_s(2) == pytest.approx(lat_s + 100 * cfg.kv_bytes_per_token / link)
    # decode tp4 replicates the 2 K/V heads: each of its 4 devices needs all of them
    assert _one_request_transfer_s(4) == pytest.approx(lat_s + 4 * 100 * cfg.kv_bytes_per_token / link)


# ---- the planner and the CLI on Llama presets ------------------------------------------------------------
def test_plan_on_a_llama_preset_respects_the_tp_rule() -> None:
    latency = build_latency("qwen2-7b", "a100-80gb")
    cluster = build_cluster(latency, 1, 8)
    ctx = SearchContext(
        latency, cluster, build_base_workload("fixed:512:64", latency, 80), SloSpec(0.25, 0.05), build_options(),
        max_pp=1,
    )  # fmt: skip
    report = choose_plan(ctx, kind="auto", workers=1, seeds=0)
    assert report.plan.model == "qwen2-7b" and report.goodput_rps > 0
    tps = {c.plan.instances[0].tp for r in (report.disagg, report.colocated) if r for c in r.candidates}
    assert tps <= {1, 2, 4}  # 28 query heads, 4 K/V heads: tp 7 splits queries but not K/V
    assert all(supports_tp(latency.cfg, i.tp) for i in report.plan.instances)


def test_plan_cli_llama_json(capsys) -> None:
    argv = ["plan", "--model", "llama-3.1-8b", "--nodes", "1", "--devices-per-node", "4", "--workload", "fixed:256:32"]
    argv += ["--num-requests", "60", "--ttft", "0.25", "--tpot", "0.05", "--max-pp", "1", "--kind", "disagg"]
    argv += ["--workers", "1", "--no-progress", "--json", "--seeds", "0"]
    assert main(argv) == 0
    plan = DeploymentPlan.from_json(capsys.readouterr().out)
    assert plan.model == "llama-3.1-8b" and plan.kind == "disagg"
    assert all(i.tp in (1, 2, 4) for i in plan.instances)


def test_simulate_cli_llama_preset(capsys) -> None:
    argv = ["simulate", "--model", "llama-3.1-70b", "--nodes", "1", "--workload", "fixed:512:64"]
    argv += ["--num-requests", "60", "--deployment", "disagg:prefill=tp4,decode=tp4", "--rate", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_devices"] == 8 and out["num_finished"] == 60
    assert math.isfinite(out["ttft_s_p90"]) and out["transfer_mean_s"] > 0


def test_simulate_cli_refuses_a_tp_the_kv_heads_cannot_take(capsys) -> None:
    argv = ["simulate", "--model", "qwen2-7b", "--workload", "fixed:512:64", "--num-requests", "10"]
    argv += ["--deployment", "colocated:tp7", "--rate", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "qwen2-7b cannot be sharded tp7" in err and "K/V heads" in err
