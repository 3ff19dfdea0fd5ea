"""Compilation: what is compiled, when (foreground, background), and what runs until a program is in.

One room, as tpu-inference keeps its `compilation_manager.py`:

* `plan.py` — what: the padded shapes (buckets) the limits allow, which compile before `warmup` returns and the
  background order; pure functions of the limits.
* `model_engine.py` — how, for the real engine: `ModelCompilation`, which each `ModelEngine` owns
  (`engine.compilation`) and which drives it through `WarmupHost`, runs or compiles what the plan names and keeps
  the ready sets of what is in.
* `cache.py` — the persistent compilation cache (`enable_compilation_cache`; `CompileCacheConfig` carries the
  driver's to the Ray actors).
* `background.py` — the background half: the compile thread and the fallbacks until a program is published
  (work padded up to a compiled bucket, or split into runs one holds; a dense prefill or a whole-KV pull
  instead of an uncompiled copy).
* `deployment.py` — when, for a deployment: `WarmupConfig` (the knob), the bucket warm-up of every instance on a
  thread each, the controller's `warmup()` sequence (`warm_up_deployment`), and the hand-off warm-ups of a live
  switch.
"""
