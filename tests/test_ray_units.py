"""The Ray backend's pure parts, without a cluster: leases, peer checks, placement from a plan, the watchdog, the
checks a pulled KV passes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from jaxserve.core.plan import DeploymentPlan, InstanceSpec, PlanError
from jaxserve.runtime.controller import ControllerConfig
from jaxserve.runtime.engines.contract import StageKV
from jaxserve.runtime.kv_connectors.base import KVIntegrityError, PullFailureConfig
from jaxserve.runtime.kv_connectors.ray_pull import (
    LeasedKVBuffer,
    PullError,
    check_arrival,
    check_positions,
    fingerprint_of,
    manifest,
    run_with_watchdog,
)
from jaxserve.runtime.ray_backend.actors import IncompatiblePeerError, ModelSignature, check_compatible
from jaxserve.runtime.ray_backend.deployment import LaunchInputs, RayConfig
from jaxserve.runtime.ray_backend.placement_groups import ResourceConfig, bundle, group_by_node
from models.config import get_config


def _kv() -> tuple[StageKV, ...]:
    return (StageKV(k=np.zeros((1, 4, 2, 1)), v=np.ones((1, 4, 2, 1))),)  # type: ignore[arg-type]


def test_lease_expires_unless_renewed() -> None:
    buf = LeasedKVBuffer(lease_s=2.0)
    buf.put("a", _kv(), now=0.0)
    buf.put("b", _kv(), now=0.0)
    assert buf.renew(["a", "zzz"], now=1.5) == 1  # a now lives until 3.5, b until 2.0
    assert buf.expire(now=2.5) == ["b"]
    assert len(buf) == 1 and buf.num_expired == 1
    assert buf.take("b", now=2.5) is None
    assert buf.take("a", now=3.0) is not None
    assert len(buf) == 0 and buf.num_pulled == 1


def test_take_after_lease_end_counts_as_expired_and_cancel_frees() -> None:
    buf = LeasedKVBuffer(lease_s=1.0)
    buf.put("a", _kv(), now=0.0)
    assert buf.take("a", now=1.01) is None  # the reaper had not run yet: still refused
    assert buf.num_expired == 1 and len(buf) == 0
    buf.put("c", _kv(), now=5.0)
    assert buf.cancel(["c", "c", "nope"]) == 1
    assert len(buf) == 0 and buf.num_cancelled == 1


def test_peer_check_names_every_difference() -> None:
    tiny = ModelSignature.of(get_config("opt-tiny"), "float32", 16)
    assert tiny == ModelSignature.of(get_config("opt-tiny"), "float32", 16)
    check_compatible(tiny, tiny, "prefill-0", "decode-0")
    other = ModelSignature.of(get_config("opt-125m"), "bfloat16", 32)
    with pytest.raises(IncompatiblePeerError) as e:
        check_compatible(tiny, other, "prefill-0", "decode-0")
    msg = str(e.value)
    assert "prefill-0 and decode-0 cannot exchange KV caches" in msg
    for field in ("model", "dtype", "num_layers", "num_heads", "head_size", "block_size"):
        assert f"{field}:" in msg


def test_low_affinity_plan_groups_pairs_by_node() -> None:
    plan = DeploymentPlan(
        instances=(
            InstanceSpec("prefill", tp=2, nodes=(0,)),
            InstanceSpec("prefill", tp=2, nodes=(1,)),
            InstanceSpec("decode", tp=1, nodes=(0,)),
            InstanceSpec("decode", tp=1, nodes=(1,)),
        )
    )
    assert group_by_node(plan) == {0: [0, 2], 1: [1, 3]}
    cfg = ResourceConfig(num_cpus_per_actor=0.5, use_gpus=True, node_resource_prefix="node")
    assert bundle(plan.instances[1], cfg) == {"CPU": 0.5, "GPU": 2.0, "node1": 0.001}
    assert group_by_node(DeploymentPlan(instances=(InstanceSpec("prefill"), InstanceSpec("decode")))) == {}


def test_instance_spanning_nodes_is_refused() -> None:
    plan = DeploymentPlan(instances=(InstanceSpec("prefill", pp=2, nodes=(0, 1)), InstanceSpec("decode", nodes=(0,))))
    with pytest.raises(PlanError, match="one actor per instance"):
        group_by_node(plan)


def test_watchdog_frees_the_caller_from_a_stuck_pull() -> None:
    release = threading.Event()
    with pytest.raises(PullError, match="watchdog"):
        run_with_watchdog(lambda: release.wait(30), timeout_s=0.2, what="stuck pull")
    release.set()
    assert run_with_watchdog(lambda: 41 + 1, timeout_s=5, what="quick") == 42
    with pytest.raises(PullError, match="boom"):
        run_with_watchdog(lambda: (_ for _ in ()).throw(ValueError("boom")), timeout_s=5, what="failing")


_NEVER_REGISTERED = """
import os, time
from jaxserve.runtime.kv_connectors.ray_pull import ArraySpec, JaxTicket, PullError, pull_staged, run_with_watchdog
from jaxserve.runtime.kv_connectors.ray_pull import start_transfer_server
producer, consumer = start_transfer_server(), start_transfer_server()
ticket = JaxTicket(producer.address(), 12345, (ArraySpec((4, 4), "float32"),))  # never registered
started = time.monotonic()
try:
    run_with_watchdog(lambda: pull_staged(consumer, ticket, timeout_s=0.5), 2.0, "unregistered")
    print("returned")
except PullError as e:
    print(f"watchdog after {time.monotonic() - started:.1f} s: {e}")
os._exit(0)  # the abandoned pull thread is still blocked in native code
"""


@pytest.mark.slow
def test_watchdog_bounds_a_jax_pull_of_an_id_nobody_registers() -> None:
    """jax.experimental.transfer: a pull of an id the producer never registers overruns its own timeout."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _NEVER_REGISTERED], capture_output=True, text=True, env=env, timeout=120, check=True
    ).stdout
    assert "watchdog after 2." in out and "no answer within 2.0 s" in out, out


def test_a_pulled_kv_is_checked_against_what_was_sent() -> None:
    """`check_arrival` (the decode actor, on every pull): the sender's manifest (shapes, dtypes) and, when it sent
    one, its fingerprint; `check_positions`: the positions the request needs. Each refusal names the request."""
    rng = np.random.default_rng(0)
    sent = tuple(
        StageKV(k=rng.standard_normal((2, 8, 2, 4)).astype(np.float32), v=rng.standard_normal((2, 8, 2, 4)).astype(np.float32))  # type: ignore[arg-type]
        for _ in range(2)
    )  # fmt: skip
    specs, fp = manifest(sent), fingerprint_of(sent)
    check_arrival(sent, specs, fp, "r", "prefill-0")  # as sent: fine, with or without the checksum
    check_arrival(sent, specs, None, "r", "prefill-0")
    check_positions(sent, 8, "r")
    damaged = {
        "truncated": (sent[0], StageKV(k=sent[1].k[:, :3], v=sent[1].v)),
        "dtype": (StageKV(k=sent[0].k.astype(np.float16), v=sent[0].v), sent[1]),
        "a stage lost": (sent[0],),
        "contents": (StageKV(k=sent[0].k + 1.0, v=sent[0].v), sent[1]),
    }
    for why, kv in damaged.items():
        expected = "checksum mismatch" if why == "contents" else "arrived"
        with pytest.raises(KVIntegrityError, match=f"the KV of 'r' from prefill-0 .*{expected}"):
            check_arrival(kv, specs, fp, "r", "prefill-0")  # type: ignore[arg-type]
    check_arrival(damaged["contents"], specs, None, "r", "prefill-0")  # type: ignore[arg-type]  # no checksum
    with pytest.raises(KVIntegrityError, match=r"the KV of 'r' \(stage 0, k\) arrived truncated: .* 9 positions"):
        check_positions(sent, 9, "r")  # the sender's KV itself is short


def test_the_actors_read_the_controllers_pull_knobs() -> None:
    """One knob for both backends: the actors get the controller's checksum and pull-failure policy."""
    default = LaunchInputs.of("m", "float32", RayConfig(), ControllerConfig()).pulls
    assert (default.checksum, default.failure) == (False, PullFailureConfig(1, "recompute"))
    policy = PullFailureConfig(num_retries=0, on_failure="fail")
    pulls = LaunchInputs.of("m", "float32", RayConfig(), ControllerConfig(kv_checksum=True, pull_failure=policy)).pulls
    assert (pulls.checksum, pulls.failure) == (True, policy)
