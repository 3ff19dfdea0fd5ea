"""The tools wing: the one place that imports both the runtime and the planner.

The bench (load generation, goodput sweeps, simulator fidelity), the online replanning loop (the runtime's
workload monitor feeding the planner's replan decision), and the timed engine wired to the planner's latency
model. See docs/architecture.md for the dependency rule.
"""
