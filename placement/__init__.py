"""The placement planner: latency model, workloads, simulator, goodput search. Imports no JAX."""
