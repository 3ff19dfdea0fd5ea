"""Measuring a running server: open-loop load generation, per-request metrics, goodput sweeps, plots.

The load generator behind `jaxserve bench` (and scripts/check_simulator.py,
scripts/compare_deployments.py). Part of the tools wing (`jaxserve/tools/`): it replays the
planner's workloads and scores SLO attainment with the planner's definitions
(`placement.workload`, `placement.slo`), which the tools wing may import and the runtime may not
(docs/architecture.md's dependency rule).

* `records` — what one request measured (client-side TTFT, TPOT, ITLs, E2E; vLLM `bench serve`
  definitions) and the summary over a run (mean/median/P90/P99, SLO attainment, request goodput).
* `loadgen` — replays a planner `Workload` against a gRPC or OpenAI-HTTP server (open loop: each
  request leaves at its arrival time whether or not earlier ones finished).
* `sweep` — DistServe goodput (the highest rate meeting the attainment target) by bisection over
  rates, and the tightest SLO scale of a run.
* `plot` — attainment vs rate and vs SLO scale, one line per deployment (matplotlib, Agg).

Pure Python plus numpy, grpc and httpx: no JAX, so a bench never competes with the server for
an accelerator runtime.
"""
