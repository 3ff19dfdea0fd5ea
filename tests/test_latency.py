"""Latency and memory model: per-shard sizes by hand, the folded profile, pipelines, profile files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from models.config import get_config
from placement.hardware import ClusterSpec, get_device
from placement.latency import (
    AppendixCoefficients,
    LatencyProvider,
    Profile,
    ProfileError,
    allreduce_bytes_per_device,
    builtin_profiles,
    kv_bytes_per_token_per_device,
    kv_capacity_tokens,
    layer_gemm_flops,
    layer_gemm_macs,
    layer_kv_read_bytes,
    layer_weight_bytes,
    load_profile,
    pipeline_decode_round_s,
    pipeline_prefill_s,
    weight_bytes_per_device,
)

OPT13B = get_config("opt-13b", "float16")
A100 = get_device("a100-80gb")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_opt13b_per_shard_sizes_by_hand(tp: int) -> None:
    # h = 5120, m = 20480. One layer: QKV 5120x15360, out 5120x5120, FFN 5120x20480 and 20480x5120
    # = 78,643,200 + 26,214,400 + 104,857,600 + 104,857,600 = 314,572,800 weights, 1/tp per shard.
    weights = 314_572_800
    assert layer_gemm_macs(OPT13B, tp, 1) == weights / tp
    assert layer_gemm_flops(OPT13B, tp, 512) == 2 * 512 * weights / tp
    assert layer_weight_bytes(OPT13B, tp) == 2 * weights / tp  # fp16
    # K and V of 1,000 context tokens over the shard's 5120/tp channels, 2 bytes each.
    assert layer_kv_read_bytes(OPT13B, tp, 1000) == 2 * (5120 / tp) * 1000 * 2
    # Ring all-reduce of 512 tokens x 5120 fp16 activations: each device sends 2(tp-1)/tp of it.
    assert allreduce_bytes_per_device(OPT13B, tp, 512) == {1: 0, 2: 5_242_880, 4: 7_864_320}[tp]
    # KV per token per device: 2 (K, V) x 40 layers x 5120/tp x 2 bytes.
    assert kv_bytes_per_token_per_device(OPT13B, tp, 1) == 819_200 / tp


def test_opt13b_weight_bytes_by_hand() -> None:
    # 40 layers x (314,572,800 GEMM weights + 46,080 biases and LayerNorm params) + embeddings:
    # 50272 x 5120 tokens + 2050 x 5120 positions + 2 x 5120 final LayerNorm = 12,853,473,280 params.
    layer = 314_572_800 + 4 * 5120 + 20480 + 5120 + 4 * 5120
    params = 40 * layer + 50272 * 5120 + 2050 * 5120 + 2 * 5120
    assert params == 12_853_473_280
    assert weight_bytes_per_device(OPT13B, 1, 1) == 2 * params
    assert weight_bytes_per_device(OPT13B, 2, 1) == params
    # pp = 3: the heaviest stage holds ceil(40/3) = 14 layers and (conservatively) the embeddings.
    assert weight_bytes_per_device(OPT13B, 1, 3) == 2 * (14 * layer + 50272 * 5120 + 2050 * 5120 + 2 * 5120)


@pytest.mark.parametrize(
    ("model", "tp", "reference"),
    [("opt-13b", 1, 66_144), ("opt-13b", 2, 163_008), ("opt-66b", 4, 78_496), ("opt-175b", 8, 59_520)],
)
def test_kv_capacity_close_to_distserve_artifact(model: str, tp: int, reference: int) -> None:
    got = kv_capacity_tokens(get_config(model, "float16"), A100, tp, 1)
    assert abs(got - reference) / reference < 0.025


def test_kv_capacity_zero_when_weights_do_not_fit() -> None:
    assert kv_capacity_tokens(get_config("opt-175b", "float16"), A100, 1, 1) == 0


def test_folded_profile_numbers_are_the_published_ones() -> None:
    lp = LatencyProvider(OPT13B, A100, load_profile("a100-80gb-distserve"))
    dist = lp.instance("disagg", 1, 1)
    # 18.1 + 0.1019 * 512 + 7.122e-6 * 512^2 ms
    assert dist.prefill_stage_s(512, 512**2, 1) == pytest.approx((18.1 + 0.1019 * 512 + 7.122e-6 * 512**2) / 1000)
    # Two prompts: Σl = 768, Σl² = 512² + 256².
    assert dist.prefill_stage_s(768, 512**2 + 256**2, 2) == pytest.approx(
        (18.1 + 0.1019 * 768 + 7.122e-6 * (512**2 + 256**2)) / 1000
    )
    # Decode regimes split at batch 95.
    assert dist.decode_stage_s(94, 94_000) == pytest.approx((19.93 + 0.0006269 * 94_000 + 0.03851 * 94) / 1000)
    assert dist.decode_stage_s(95, 95_000) == pytest.approx((7.166 + 0.0005798 * 95_000 + 0.1583 * 95) / 1000)
    coloc = lp.instance("colocated", 2, 1)
    assert coloc.prefill_stage_s(100, 100**2, 1) == pytest.approx((27.44 + 0.09055 * 100 + 8.452e-06 * 100**2) / 1000)
    assert lp.supports("disagg", 4) and not lp.supports("disagg", 8)
    with pytest.raises(ProfileError, match="tp8"):
        lp.instance("disagg", 8, 1)


def test_pipeline_is_not_a_division() -> None:
    lp = LatencyProvider(OPT13B, A100, load_profile("a100-80gb-distserve"))
    one = lp.instance("disagg", 1, 1)
    two = lp.instance("disagg", 1, 2, stage_link_bandwidth=100e9)
    full = one.prefill_stage_s(512, 512**2, 1)
    # Each stage does half the work, but the batch still crosses both stages and one send.
    assert two.prefill_stage_s(512, 512**2, 1) == pytest.approx(full / 2)
    send = 10e-6 + 512 * 5120 * 2 / 100e9
    assert pipeline_prefill_s(two, np.array([512])) == pytest.approx(full + send)
    # Decode: 8 requests split in 2 micro-batches of 4; a round crosses both stages.
    round_s = pipeline_decode_round_s(two, 8, 8 * 600.0)
    stage = (19.93 + 0.0006269 * 4 * 600 + 0.03851 * 4) / 1000 / 2
    assert round_s == pytest.approx(2 * (stage + 10e-6 + 4 * 5120 * 2 / 100e9))
    # One request cannot be split: it waits for both stages.
    assert pipeline_decode_round_s(two, 1, 600.0) == pytest.approx(
        2 * ((19.93 + 0.0006269 * 600 + 0.03851) / 1000 / 2 + 10e-6 + 5120 * 2 / 100e9)
    )


def test_roofline_appendix_model_by_hand() -> None:
    cluster = ClusterSpec(A100, 1, 8)
    lp = LatencyProvider(OPT13B, A100, None, intra_node_bandwidth=cluster.nvlink_bandwidth)
    c = AppendixCoefficients.roofline(A100, 2)
    assert math.isclose(c.C1, 2 / (312e12 * 0.6))
    assert math.isclose(c.C4, 2 / (2.0e12 * 0.75))
    m1 = lp.instance("disagg", 1, 1)
    m2 = lp.instance("disagg", 2, 1)
    t = 1024
    gemm1 = 40 * c.C1 * 314_572_800 * t
    attn1 = 40 * c.C2 * 3 * 5120 * t * t / 16
    head1 = c.C1 * 50272 * 5120
    assert m1.prefill_stage_s(t, t * t, 1) == pytest.approx(gemm1 + attn1 + head1 + c.C3)
    # tp2: half the GEMM, attention and head, plus two all-reduces a layer.
    ar = 2 * (1 / 2) * t * 5120 * 2 / A100.link_bandwidth + 2 * 10e-6
    assert m2.prefill_stage_s(t, t * t, 1) == pytest.approx((gemm1 + attn1 + head1) / 2 + 40 * 2 * ar + c.C3)
    # Decode at batch 1 reads every weight once: bandwidth bound.
    d1 = m1.decode_stage_s(1, 1000.0)
    expected = 40 * (c.C4 * 314_572_800 + c.C5 * 3 * 5120 * 1000) + c.C4 * 50272 * 5120 + c.C3
    assert d1 == pytest.approx(expected)


def test_profile_file_appendix_form_and_errors(tmp_path) -> None:
    path = tmp_path / "p.json"
    entry = {
        "engine": "any",
        "model": "opt-13b",
        "tp": 1,
        "C1": 1e-14,
        "C2": 1e-12,
        "C3": 0.01,
        "C4": 1e-12,
        "C5": 1e-12,
        "L_m": 384,
    }
    path.write_text(json.dumps({"name": "mine", "entries": [entry]}))
    profile = load_profile(str(path))
    lp = LatencyProvider(OPT13B, A100, profile)
    assert lp.supports("disagg", 1) and lp.supports("colocated", 1) and not lp.supports("disagg", 2)
    assert lp.prefill_token_budget("disagg", 1) == 384
    model = lp.instance("disagg", 1, 1)
    assert model.decode_stage_s(1, 0.0) == pytest.approx(40 * 1e-12 * 314_572_800 + 1e-12 * 50272 * 5120 + 0.01)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": [{"model": "opt-13b", "tp": 1, "prefill": [1, 2]}]}))
    with pytest.raises(ProfileError):
        load_profile(str(bad))
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("no-such-profile")
    assert "a100-80gb-distserve" in builtin_profiles()


def test_kv_transfer_dominates_only_across_nodes() -> None:
    # The paper's example: 512 tokens of OPT-66B KV is ~1.13 GB (fp16 K and V of 64 layers).
    opt66 = get_config("opt-66b", "float16")
    nbytes = 512 * opt66.kv_bytes_per_token
    assert nbytes == pytest.approx(1.208e9, rel=0.01)  # 1.13 GiB
    cluster = ClusterSpec(A100, 2, 8)
    assert cluster.transfer_s(nbytes, 0, 1) == pytest.approx(10e-6 + nbytes / (25e9 / 8))
    assert cluster.transfer_s(nbytes, 0, 0) < cluster.transfer_s(nbytes, 0, 1) / 50
    assert math.isclose(cluster.transfer_s(nbytes, 0, 1), 0.3866, rel_tol=0.01)


def test_profile_entry_with_engine_padding_charges_padded_shapes(tmp_path) -> None:
    entry = {
        "engine": "disagg",
        "model": "opt-13b",
        "tp": 1,
        "C1": 1e-14,
        "C2": 1e-12,
        "C3": 0.01,
        "C4": 1e-12,
        "C5": 1e-12,
    }
    padded = {**entry, "engine_padding": {"min_prompt_tokens": 16, "block_size": 16, "min_table_blocks": 4}}
    plain_model = LatencyProvider(OPT13B, A100, Profile.from_dict({"entries": [entry]})).instance("disagg", 1, 1)
    model = LatencyProvider(OPT13B, A100, Profile.from_dict({"entries": [padded]})).instance("disagg", 1, 1)
    # 5 rows of context 100: the engine computes 8 rows over 8 blocks (128 slots, the next token's
    # slot included) each; 3 prompts of 100 tokens are computed as 4 rows of 128.
    assert model.decode_stage_s(5, 500.0) == pytest.approx(plain_model.decode_stage_s(8, 8 * 128.0))
    assert model.prefill_stage_s(300.0, 3 * 100.0**2, 3) == pytest.approx(
        plain_model.prefill_stage_s(4 * 128.0, 4 * 128.0**2, 4)
    )
    assert model.decode_stage_s(5, 500.0) > plain_model.decode_stage_s(5, 500.0)
    with pytest.raises(ProfileError, match="engine_padding"):
        Profile.from_dict({"entries": [{**entry, "engine_padding": {"rows": 2}}]})
