"""A model on Ray actors starts as it does embedded: the same persistent compilation cache, the same warm-up plan.

Each actor is its own process with its own JAX: before this, an actor neither read the driver's compilation cache
(every start compiled every program again) nor had a background part (it compiled every bucket before ready:
SmolLM2's prefill actor took 452 s where the embedded engine takes ~12 s). Deterministic checks only; the start-up
time is `scripts/bench_startup.py --backend ray` (docs/performance.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

# Ray reads this when it is imported: without it, it binds the machine's network address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from pathlib import Path

import jax
import pytest
from ray_cluster import local_cluster

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.compilation.cache import CompileCacheConfig
from jaxserve.runtime.controller import AdmissionConfig, Controller, ControllerConfig, WarmupConfig
from jaxserve.runtime.ray_backend.remote_engine import RemoteDecodeEngine, RemotePrefillEngine

ray = pytest.importorskip("ray")

from jaxserve.runtime.ray_backend.deployment import RayConfig, RayController  # noqa: E402
from jaxserve.runtime.ray_backend.placement_groups import ResourceConfig  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "opt-tiny"
PLAN = "disagg:prefill=tp1,decode=tp1"
# Small limits (prompts of up to 32 tokens, a decode batch of 4) keep the bucket count low; prefix caching on, so
# the prefill side also warms its pool's programs.
CONFIG = ControllerConfig(
    limits=ServingLimits(num_kv_blocks=32, block_size=16, max_decode_batch=4, max_batch_tokens=32,
                         prefill_buffer_slots=4),
    admission=AdmissionConfig(max_prompt_tokens=32, max_tokens_limit=16),
    warmup=WarmupConfig(buckets=True, background=True),
    prefix_policy=PrefixPolicy(enabled=True),
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(2) as c:
        yield c


def _foreground(c: Controller) -> dict[str, tuple[set[tuple[int, ...]], set[tuple[int, ...]]]]:
    """Per role, the prefill and step buckets the embedded engines compiled before their warm-up returned."""
    out = {}
    for inst in c.instances:
        engine = inst.engine
        out[inst.role] = (set(engine.compilation.ready_prefill), set(engine.compilation.ready_steps))  # type: ignore[attr-defined]
    return out


def test_actors_fill_the_drivers_compile_cache_with_the_embedded_warmup_plan(cluster, tmp_path: Path) -> None:
    with Controller.from_plan(MODEL, parse_deployment(PLAN), config=CONFIG) as embedded:
        embedded.warmup(start_background=False)  # the background compiles held: the ready sets are the foreground's
        want = _foreground(embedded)
    assert all(prefill or steps for prefill, steps in want.values()), want

    # A cache directory of the driver's own, not the one the test session hands every process through its
    # environment: the actors must be given it.
    saved = CompileCacheConfig.current()
    cache = tmp_path / "xla"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    try:
        controller = RayController.launch(MODEL, parse_deployment(PLAN), CONFIG, RayConfig(
            resources=ResourceConfig(num_cpus_per_actor=0.5)))  # fmt: skip
    finally:
        jax.config.update("jax_compilation_cache_dir", saved.directory if saved is not None else None)
    controller.start()
    try:
        names = ("prefill-0", "decode-0")
        assert {n: ray.get(controller.actor(n).compile_cache_dir.remote()) for n in names} == dict.fromkeys(
            names, str(cache.absolute())
        )
        controller.warmup(start_background=False)
        got = {}
        for inst in controller.instances:
            proxy = inst.engine
            assert isinstance(proxy, RemotePrefillEngine | RemoteDecodeEngine)
            assert proxy.last_warmed is not None
            got[inst.role] = (set(proxy.last_warmed.prefill_shapes), set(proxy.last_warmed.step_shapes))
            assert proxy.last_warmed.num_background > 0  # the rest is left to the actor's compile thread
            assert not proxy.background_warmup_done(0.0)  # held until the controller starts it
        assert got == want
        controller.start_background_compiles()
        assert all(inst.engine.background_warmup_done(timeout_s=600) for inst in controller.instances)
        # every compiled program went into the driver's cache (the actors compile at XLA's default level, the
        # driver's test session at -O0: none of these entries are the driver's)
        assert len(list(cache.iterdir())) >= sum(len(p) + len(s) for p, s in got.values())
    finally:
        controller.shutdown(drain_timeout_s=5)


_PRIORITY_OF_AN_ACTOR = """
import os, sys
import ray
from jaxserve.runtime.ray_backend.deployment import init_ray

init_ray(temp_dir=sys.argv[1], num_cpus=1)


@ray.remote
class Probe:
    def niceness(self) -> list[int]:  # every thread's (Linux's nice is per thread)
        return [int(open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[16]) for t in os.listdir("/proc/self/task")]


print(sorted(set(ray.get(Probe.remote().niceness.remote()))), os.getpriority(os.PRIO_PROCESS, 0))
ray.shutdown()
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads threads' niceness from Linux's /proc")
def test_a_local_cluster_runs_its_actors_at_the_drivers_priority(tmp_path: Path) -> None:
    """Ray starts workers at niceness 15: on a busy machine an actor's warm-up waited behind every other process."""
    root = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # Ray's socket paths must stay short
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PRIORITY_OF_AN_ACTOR, root],
            capture_output=True, text=True, timeout=300, check=True,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        ).stdout.strip().splitlines()[-1]  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    actor, driver = out.rsplit(" ", 1)
    assert actor == f"[{driver}]"
