"""The Ray backend on a real local Ray cluster: two simulated nodes, loopback only.

One cluster for this module (`ray.cluster_utils.Cluster`, a head and a second
node, custom resources `node0` / `node1`), one 1-prefill (tp2) + 1-decode (tp1)
deployment of the tiny OPT shared by the parity, lease and kill tests, and a
fake-engine deployment for the two-node placement.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

# Ray reads this when it is imported: without it, it binds the machine's network address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import jax
import numpy as np
import pytest
import test_kv_transfer as conformance
from jax.sharding import PartitionSpec
from ray_cluster import local_cluster

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import DeploymentPlan, InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, RequestTimings, SamplingParams
from jaxserve.llm import LLM
from jaxserve.runtime.controller import AdmissionConfig, Controller, ControllerConfig, WarmupConfig
from jaxserve.runtime.engines.contract import EngineCapabilities, PrefillItem
from jaxserve.runtime.engines.fake import FakeEngine, reference_tokens
from jaxserve.runtime.prefill_instance import PrefillConfig, PrefillInstance
from jaxserve.serving.metrics import ServingMetrics

ray = pytest.importorskip("ray")

from jaxserve.runtime.kv_connectors.base import PullFailureConfig  # noqa: E402
from jaxserve.runtime.kv_connectors.ray import ObjectStoreTransfer  # noqa: E402
from jaxserve.runtime.kv_connectors.ray_pull import ActorPulls, TransferConfig  # noqa: E402
from jaxserve.runtime.ray_backend.actors import (  # noqa: E402
    DecodeActor,
    EngineSpec,
    IncompatiblePeerError,
    PrefillActor,
    PullOrder,
)
from jaxserve.runtime.ray_backend.deployment import (  # noqa: E402
    RayActors,
    RayConfig,
    RayController,
    actor_env,
)
from jaxserve.runtime.ray_backend.placement_groups import ResourceConfig  # noqa: E402
from jaxserve.runtime.ray_backend.remote_engine import RemotePrefillEngine  # noqa: E402
from jaxserve.runtime.switch import PlanSwitcher  # noqa: E402
from jaxserve.runtime.worker import FaultCounters, LiveRequest  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "opt-tiny"
PLAN = "disagg:prefill=tp2,decode=tp1"
NUM_REQUESTS = 32
MAX_TOKENS = 12
CONFIG = ControllerConfig(
    limits=ServingLimits(num_kv_blocks=96, block_size=16, max_decode_batch=8, max_batch_tokens=64)
)
LEASE_S = 2.0


def _prompts() -> list[tuple[int, ...]]:
    rng = np.random.default_rng(7)
    return [tuple(int(t) for t in rng.integers(4, 500, size=int(rng.integers(3, 20)))) for _ in range(NUM_REQUESTS)]


def _requests(tag: str, seeded: bool = False) -> list[GenerateRequest]:
    def sampling(i: int) -> SamplingParams:
        if seeded:  # random sampling, reproducible per request
            return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 + i, ignore_eos=True)
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    return [GenerateRequest(f"{tag}-{i}", p, sampling(i)) for i, p in enumerate(_prompts())]


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(4, resources={"node0": 4}, extra_nodes=[{"num_cpus": 4, "resources": {"node1": 4}}]) as c:
        yield c


RAY_CONFIG = RayConfig(
    transfer=TransferConfig(lease_s=LEASE_S, pull_timeout_s=20.0),
    resources=ResourceConfig(num_cpus_per_actor=0.5),
)


@pytest.fixture(scope="module")
def deployment(cluster):
    controller = RayController.launch(MODEL, parse_deployment(PLAN), CONFIG, RAY_CONFIG)
    controller.start()
    yield controller
    controller.shutdown(drain_timeout_s=5)


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    """The embedded deployment's greedy outputs (same plan, same limits, this process's devices)."""
    with Controller.from_plan(MODEL, parse_deployment(PLAN), config=CONFIG) as controller:
        streams = [controller.submit(r) for r in _requests("ref")]
        return {i: s.collect(timeout_s=120)[0] for i, s in enumerate(streams)}


def _run_streaming(controller: Controller, tag: str, kill_when=None, seeded: bool = False) -> dict[int, list[int]]:
    """Submit every request, read each stream token by token; `kill_when(num_tokens_seen)` may act once."""
    streams = [controller.submit(r) for r in _requests(tag, seeded)]
    seen = [0]
    lock = threading.Lock()
    out: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        ids: list[int] = []
        try:
            for chunk in streams[i]:
                ids.extend(chunk.token_ids)
                with lock:
                    seen[0] += len(chunk.token_ids)
            out[i] = ids
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(streams))]
    for t in threads:
        t.start()
    if kill_when is not None:
        deadline = time.monotonic() + 120
        while not kill_when(seen[0]) and time.monotonic() < deadline:
            time.sleep(0.005)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return out


def test_cluster_is_loopback(cluster, deployment) -> None:
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}
    assert {info.node_ip for info in deployment.actor_infos.values()} == {"127.0.0.1"}
    # every actor owns its own JAX runtime with exactly tp x pp devices
    infos = deployment.actor_infos
    assert infos["prefill-0"].num_devices == 2 and infos["decode-0"].num_devices == 1
    assert len({info.pid for info in infos.values()} | {os.getpid()}) == 3


def test_ray_matches_embedded_greedy(deployment, reference) -> None:
    streams = [deployment.submit(r) for r in _requests("parity")]
    got = {i: s.collect(timeout_s=120)[0] for i, s in enumerate(streams)}
    assert got == reference
    assert all(len(ids) == MAX_TOKENS for ids in got.values())
    stats = deployment.stats()
    assert stats.num_transfers >= NUM_REQUESTS and stats.kv_transfer_bytes > 0
    faults = deployment.fault_stats()
    assert faults.num_failed_pulls == 0 and faults.num_recomputed == 0 and faults.num_instance_restarts == 0


def test_ray_carries_logprobs_like_embedded(deployment) -> None:
    """Logprobs cross the actor boundary: the prefill's first token's (in `PrefillMeta`) and each decode step's
    (`decode_step_logprobs`) equal the embedded runtime's on the same model, to float32 rounding."""
    requests = [
        GenerateRequest(f"lp-{i}", p, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3))
        for i, p in enumerate(_prompts()[:3])
    ]
    assert all(info.computes_logprobs for info in deployment.actor_infos.values())
    with Controller.from_plan(MODEL, parse_deployment(PLAN), config=CONFIG) as embedded:
        want = [_with_logprobs(embedded.submit(r)) for r in requests]
    got = [_with_logprobs(deployment.submit(r)) for r in requests]
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want, strict=True):
        assert g_ids == w_ids and len(g_lp) == len(g_ids) == 5
        assert [x.logprob for x in g_lp] == pytest.approx([x.logprob for x in w_lp], abs=1e-5)
        assert [[t for t, _ in x.top] for x in g_lp] == [[t for t, _ in x.top] for x in w_lp]


def _with_logprobs(stream) -> tuple[list[int], list]:  # type: ignore[no-untyped-def]
    ids, lps = [], []
    for chunk in stream:
        ids.extend(chunk.token_ids)
        lps.extend(chunk.logprobs or ())
    return ids, lps


def test_unpulled_kv_is_freed_after_its_lease(deployment) -> None:
    prefill = deployment.actor("prefill-0")
    before = deployment.buffer_stats("prefill-0")
    assert before.num_held == 0
    item = PrefillItem("orphan", (5, 6, 7, 8), SamplingParams(max_tokens=4), 0)
    metas = ray.get(prefill.prefill.remote([item]))  # nobody renews this lease, nobody pulls
    assert metas[0].num_bytes > 0
    assert deployment.buffer_stats("prefill-0").num_held == 1
    time.sleep(LEASE_S + 1.0)
    after = deployment.buffer_stats("prefill-0")
    assert after.num_held == 0
    assert after.num_expired == before.num_expired + 1
    assert ray.get(prefill.take_host.remote("orphan")) is None


def test_lease_keeper_renews_while_buffered_and_cancels_when_dropped(deployment) -> None:
    prefill = deployment.actor("prefill-0")
    info = deployment.actor_infos["prefill-0"]
    held = {"kept"}
    proxy = RemotePrefillEngine("prefill-0", prefill, info, info.model_config, 30.0, FaultCounters(), lease_s=LEASE_S)
    proxy._holds = lambda rid: rid in held  # what the PrefillInstance says
    item = PrefillItem("kept", (9, 10, 11), SamplingParams(max_tokens=4), 0)
    proxy.prefill([item])
    before = deployment.buffer_stats("prefill-0")
    for _ in range(4):  # 2 lease periods, renewed every half lease
        time.sleep(LEASE_S / 2)
        assert proxy.keep_once() == (["kept"], [])
    assert deployment.buffer_stats("prefill-0").num_held == 1
    held.clear()  # the controller dropped it (cancelled): the next round frees it on the actor
    assert proxy.keep_once() == ([], ["kept"])
    after = deployment.buffer_stats("prefill-0")
    assert after.num_held == 0 and after.num_cancelled == before.num_cancelled + 1
    assert after.num_expired == before.num_expired


class _Sink:
    """The controller side of a lone PrefillInstance: records what it emits and hands over."""

    def __init__(self) -> None:
        self.emitted: list[int] = []

    def emit(self, live, token_ids, finish_reason) -> None:
        self.emitted.extend(token_ids)

    def fail(self, live, error) -> None:
        raise AssertionError(error)

    def recompute(self, live) -> None:
        raise AssertionError("no pulls here")

    def on_instance_dead(self, instance, held) -> None:
        raise AssertionError(instance.error)

    def count_fault(self, kind, n: int = 1) -> None:
        pass


def test_lease_hand_over_to_the_prefill_buffer_is_atomic(deployment) -> None:
    """The lease keeper running between the actor's prefill and the buffering must not cancel the KV."""
    prefill = deployment.actor("prefill-0")
    info = deployment.actor_infos["prefill-0"]
    proxy = RemotePrefillEngine("prefill-0", prefill, info, info.model_config, 30.0, FaultCounters(), lease_s=LEASE_S)
    rounds: list[tuple[list[str], list[str]]] = []

    class KeeperRunsNow:  # the keeper's round lands right after the actor answered, before the buffer has it
        model_config = proxy.model_config
        capabilities = EngineCapabilities(prefill=True)

        def prefill(self, items):
            result = proxy.prefill(items)
            rounds.append(proxy.keep_once())
            return result

    handed: list[str] = []
    inst = PrefillInstance(
        "prefill-0", KeeperRunsNow(), PrefillConfig(), _Sink(), lambda src, live: handed.append(live.request_id)
    )
    proxy._holds = inst.holds_kv
    live = LiveRequest(GenerateRequest("handover", (9, 10, 11), SamplingParams(max_tokens=4)), 0, RequestTimings(0.0))
    inst.enqueue(live)
    assert inst.step()
    assert rounds == [(["handover"], [])]  # renewed, not cancelled
    assert handed == ["handover"] and inst.buffer_used == 1
    assert ray.get(prefill.take_host.remote("handover")) is not None  # still there to be pulled
    inst.release("handover")  # pulled and written: the next round frees it on the actor
    assert proxy.keep_once() == ([], ["handover"])
    assert ray.get(prefill.take_host.remote("handover")) is None


def test_a_pull_retried_after_the_take_finds_the_kv_again(deployment) -> None:
    """A pull only lends the KV: an attempt that failed after taking it can be retried against the same KV."""
    prefill, decode = deployment.actor("prefill-0"), deployment.actor("decode-0")
    item = PrefillItem("twice", (31, 32, 33, 34), SamplingParams(max_tokens=4), 0)
    ray.get(prefill.prefill.remote([item]))
    assert ray.get(prefill.take_host.remote("twice")) is not None  # an attempt took it, then its copy failed
    report = ray.get(decode.pull.remote(PullOrder("twice", prefill, "prefill-0", item)))  # the retry
    assert not report.recomputed and report.num_failed_attempts == 0 and report.num_bytes > 0
    assert ray.get(decode.discard.remote("twice"))
    deadline = time.monotonic() + 10  # once staged, the decode actor frees it on the prefill side
    while ray.get(prefill.take_host.remote("twice")) is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_pull_of_a_lost_kv_recomputes_it_on_the_decode_side(deployment) -> None:
    prefill, decode = deployment.actor("prefill-0"), deployment.actor("decode-0")
    prompt = (21, 22, 23, 24, 25)
    real = PrefillItem("real", prompt, SamplingParams(max_tokens=4), 0)
    ghost = PrefillItem("ghost", prompt, SamplingParams(max_tokens=4), 0)  # never prefilled on prefill-0
    ray.get(prefill.prefill.remote([real]))
    pulled = ray.get(decode.pull.remote(PullOrder("real", prefill, "prefill-0", real)))
    recomputed = ray.get(decode.pull.remote(PullOrder("ghost", prefill, "prefill-0", ghost)))
    assert not pulled.recomputed and pulled.num_bytes > 0
    assert recomputed.recomputed and recomputed.num_failed_attempts == 1 and "no longer holds" in recomputed.error
    host_real, _, _ = ray.get(decode.staged_host.remote("real"))
    host_ghost, _, _ = ray.get(decode.staged_host.remote("ghost"))
    n = len(prompt)
    for (k1, v1), (k2, v2) in zip(host_real, host_ghost, strict=True):  # tp2 prefill vs tp1 recompute
        np.testing.assert_allclose(k1[:, :n], k2[:, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v1[:, :n], v2[:, :n], rtol=1e-5, atol=1e-5)
    assert ray.get(decode.discard.remote("real")) and ray.get(decode.discard.remote("ghost"))


def test_decode_actor_killed_mid_stream(deployment, reference) -> None:
    restarts = deployment.fault_stats().num_instance_restarts
    killed = []

    def kill(num_seen: int) -> bool:
        if num_seen >= NUM_REQUESTS * MAX_TOKENS // 4:
            ray.kill(deployment.actor("decode-0"), no_restart=False)
            killed.append(num_seen)
            return True
        return False

    got = _run_streaming(deployment, "dkill", kill)
    assert killed
    assert got == reference  # every stream whole: nothing lost, nothing repeated
    faults = deployment.fault_stats()
    assert faults.num_instance_restarts > restarts and faults.num_rerouted_requests > 0
    assert deployment.stats().num_live_requests == 0
    text = ServingMetrics(stats=deployment.stats).render().decode()
    assert f"jaxserve:requests_rerouted_total {float(faults.num_rerouted_requests)}" in text
    assert "jaxserve:instance_restarts_total" in text and "jaxserve:kv_leases_expired_total" in text


def test_decode_actor_restarted_between_calls_is_rebuilt(deployment, reference) -> None:
    """Killed while idle and back before the next call: the proxy notices the empty pool and rebuilds."""
    decode = deployment.actor("decode-0")
    pid_before = ray.get(decode.ping.remote())
    restarts = deployment.fault_stats().num_instance_restarts
    ray.kill(decode, no_restart=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait for the new incarnation without calling through the proxy
        try:
            if ray.get(decode.ping.remote(), timeout=10) != pid_before:
                break
        except ray.exceptions.RayActorError:
            time.sleep(0.2)
    streams = [deployment.submit(r) for r in _requests("idle")[:4]]
    assert [s.collect(timeout_s=120)[0] for s in streams] == [reference[i] for i in range(4)]
    assert deployment.fault_stats().num_instance_restarts == restarts + 1


def test_prefill_actor_killed_mid_stream(deployment, reference) -> None:
    restarts = deployment.fault_stats().num_instance_restarts
    pid_before = ray.get(deployment.actor("prefill-0").ping.remote())
    killed = []

    def kill(num_seen: int) -> bool:
        if num_seen >= 4:  # a few first tokens out: queued, running and buffered prefills remain
            ray.kill(deployment.actor("prefill-0"), no_restart=False)
            killed.append(num_seen)
            return True
        return False

    got = _run_streaming(deployment, "pkill", kill)
    assert killed
    assert got == reference
    # a new process took over (the proxy counts a restart only when a call was in flight at the kill)
    assert ray.get(deployment.actor("prefill-0").ping.remote()) != pid_before
    assert deployment.fault_stats().num_instance_restarts >= restarts
    # the restarted actor rejoined: it serves new requests
    again = deployment.submit(_requests("after")[0]).collect(timeout_s=120)[0]
    assert again == reference[0]


# ---- two simulated nodes --------------------------------------------------------------------

FAKE = conformance.CFG


def test_low_affinity_plan_pairs_stages_on_one_node(cluster) -> None:
    # What Algorithm 2 writes for two pairs: each prefill/decode pair on one node.
    plan = DeploymentPlan(
        instances=(
            InstanceSpec("prefill", tp=1, nodes=(0,)),
            InstanceSpec("prefill", tp=1, nodes=(1,)),
            InstanceSpec("decode", tp=1, nodes=(0,)),
            InstanceSpec("decode", tp=1, nodes=(1,)),
        )
    )
    rc = RayConfig(
        transfer=TransferConfig(lease_s=LEASE_S),
        resources=ResourceConfig(num_cpus_per_actor=0.5, node_resource_prefix="node"),
        engine="fake",
        fake_config=FAKE,
    )
    node_of = {n["NodeID"]: ("node0" if "node0" in n["Resources"] else "node1") for n in ray.nodes() if n["Alive"]}
    controller = RayController.launch("fake", plan, ControllerConfig(limits=ServingLimits(num_kv_blocks=32)), rc)
    try:
        infos = controller.actor_infos
        assert node_of[infos["prefill-0"].node_id] == node_of[infos["decode-0"].node_id] == "node0"
        assert node_of[infos["prefill-1"].node_id] == node_of[infos["decode-1"].node_id] == "node1"
        controller.start()
        sampling = SamplingParams(max_tokens=5, ignore_eos=True)
        prompts = [(3, 4, 5), (9, 8, 7, 6), (11, 12), (1, 2, 3, 4, 5)]
        streams = [controller.submit(GenerateRequest(f"n{i}", p, sampling)) for i, p in enumerate(prompts)]
        for p, s in zip(prompts, streams, strict=True):
            assert s.collect(timeout_s=60)[0] == reference_tokens(p, 5, FAKE.vocab_size)
    finally:
        controller.shutdown(drain_timeout_s=5)


# ---- KV transfer conformance across processes -----------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst"),
    [((2, 1), (1, 1)), ((1, 2), (2, 1)), ((1, 1), (2, 2)), ((2, 2), (1, 4)), ((1, 1), (1, 1))],
    ids=["tp2->tp1", "pp2->tp2", "tp1->tp2pp2", "tp2pp2->pp4", "tp1->tp1"],
)
def test_object_store_transfer_conformance(cluster, monkeypatch, src, dst) -> None:
    """The shared conformance test, run on the object-store path (in this process, through Ray's store)."""
    monkeypatch.setitem(conformance.TRANSFERS, "object_store", ObjectStoreTransfer)
    conformance.test_transfer_lands_in_decode_layout("object_store", src, dst)


@pytest.fixture(scope="module")
def transfer_pair(cluster):
    """A fake prefill actor (tp2) and a fake decode actor (tp1 pp2), both with transfer servers."""
    tc = TransferConfig(mechanism="jax", lease_s=30.0, pull_timeout_s=10.0)
    fail = PullFailureConfig(num_retries=0, on_failure="fail")
    pspec = EngineSpec(role="prefill", tp=2, pp=1, model_source="fake", engine="fake", fake_config=FAKE)
    dspec = EngineSpec(role="decode", tp=1, pp=2, model_source="fake", engine="fake", fake_config=FAKE)
    p = ray.remote(PrefillActor).options(runtime_env=actor_env(pspec, False), num_cpus=0.5, max_concurrency=4)
    d = ray.remote(DecodeActor).options(runtime_env=actor_env(dspec, False), num_cpus=0.5, max_concurrency=2)
    pulls = ActorPulls(tc, fail)
    pa, da = p.remote("prefill-t", pspec, pulls), d.remote("decode-t", dspec, pulls)
    yield pa, da
    ray.kill(pa)
    ray.kill(da)


@pytest.mark.parametrize("mechanism", ["object_store", "jax"])
def test_cross_process_pull_lands_in_decode_layout(transfer_pair, mechanism) -> None:
    pa, da = transfer_pair
    rid = f"x-{mechanism}"
    prompt = tuple(range(5, 25))
    item = PrefillItem(rid, prompt, SamplingParams(), 0)
    ray.get(pa.prefill.remote([item]))
    report = ray.get(da.pull.remote(PullOrder(rid, pa, "prefill-t", item, mechanism)))
    assert not report.recomputed and report.num_failed_attempts == 0
    host, shard_shapes, specs = ray.get(da.staged_host.remote(rid))
    # what the prefill side computed, here on local devices: the KV must arrive bit for bit
    local = FakeEngine(FAKE, jax.devices()[:1]).prefill([item]).sequences[0]
    expected_k = np.concatenate([np.asarray(s.k) for s in local.kv], axis=0)  # [L, T, H, D]
    got_k = np.concatenate([k for k, _ in host], axis=0)
    np.testing.assert_array_equal(got_k, expected_k)
    np.testing.assert_array_equal(
        np.concatenate([v for _, v in host], axis=0), np.concatenate([np.asarray(s.v) for s in local.kv], axis=0)
    )
    assert report.num_bytes == local.num_bytes
    assert len(host) == 2  # decode's two pipeline stages of 2 layers each
    assert all(k.shape[0] == 2 for k, _ in host)
    assert all(shapes == [(2, expected_k.shape[1], FAKE.num_heads, 1)] for shapes in shard_shapes)
    assert set(specs) == {str(PartitionSpec(None, None, "tp", None))}  # the decode engine's KV sharding
    # a second pull of the same id finds nothing: the lease ended at the first pull
    with pytest.raises(ray.exceptions.RayTaskError, match="no longer holds"):
        ray.get(da.pull.remote(PullOrder(rid, pa, "prefill-t", item, mechanism)))


def _faulty_prefill_actor_class() -> type:
    """A `PrefillActor` whose next pull's arrays are damaged after they were described (in transit), or whose
    KV is short at the source (its description agrees). Defined in a function so that Ray ships it by value."""
    from jaxserve.runtime.kv_connectors.ray_pull import HostShipment, fingerprint_of, manifest, stage_for_pull

    damage = {
        "truncated": lambda a: a[:, :2],
        "dtype": lambda a: a.astype(np.float16),
        "missing head": lambda a: a[:, :, 1:],
        "corrupted": lambda a: a + 1.0,  # same shape and dtype: only the checksum sees it
        "short at the source": lambda a: a[:, :2],
    }

    class FaultyPrefillActor(PrefillActor):
        fault: str | None = None

        def set_fault(self, kind: str) -> None:
            self.fault = kind

        def _damage(self, kv):  # type: ignore[no-untyped-def]
            """(the KV with every stage's K damaged by the armed fault, the fault); disarms it."""
            from jaxserve.runtime.engines.contract import StageKV

            fault, self.fault = self.fault, None
            return tuple(StageKV(k=damage[fault](s.k), v=s.v) for s in kv) if fault else kv, fault

        def take_host(self, request_id: str, start: int = 0, num_tokens: int = 0):  # type: ignore[no-untyped-def]
            kv = self._lend(request_id, start, num_tokens)
            if kv is None:
                return None
            damaged, fault = self._damage(kv)
            described = damaged if fault == "short at the source" else kv
            return HostShipment(
                tuple((np.asarray(s.k), np.asarray(s.v)) for s in damaged), manifest(described),
                fingerprint_of(described),
            )  # fmt: skip

        def offer_jax(self, request_id: str, start: int = 0, num_tokens: int = 0):  # type: ignore[no-untyped-def]
            from jaxserve.runtime.kv_connectors.ray_pull import JaxTicket

            kv = self._lend(request_id, start, num_tokens)
            if kv is None:
                return None
            damaged, fault = self._damage(kv)
            described = damaged if fault == "short at the source" else kv
            uuid = next(self._uuids)
            server = self._server
            server.await_pull(uuid, stage_for_pull(damaged))  # type: ignore[attr-defined]
            return JaxTicket(server.address(), uuid, manifest(described), fingerprint_of(described))  # type: ignore[attr-defined]

    return FaultyPrefillActor


@pytest.fixture(scope="module")
def faulty_prefill(transfer_pair):
    """A fake-model prefill actor (tp1) with the checksum on, next to `transfer_pair`'s decode actor."""
    tc = TransferConfig(mechanism="jax", lease_s=30.0, pull_timeout_s=10.0)
    spec = EngineSpec(role="prefill", tp=1, pp=1, model_source="fake", engine="fake", fake_config=FAKE)
    cls = ray.remote(_faulty_prefill_actor_class())
    actor = cls.options(runtime_env=actor_env(spec, False), num_cpus=0.5, max_concurrency=4).remote(
        "faulty", spec, ActorPulls(tc, checksum=True)
    )
    yield actor
    ray.kill(actor)


@pytest.mark.parametrize(
    ("mechanism", "fault", "why"),
    [
        ("object_store", "truncated", "arrived damaged: array 0 is float32"),
        ("object_store", "dtype", "arrived damaged: array 0 is float16"),
        ("object_store", "missing head", "arrived damaged: array 0 is float32"),
        ("object_store", "corrupted", "arrived corrupted (checksum mismatch)"),
        ("object_store", "short at the source", "arrived truncated"),
        ("jax", "corrupted", "arrived corrupted (checksum mismatch)"),
        ("jax", "short at the source", "arrived truncated"),
    ],
)
def test_a_kv_arriving_wrong_across_processes_is_recomputed(transfer_pair, faulty_prefill, mechanism, fault, why):
    """Issue 27 on the Ray path: a KV that arrives truncated, as another dtype, with a head missing or (checksum
    on) with its contents changed is recomputed by the decode actor, even under `on_failure="fail"` (it moved,
    it is only wrong): the staged KV equals the prefill's, and the decode actor goes on pulling."""
    _, da = transfer_pair
    prompt = tuple(range(7, 19))
    local = FakeEngine(FAKE, jax.devices()[:1]).prefill([PrefillItem("x", prompt, SamplingParams(), 0)])
    want = [np.concatenate([np.asarray(getattr(s, part)) for s in local.sequences[0].dense_kv]) for part in "kv"]

    def pull(rid: str):  # type: ignore[no-untyped-def]
        item = PrefillItem(rid, prompt, SamplingParams(), 0)
        ray.get(faulty_prefill.prefill.remote([item]))
        report = ray.get(da.pull.remote(PullOrder(rid, faulty_prefill, "faulty", item, mechanism)))
        host, _, _ = ray.get(da.staged_host.remote(rid))
        for got, expected in zip([np.concatenate([h[k] for h in host]) for k in (0, 1)], want, strict=True):
            np.testing.assert_array_equal(got, expected)
        assert ray.get(da.discard.remote(rid))
        return report

    rid = f"wrong-{mechanism}-{fault}"
    ray.get(faulty_prefill.set_fault.remote(fault))
    report = pull(rid)
    assert report.recomputed and report.num_failed_attempts == 1 and why in (report.error or ""), report
    assert f"the KV of {rid!r}" in (report.error or "")
    clean = pull(f"{rid}-then")  # the same pair, no fault: pulled, checked, not recomputed
    assert not clean.recomputed and clean.num_failed_attempts == 0 and clean.num_bytes > 0


def test_decode_actor_gone_for_good_requests_continue_on_another_decode(cluster, reference) -> None:
    """No restart left: every request the dead decode instance held is re-prefilled (prompt + streamed
    tokens) and continues on the other decode instance, in the same client stream."""
    plan = parse_deployment("disagg:prefill=tp2,decode=2xtp1")
    controller = RayController.launch(MODEL, plan, CONFIG, RAY_CONFIG)
    controller.start()
    try:
        killed = []

        def kill(num_seen: int) -> bool:
            if num_seen >= NUM_REQUESTS * MAX_TOKENS // 4:
                ray.kill(controller.actor("decode-0"), no_restart=True)
                killed.append(num_seen)
                return True
            return False

        got = _run_streaming(controller, "gone", kill)
        assert killed
        assert got == reference
        assert controller.fault_stats().num_rerouted_requests > 0
        alive = {d.name: d.error is None for d in controller.decode_instances}
        assert alive == {"decode-0": False, "decode-1": True}
    finally:
        controller.shutdown(drain_timeout_s=5)


def _kill_and_wait_for_restart(actor) -> None:
    """Kill an idle actor and wait for its new incarnation without calling through the proxy."""
    pid_before = ray.get(actor.ping.remote())
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.ping.remote(), timeout=10) != pid_before:
                return
        except ray.exceptions.RayActorError:
            time.sleep(0.2)
    raise AssertionError("the actor did not come back")


def test_a_restarted_actor_is_warmed_again_before_it_takes_traffic(cluster, reference) -> None:
    """`warmup()` with `warmup.buckets` compiles every padded shape inside each actor (the engines live there):
    a mixed burst afterwards compiles nothing in any actor (counted by JAX's compile events in each process).
    (This was a test of its own, which launched and bucket-warmed the same deployment again.)

    Then both actors are killed while idle. Each new incarnation is cold; its
    proxy notices at the first call (the prefill actor refuses a `warm` call cold, the decode actor has
    no pool), runs the launch's warm-ups in it again and only then the call. The prefill actor ends the
    burst with exactly the compilations the launch's warm-up left (traffic compiled nothing). The decode
    actor also re-prefills the sequences it tracked (the warm-up request's, here) into its fresh pool,
    which compiles prefill programs its warm-up does not cover; it ends with at least the launch's
    count, and a second burst compiles nothing in either actor."""
    # Admission at what the requests need (prompts under 20 tokens, 12 new): the buckets of 48 positions, not of
    # the model's 256, each compiled twice (launch and restart) in both actors.
    admission = AdmissionConfig(max_prompt_tokens=32, max_tokens_limit=16)
    config = dataclasses.replace(CONFIG, warmup=WarmupConfig(buckets=True), admission=admission)
    controller = RayController.launch(MODEL, parse_deployment(PLAN), config, RAY_CONFIG)
    controller.start()
    try:
        controller.warmup()
        names = ("prefill-0", "decode-0")
        warmed = {n: ray.get(controller.actor(n).num_compiles.remote()) for n in names}
        assert all(count > 0 for count in warmed.values()), warmed
        assert _run_streaming(controller, "warm") == reference
        assert {n: ray.get(controller.actor(n).num_compiles.remote()) for n in names} == warmed
        restarts = controller.fault_stats().num_instance_restarts
        for n in names:
            _kill_and_wait_for_restart(controller.actor(n))
        assert not any(ray.get(controller.actor(n).is_warm.remote()) for n in names)
        cold = {n: ray.get(controller.actor(n).num_compiles.remote()) for n in names}  # building the engine
        assert all(cold[n] < warmed[n] for n in names), (cold, warmed)
        got = _run_streaming(controller, "rewarm")
        assert got == reference
        assert all(ray.get(controller.actor(n).is_warm.remote()) for n in names)
        after = {n: ray.get(controller.actor(n).num_compiles.remote()) for n in names}
        assert after["prefill-0"] == warmed["prefill-0"]
        assert after["decode-0"] >= warmed["decode-0"]
        assert controller.fault_stats().num_instance_restarts == restarts + 2
        assert _run_streaming(controller, "rewarm2") == reference
        assert {n: ray.get(controller.actor(n).num_compiles.remote()) for n in names} == after
    finally:
        controller.shutdown(drain_timeout_s=5)


def test_live_switch_on_ray_under_load_loses_nothing_and_kills_the_retired_actors(cluster, reference) -> None:
    """prefill=tp2,decode=tp1 -> prefill=tp1,decode=2xtp1 while requests stream: the decode actor is kept, a
    tp1 prefill actor and a second decode actor are started (own placement), warmed and routed; the tp2
    prefill actor drains and is killed. Every request of the run is token-identical to the reference, and
    requests after the switch run on the new actors (their KV pulled from the new prefill actor)."""
    controller = RayController.launch(MODEL, parse_deployment(PLAN), CONFIG, RAY_CONFIG)
    controller.start()
    switcher = PlanSwitcher(controller, RayActors(controller), drain_timeout_s=60)
    reports: list[object] = []
    errors: list[BaseException] = []

    def switch() -> None:
        try:
            reports.append(switcher.switch(parse_deployment("disagg:prefill=tp1,decode=2xtp1")))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=switch, daemon=True)
    try:
        old_prefill = controller.actor("prefill-0")

        def start_switch(num_seen: int) -> bool:
            if num_seen >= NUM_REQUESTS * MAX_TOKENS // 4:
                thread.start()
                return True
            return False

        got = _run_streaming(controller, "switch", start_switch)
        thread.join(timeout=300)
        assert not errors, errors
        assert got == reference
        report = reports[0]
        assert report.kept == ("decode-0",) and len(report.added) == 2  # type: ignore[attr-defined]
        assert [s.name for s in report.retired] == ["prefill-0"]  # type: ignore[attr-defined]
        assert report.retired[0].num_prefill_buffer_used == 0 and report.num_moved == 0  # type: ignore[attr-defined]
        assert controller.plan.describe() == "disagg:prefill=tp1,decode=2xtp1"
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(old_prefill.ping.remote(), timeout=30)
        assert "prefill-0" not in controller.actors
        new_prefill = next(n for n in report.added if n.startswith("prefill"))  # type: ignore[attr-defined]
        after = _run_streaming(controller, "after")
        assert after == reference
        pulled = [s for s in controller.stats().instances if s.name == new_prefill]
        assert pulled and pulled[0].alive
        assert ray.get(controller.actor(new_prefill).buffer_stats.remote()).num_pulled >= NUM_REQUESTS
    finally:
        controller.shutdown(drain_timeout_s=5)


def test_a_switch_actor_failing_the_compatibility_check_is_killed(deployment) -> None:
    """A new actor built with another block size than the running ones is refused and killed: the CPU it
    reserved comes back (issue 27). It used to be left to Ray's reference counting, so it lived as long as
    anything kept the error (its traceback holds the handle): a switch's error chain, a log record."""
    inputs = deployment.launch_inputs
    assert inputs is not None

    def free_cpus() -> float:
        return float(ray.available_resources().get("CPU", 0.0))

    before = free_cpus()
    deployment.launch_inputs = dataclasses.replace(inputs, block_size=inputs.block_size * 2)
    try:
        with pytest.raises(IncompatiblePeerError, match="block_size") as kept_error:  # the error is kept
            deployment.start_actors([InstanceSpec("decode", 1)], ["decode-incompatible"])
    finally:
        deployment.launch_inputs = inputs
    assert "decode-incompatible" not in deployment.actors
    deadline = time.monotonic() + 60  # a deadline for a hang only: Ray reports freed resources asynchronously
    while free_cpus() < before:
        assert time.monotonic() < deadline, f"{before - free_cpus()} CPUs still held by the refused actor"
        time.sleep(0.2)
    assert kept_error.value is not None


def test_idle_decode_actor_gone_for_good_is_found_dead_by_its_first_pull(cluster, reference) -> None:
    """A decode actor killed while it holds nothing: the first pull into it finds it gone, the instance dies
    and that request moves to the other decode instance. (Counting the dead actor as a failed pull instead
    recomputed the request and routed it straight back to the emptiest instance, the dead one, forever.)"""
    plan = parse_deployment("disagg:prefill=tp2,decode=2xtp1")
    controller = RayController.launch(MODEL, plan, CONFIG, RAY_CONFIG)
    controller.start()
    try:
        ray.kill(controller.actor("decode-0"), no_restart=True)
        got = _run_streaming(controller, "idle-gone")
        assert got == reference
        faults = controller.fault_stats()
        assert faults.num_rerouted_requests > 0 and faults.num_recomputed == 0, faults
        alive = {d.name: d.error is None for d in controller.decode_instances}
        assert alive == {"decode-0": False, "decode-1": True}
    finally:
        controller.shutdown(drain_timeout_s=5)


def test_decode_actor_gone_for_good_seeded_sampling_continues_at_the_same_sample_positions(cluster) -> None:
    """A re-routed request resumes at its own next sample index: seeded random outputs equal a run without failure."""
    plan = parse_deployment("disagg:prefill=tp2,decode=2xtp1")
    with Controller.from_plan(MODEL, plan, config=CONFIG) as embedded:
        expected = _run_streaming(embedded, "seeded-ref", seeded=True)
    controller = RayController.launch(MODEL, plan, CONFIG, RAY_CONFIG)
    controller.start()
    try:
        killed = []

        def kill(num_seen: int) -> bool:
            if num_seen >= NUM_REQUESTS * MAX_TOKENS // 4:
                ray.kill(controller.actor("decode-0"), no_restart=True)
                killed.append(num_seen)
                return True
            return False

        got = _run_streaming(controller, "seeded", kill, seeded=True)
        assert killed and controller.stats().faults.num_rerouted_requests > 0
        assert got == expected
    finally:
        controller.shutdown(drain_timeout_s=5)


def test_offline_llm_on_ray_with_jax_transfer_matches_embedded(cluster, reference) -> None:
    """`LLM(..., backend="ray")` with KV pulled through jax.experimental.transfer: same greedy tokens."""
    rc = dataclasses.replace(RAY_CONFIG, transfer=TransferConfig(mechanism="jax", lease_s=LEASE_S))
    llm = LLM(MODEL, PLAN, config=CONFIG, backend="ray", ray_config=rc)
    try:
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(_prompts(), sampling)
        assert {i: list(o.token_ids) for i, o in enumerate(outputs)} == reference
        faults = llm.controller.fault_stats()  # type: ignore[attr-defined]
        assert faults.num_failed_pulls == 0 and faults.num_recomputed == 0
        assert llm.controller.stats().kv_transfer_bytes > 0
    finally:
        llm.shutdown()


def test_prefill_actor_gone_for_good_requests_go_to_the_other_prefill(cluster, reference) -> None:
    """No restart left: queued, running and buffered requests of the dead prefill instance go to the other."""
    plan = parse_deployment("disagg:prefill=2xtp2,decode=tp1")
    controller = RayController.launch(MODEL, plan, CONFIG, RAY_CONFIG)
    controller.start()
    try:
        killed = []

        def kill(num_seen: int) -> bool:
            if num_seen >= 4:
                ray.kill(controller.actor("prefill-0"), no_restart=True)
                killed.append(num_seen)
                return True
            return False

        got = _run_streaming(controller, "pgone", kill)
        assert killed
        assert got == reference
        assert controller.fault_stats().num_rerouted_requests > 0
        alive = {p.name: p.error is None for p in controller.prefill_instances}
        assert alive == {"prefill-0": False, "prefill-1": True}
    finally:
        controller.shutdown(drain_timeout_s=5)


def test_decode_actor_refuses_a_mismatched_peer(deployment, transfer_pair) -> None:
    """The fake-model decode actor meets the tiny-OPT prefill actor: refused at first contact, by name."""
    _, fake_decode = transfer_pair
    item = PrefillItem("mismatch", (5, 6, 7), SamplingParams(), 0)
    with pytest.raises(IncompatiblePeerError, match=r"prefill-0 and decode-t cannot exchange KV caches: model"):
        ray.get(fake_decode.pull.remote(PullOrder("mismatch", deployment.actor("prefill-0"), "prefill-0", item)))


def test_llama_gqa_on_ray_actors_matches_transformers(cluster, tmp_path) -> None:
    """A Llama-style checkpoint (GQA, 2 K/V heads) on Ray actors, prefill tp1 -> decode tp2 (K/V heads split
    over the decode actor's devices), the KV pulled between processes: greedy tokens equal transformers'."""
    torch = pytest.importorskip("torch")
    from llama_hf import make_hf_llama, save_hf_llama

    hf = make_hf_llama("llama-gqa-llama3", seed=3)
    path = save_hf_llama(hf, tmp_path / "llama")
    prompts = [(1, 100, 31, 7, 8), (1, 30, 31, 32, 17, 9, 44, 11, 5, 6, 7, 150, 13)]
    expected = [
        hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                    pad_token_id=0)[0, len(p):].tolist()
        for p in prompts
    ]  # fmt: skip
    config = ControllerConfig(limits=ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64))
    controller = RayController.launch(str(path), parse_deployment("disagg:prefill=tp1,decode=tp2"), config, RAY_CONFIG)
    controller.start()
    try:
        sampling = SamplingParams(max_tokens=8, ignore_eos=True)
        streams = [controller.submit(GenerateRequest(f"llama-{i}", p, sampling)) for i, p in enumerate(prompts)]
        got = [s.collect(timeout_s=300)[0] for s in streams]
    finally:
        controller.shutdown(drain_timeout_s=5)
    assert got == expected
