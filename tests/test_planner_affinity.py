"""High node affinity (Algorithm 1) never returns less than low affinity (Algorithm 2) on the same cluster: every
node-local pair Algorithm 2 may use is a placement Algorithm 1 may use too (issue 12's OPT-175B case)."""

from __future__ import annotations

import pytest

from placement.context import build_base_workload, build_cluster, build_latency, build_options, build_slo
from placement.planner import choose_plan
from placement.search import SearchContext, assign_nodes

pytestmark = pytest.mark.slow


def test_high_affinity_never_loses_to_low_affinity_opt175b() -> None:
    latency = build_latency("opt-175b", "a100-80gb")
    slo = build_slo(4.0, 0.2, 0.9, "joint")
    assert slo is not None
    cluster = build_cluster(latency, 4, 8)
    ctx = SearchContext(latency, cluster, build_base_workload("sharegpt", latency, 200), slo, build_options())
    high = choose_plan(ctx, kind="disagg", affinity="high", workers=2)
    low = choose_plan(ctx, kind="disagg", affinity="low", workers=2)
    assert high.goodput_per_device >= low.goodput_per_device * (1 - 1e-9)
    # Whatever it chose fits the nodes (each stage's tp group inside one node).
    assert assign_nodes(high.plan, cluster) is not None
