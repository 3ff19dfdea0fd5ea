"""One typed front boundary: the servers take a `ServingController`, metrics read `controller.stats()` only."""

from __future__ import annotations

import httpx
from serving_helpers import fake_controller, metric_value, running_server

from jaxserve.runtime.api import ControllerStats, FaultStats, InstanceStats, ServingController
from jaxserve.serving.metrics import ServingMetrics


def test_metrics_show_instance_and_fault_stats_exactly_as_the_controller_reports_them():
    stats = ControllerStats(
        instances=(
            InstanceStats("prefill", "prefill-0", True, 3, 1, num_prefill_buffer_used=2, prefill_buffer_capacity=8),
            InstanceStats("decode", "decode-0", False, 4, 5, num_kv_blocks_used=6, num_kv_blocks_free=7),
        ),
        num_live_requests=9,
        num_transfers=0,
        kv_transfer_bytes=0,
        faults=FaultStats(
            num_failed_pulls=11,
            num_pull_retries=12,
            num_recomputed=13,
            num_expired_leases=14,
            num_rerouted_requests=15,
            num_instance_restarts=16,
        ),
    )
    text = ServingMetrics(stats=lambda: stats).render().decode()
    p, d = {"instance": "prefill-0", "role": "prefill"}, {"instance": "decode-0", "role": "decode"}
    assert metric_value(text, "jaxserve:num_requests_waiting", p) == 3
    assert metric_value(text, "jaxserve:num_requests_running", p) == 1
    assert metric_value(text, "jaxserve:prefill_buffer_used", p) == 2
    assert metric_value(text, "jaxserve:prefill_buffer_capacity", p) == 8
    assert metric_value(text, "jaxserve:instance_alive", p) == 1
    assert metric_value(text, "jaxserve:num_requests_waiting", d) == 4
    assert metric_value(text, "jaxserve:num_requests_running", d) == 5
    assert metric_value(text, "jaxserve:kv_blocks_used", d) == 6
    assert metric_value(text, "jaxserve:kv_blocks_free", d) == 7
    assert metric_value(text, "jaxserve:instance_alive", d) == 0
    for name, value in (
        ("kv_pull_failures", 11),
        ("kv_pull_retries", 12),
        ("kv_recomputed", 13),
        ("kv_leases_expired", 14),
        ("requests_rerouted", 15),
        ("instance_restarts", 16),
    ):
        assert metric_value(text, f"jaxserve:{name}_total") == value, name


def test_embedded_controller_is_a_serving_controller_and_its_fault_counters_reach_metrics():
    controller: ServingController = fake_controller(first_device=6)  # mypy checks the Protocol here
    stats = controller.stats()
    assert isinstance(stats.faults, FaultStats)
    assert [type(s) for s in stats.instances] == [InstanceStats, InstanceStats]
    with running_server(controller) as server:
        text = httpx.get(f"http://{server.http_address}/metrics").text
    # The embedded backend exports the same fault counters as the Ray backend (zero here).
    assert "# TYPE jaxserve:kv_pull_failures_total counter" in text
    assert metric_value(text, "jaxserve:kv_pull_failures_total") == 0
    assert metric_value(text, "jaxserve:num_requests_waiting", {"instance": "decode-0"}) == 0
