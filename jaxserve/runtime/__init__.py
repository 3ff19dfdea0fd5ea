"""The runtime layer: request in, tokens out, on devices.

* `engine.py` — the engine contract the instance loops drive; `opt_engine.py` its
  JAX/Flax OPT implementation; `kv_pool.py` the paged KV pool; `sampling.py` sampling.
* `prefill_instance.py`, `decode_instance.py`, `colocated_instance.py` — one role each,
  each a thin loop (`worker.py`) around a `step()` that applies `jaxserve/core/scheduling.py`.
* `kv_transfer.py` — the in-process KV pull; `ray_backend/` the cross-process one and the
  Ray deployment of a plan.
* `controller.py` — dispatch, hand-off from prefill to decode, streaming, re-routing.
* `switch.py` — moves a running deployment to another plan (keep, build + warm up, route, drain).
* `instances.py` — from a `DeploymentPlan` to engines on disjoint device sets.
* `request.py` — request-level types shared with the serving layer and `jaxserve.LLM`.
* `step_timing.py` — times the real engine at a grid of shapes for `jaxserve profile`; `step_samples.py`
  the measured samples it hands to the planner's fit.

Nothing here imports `jaxserve.serving` or the planner (`placement/`).
"""
