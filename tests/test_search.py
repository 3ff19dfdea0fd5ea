"""Placement search on a constructed case whose optimum is known, plus counts and device placement."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError
from models.config import get_config
from placement.goodput import base_workload
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, load_profile
from placement.search import (
    SearchContext,
    _fill_counts,
    algorithm1,
    algorithm2,
    assign_nodes,
    colocated_search,
    ratio_search,
)
from placement.slo import SloSpec

A100 = get_device("a100-80gb")

# A constructed profile (ms): prefill takes a fixed time per prompt. tp1 needs 300 ms, beyond the
# 200 ms TTFT SLO even on an idle instance; tp2 needs 40 ms and tp4 30 ms, so tp4 serves at most 1.33x
# the rate of tp2 on 2x the devices: prefill tp2 is the per-device optimum. Decode: 10 ms a round on
# tp1, 9 on tp2, 8.5 on tp4, plus 0.05 ms a request: tp1 is the per-device optimum.
CONSTRUCTED = {
    "name": "constructed",
    "entries": [
        {
            "engine": e,
            "model": "opt-13b",
            "tp": tp,
            "prefill": [p, 0, 0],
            "decode_small": [d, 0, 0.05],
            "decode_large": [d, 0, 0.05],
        }
        for e in ("disagg", "colocated")
        for tp, p, d in ((1, 300.0, 10.0), (2, 40.0, 9.0), (4, 30.0, 8.5))
    ],
}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> SearchContext:
    path = tmp_path_factory.mktemp("profiles") / "constructed.json"
    path.write_text(json.dumps(CONSTRUCTED))
    latency = LatencyProvider(get_config("opt-13b", "float16"), A100, load_profile(str(path)))
    workload = base_workload("fixed:512:16", 300, seed=0)
    return SearchContext(latency, ClusterSpec(A100, 1, 4), workload, SloSpec(0.2, 0.05), max_pp=1)


def test_algorithm1_finds_the_constructed_optimum(ctx: SearchContext) -> None:
    result = algorithm1(ctx, rate=30.0, workers=1)
    by_label = {c.label: c for c in result.candidates}
    assert set(by_label) == {f"{k} tp{tp}" for k in ("prefill", "decode") for tp in (1, 2, 4)}
    assert by_label["prefill tp1"].goodput_rps == 0.0  # infeasible at any rate
    assert by_label["prefill tp2"].per_device > by_label["prefill tp4"].per_device
    assert by_label["decode tp1"].per_device > max(by_label["decode tp2"].per_device, by_label["decode tp4"].per_device)
    prefill, decode = result.plan.of_role("prefill"), result.plan.of_role("decode")
    assert {i.shape for i in prefill} == {"tp2"} and {i.shape for i in decode} == {"tp1"}
    assert len(prefill) == math.ceil(30.0 / by_label["prefill tp2"].goodput_rps)
    assert len(decode) == math.ceil(30.0 / by_label["decode tp1"].goodput_rps)
    # A prefill-only instance with a fixed 40 ms service serves at most 25 rps.
    assert 10.0 < by_label["prefill tp2"].goodput_rps <= 25.0


def test_algorithm1_is_deterministic_across_worker_counts(ctx: SearchContext) -> None:
    serial = algorithm1(ctx, workers=1)
    parallel = algorithm1(ctx, workers=2)
    assert [c.goodput_rps for c in serial.candidates] == [c.goodput_rps for c in parallel.candidates]
    assert serial.plan == parallel.plan
    # Without a rate the cluster (4 devices) is the budget: one tp2 prefill and the decode instances left.
    assert serial.plan.describe() in ("disagg:prefill=tp2,decode=tp1", "disagg:prefill=tp2,decode=2xtp1")


def test_algorithm2_pairs_segments_on_one_node(ctx: SearchContext) -> None:
    result = algorithm2(ctx, workers=1)
    labels = [c.label for c in result.candidates]
    assert labels == [
        "disagg:prefill=tp1,decode=tp1",
        "disagg:prefill=tp1,decode=tp2",
        "disagg:prefill=tp2,decode=tp1",
        "disagg:prefill=tp2,decode=tp2",
    ]  # tp_p + tp_d <= 4 devices per node; tp4 leaves no room for the other phase
    assert result.plan.describe() == "disagg:prefill=tp2,decode=tp1"


def test_colocated_and_ratio_searches(ctx: SearchContext) -> None:
    colocated = colocated_search(ctx, workers=1)
    assert [c.label for c in colocated.candidates] == ["colocated:tp1", "colocated:tp2", "colocated:tp4"]
    assert colocated.candidates[0].goodput_rps == 0.0
    ratio = ratio_search(ctx, InstanceSpec("prefill", 2), InstanceSpec("decode", 1), max_devices=5, workers=1)
    assert [c.label for c in ratio.candidates] == [
        "disagg:prefill=tp2,decode=tp1",
        "disagg:prefill=tp2,decode=2xtp1",
        "disagg:prefill=tp2,decode=3xtp1",
        "disagg:prefill=2xtp2,decode=tp1",
    ]
    best = max(ratio.candidates, key=lambda c: c.per_device)
    assert ratio.plan == best.plan


def test_fill_counts_by_hand() -> None:
    # g_p = 4 rps on 2 devices, g_d = 6 rps on 1 device, 8 devices: 3 prefill + 2 decode serve
    # min(12, 12) = 12 rps on 8 devices = 1.5 rps/device, the best split.
    assert _fill_counts(4.0, 2, 6.0, 1, 8) == (3, 2, 1.5)
    assert _fill_counts(4.0, 8, 6.0, 1, 8) is None


def test_place_keeps_tp_groups_and_stage_pairs_on_nodes() -> None:
    cluster = ClusterSpec(A100, 2, 4)
    plan = DeploymentPlan((InstanceSpec("prefill", 2, 2), InstanceSpec("decode", 1, 1), InstanceSpec("decode", 2, 1)))
    placed = assign_nodes(plan, cluster)
    assert [i.devices for i in placed.instances] == [(0, 1, 2, 3), (4,), (5, 6)]
    assert [i.nodes for i in placed.instances] == [(0, 0), (1,), (1,)]
    paired = assign_nodes(
        DeploymentPlan((InstanceSpec("prefill", 2, 2), InstanceSpec("decode", 1, 2))), cluster, pair_stages=True
    )
    assert [i.devices for i in paired.instances] == [(0, 1, 4, 5), (2, 6)]
    assert [i.nodes for i in paired.instances] == [(0, 1), (0, 1)]
    with pytest.raises(PlanError):
        assign_nodes(DeploymentPlan((InstanceSpec("prefill", 4, 2), InstanceSpec("decode", 4, 1))), cluster)
    assert np.all(np.diff(paired.instances[0].devices) > 0)
