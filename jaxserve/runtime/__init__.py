"""The runtime layer: request in, tokens out, on devices.

* `engines/` — the engine contract the instance loops drive (`contract.py`: one `Engine`, its abilities as
  `EngineCapabilities`) and its backends side by side: `model.py` (any `models` family, Flax NNX), `fake.py` (hand-computable),
  `timed.py` (sleeps a step-cost model); `kv_pool.py` the paged KV pool; `sampling.py` sampling.
* `prefill_instance.py`, `decode_instance.py`, `colocated_instance.py` — one role each,
  each a thin loop (`worker.py`) around a `step()` that applies `jaxserve/core/scheduling.py`.
* `kv_connectors/` — the KV connectors side by side behind one contract (`base.py`): in-process
  (`in_process.py`), across Ray actors (`ray.py`, its mechanics `ray_pull.py`), timed (`timed.py`);
  `ray_backend/` the Ray deployment of a plan.
* `config.py` — `ControllerConfig`, a deployment's knobs (one small config per concern).
* `controller.py` — coordinates a deployment: the request table, admission, hand-off from prefill to
  decode; it calls `routing.py` (which instance takes a request), `recovery.py` (where a request goes
  when its instance or KV is lost), `compilation/` (what is compiled before traffic, when, and the fallbacks
  until a program is in) and `streams.py`
  (`RequestStream`, a request's tokens to its reader). `api.py` is the serving boundary's types.
* `switch.py` — moves a running deployment to another plan (keep, build + warm up, route, drain:
  `PlanSwitcher`), through its steps on the controller's instances (`SwitchSteps`: stage, warm up, route,
  retire, discard); `instance_set.py` (`InstanceSet`) holds the controller's routed, staged and retiring
  instances.
* `instances.py` — from a `DeploymentPlan` to engines on disjoint device sets; `Instance`, the three roles.
* `profiling.py` — times the real engine at a grid of shapes for `jaxserve profile` (the samples it hands
  to the planner's fit are `jaxserve/core/step_samples.py`).

Request types, limits, plans, scheduling policies and block bookkeeping are the contract's (`jaxserve/core/`).

Nothing here imports `jaxserve.serving` or the planner (`placement/`).
"""
