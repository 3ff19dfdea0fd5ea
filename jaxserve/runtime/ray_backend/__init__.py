"""The Ray backend: every prefill and decode instance of a disaggregated plan is a Ray actor.

    jaxserve serve --backend ray [--ray-address HOST:PORT] [--kv-transfer object_store|jax] ...
    LLM(model, "disagg:prefill=tp2,decode=tp1", backend="ray", ray_config=RayConfig(...))
    RayController.launch(model, plan, ControllerConfig(...), RayConfig(...))

Files:

* `deployment.py` — `RayController` (a `Controller` whose engines are actor
  proxies), `RayConfig`, `init_ray` (join a cluster, or start one on 127.0.0.1).
* `actors.py` — `PrefillActor` / `DecodeActor`: own JAX runtime, mesh and
  engine per process; the model-signature check between peers.
* `remote_engine.py` — the engine proxies the unchanged runtime loops drive
  (`RemotePrefillEngine` plays the prefill role, `RemoteDecodeEngine` the
  decode role), lease renewal, restart recovery.
* The KV connector lives with the others in `jaxserve/runtime/kv_connectors/`: `ray.py` (`RayKVTransfer`:
  pulls that run in the decode actor while the decode loop keeps stepping) and `ray_pull.py` (the leased KV
  buffer, object-store and `jax.experimental.transfer` pulls, the pull watchdog).
* `placement_groups.py` — Ray placement groups from the plan's node assignment.

What happens on failure: a dead actor is restarted by Ray (`max_restarts`);
a prefill batch in flight is re-run on it, and a decode actor's pool is rebuilt
by re-prefilling every sequence's prompt + streamed tokens into the same
blocks. An actor that does not come back fails its instance; the controller's
own hook (`Controller.on_instance_dead`, the same as in the embedded backend)
then moves each of its requests to live instances (resumed from prompt +
streamed tokens at the same sample positions), so the client's stream
continues, token-identical, seeded sampling included. A KV the decode actor
cannot pull is retried while the prefill actor still holds it (a pull only
lends it), then recomputed on the decode actor (`ControllerConfig.pull_failure.on_failure=
"recompute"`, the default) or the pull fails (`"fail"`), which costs only that
request (the controller applies the same policy then).

Prefix caching (`ControllerConfig.prefix_policy.enabled`): the caches stay in the controller's process
with the instance loops; a prefill actor keeps a paged pool and runs only uncached suffixes
(`PrefillActor.prefill_rows`), a pull moves only what the decode instance's cache lacks (see
docs/prefix_caching.md).

Limits: one actor per instance, so an instance's pipeline stages share a node
(a plan whose instance spans nodes is refused); colocated plans run embedded
only.
"""
