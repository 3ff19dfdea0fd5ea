"""KV connectors: how a prefilled sequence's KV reaches a decode instance, one file per connector.

* `base.py` — the contract every connector meets (`KVTransfer.start` -> `TransferHandle`: `poll`, `wait`,
  `insert`), the failure policy they all read (`PullFailureConfig`), the one copy (`move_kv`) and the
  integrity checks (`check_pulled_kv`, `kv_fingerprint`).
* `in_process.py` — `InProcessTransfer`: `jax.device_put` inside one JAX process (the default).
* `ray.py` — `RayKVTransfer`: pulls between Ray actor processes, run in the decode actor
  (`ray_pull.py`: the leases, the object-store and `jax.experimental.transfer` mechanisms, the watchdog);
  `ObjectStoreTransfer`, its object-store path in one process, for the shared conformance test.
* `timed.py` — `TimedTransfer`: the fake one, a pull into a `TimedEngine` that takes the latency model's
  link time (`serve --engine timed`).

tests/test_kv_transfer.py is the conformance test every local connector runs.
"""
