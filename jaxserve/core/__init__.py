"""The contract: what the planner and the runtime share, in pure Python (no JAX, no device code).

Plans and instance specs, serving limits, errors, requests and sampling parameters, the scheduling policies
(run by the runtime's loops and by the simulator alike), KV-block and prefix-cache bookkeeping, measured step
samples and the workload monitor. Both `placement/` (the planner) and `jaxserve.runtime` import from here;
neither imports the other. See docs/architecture.md.
"""
