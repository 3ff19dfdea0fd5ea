"""KV transfer time per MB through each mechanism on this machine.

    .venv/bin/python scripts/bench_kv_transfer.py [--sizes-mb 1 4 16 64] [--repeats 5] [--json]

* in_process: `jax.device_put` of a KV-shaped array from one device to another
  in one process (what the embedded backend does).
* jax_transfer: `jax.experimental.transfer` between two Ray actors (the Ray
  backend's `jax` mechanism: staged on one device, pulled onto one device).
* object_store: host copy in one Ray actor, returned through Ray's object store,
  `device_put` in the other (the Ray backend's default mechanism).

Each measurement is the median of `--repeats` runs, timed on the receiving
side from request to arrays ready. A local Ray cluster is started on
127.0.0.1 (the jaxserve Ray backend's `init_ray`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import cast

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import numpy as np


def kv_shape(size_mb: float) -> tuple[int, int, int, int]:
    """[L, T, H, D] float32 of about `size_mb` MB (k and v together): 4 layers, 8 heads of 64, T chosen."""
    per_token = 2 * 4 * 8 * 64 * 4
    return (4, max(int(size_mb * 1e6 / per_token), 1), 8, 64)


class Producer:
    def __init__(self) -> None:
        from jaxserve.runtime.kv_connectors.ray_pull import start_transfer_server

        self.server = start_transfer_server()
        self.kv: dict[int, tuple[object, object]] = {}
        self.uuid = 0

    def make(self, shape: tuple[int, ...], key: int) -> int:
        import jax

        x = jax.device_put(np.random.default_rng(key).standard_normal(shape, dtype=np.float32))
        self.kv[key] = (x, x + 1)
        jax.block_until_ready(self.kv[key])
        return int(x.nbytes) * 2

    def host(self, key: int) -> tuple[np.ndarray, np.ndarray]:
        k, v = self.kv[key]
        return np.asarray(k), np.asarray(v)

    def offer(self, key: int) -> tuple[str, int, tuple[int, ...]]:
        from jaxserve.runtime.engines.contract import StageKV
        from jaxserve.runtime.kv_connectors.ray_pull import stage_for_pull

        k, v = self.kv[key]
        arrays = stage_for_pull((StageKV(k=k, v=v),))  # type: ignore[arg-type]
        self.uuid += 1
        self.server.await_pull(self.uuid, arrays)  # type: ignore[attr-defined,assignment]
        return self.server.address(), self.uuid, tuple(k.shape)  # type: ignore[attr-defined,return-value]


class Consumer:
    def __init__(self) -> None:
        from jaxserve.runtime.kv_connectors.ray_pull import start_transfer_server

        self.server = start_transfer_server()

    def via_object_store(self, producer: object, key: int) -> float:
        import jax
        import ray

        started = time.perf_counter()
        k, v = ray.get(producer.host.remote(key))  # type: ignore[attr-defined,assignment]
        out = (jax.device_put(k), jax.device_put(v))
        jax.block_until_ready(out)
        return time.perf_counter() - started

    def via_jax(self, producer: object, key: int) -> float:
        import ray

        from jaxserve.runtime.kv_connectors.ray_pull import ArraySpec, JaxTicket, pull_staged

        started = time.perf_counter()
        address, uuid, shape = ray.get(producer.offer.remote(key))  # type: ignore[attr-defined,assignment]
        ticket = JaxTicket(address, uuid, (ArraySpec(shape, "float32"), ArraySpec(shape, "float32")))
        pull_staged(self.server, ticket, timeout_s=60)
        return time.perf_counter() - started


def bench_in_process(shape: tuple[int, ...], repeats: int) -> float:
    import jax

    d0, d1 = jax.devices()[:2]
    k = jax.device_put(np.random.default_rng(0).standard_normal(shape, dtype=np.float32), d0)
    v = k + 1
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        jax.block_until_ready((jax.device_put(k, d1), jax.device_put(v, d1)))
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first run warms up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0, 16.0, 64.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import ray
    from ray.actor import ActorHandle

    from jaxserve.runtime.kv_connectors.ray_pull import fetch
    from jaxserve.runtime.ray_backend.deployment import init_ray

    init_ray(num_cpus=4)
    env = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}}
    producer: ActorHandle = ray.remote(Producer).options(runtime_env=env, num_cpus=1).remote()  # type: ignore[attr-defined,assignment]
    consumer: ActorHandle = ray.remote(Consumer).options(runtime_env=env, num_cpus=1).remote()  # type: ignore[attr-defined,assignment]
    rows = []
    num_bytes = 0
    for i, size in enumerate(args.sizes_mb):
        shape = kv_shape(size)
        results: dict[str, float] = {"in_process": bench_in_process(shape, args.repeats)}
        for mechanism in ("jax_transfer", "object_store"):
            times: list[float] = []
            for r in range(args.repeats + 1):
                key = 1000 * i + r + (0 if mechanism == "jax_transfer" else 500)
                num_bytes = cast(int, fetch(producer.make.remote(shape, key)))
                if mechanism == "jax_transfer":
                    ref = consumer.via_jax.remote(producer, key)
                else:
                    ref = consumer.via_object_store.remote(producer, key)
                times.append(cast(float, fetch(ref)))
            results[mechanism] = statistics.median(times[1:])
        mb = num_bytes / 1e6
        rows.append({"mb": round(mb, 2), **{f"{m}_ms_per_mb": 1e3 * s / mb for m, s in results.items()}})
    ray.shutdown()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'MB':>8} {'in_process ms/MB':>18} {'jax_transfer ms/MB':>20} {'object_store ms/MB':>20}")
        for row in rows:
            print(
                f"{row['mb']:8.2f} {row['in_process_ms_per_mb']:18.3f} {row['jax_transfer_ms_per_mb']:20.3f} "
                f"{row['object_store_ms_per_mb']:20.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
