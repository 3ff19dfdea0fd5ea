"""Test session set-up: 8 virtual CPU devices for meshes, set before JAX is imported."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags = f"{_flags} --xla_force_host_platform_device_count=8".strip()
# XLA's LLVM backend at -O0: compiling is most of the suite's time, and its tiny models run for microseconds. The
# programs are the same HLO after XLA's own passes (fusion, layouts, sharding); only their machine code is less
# optimised. The default tier ran 444 -> 355 s. `XLA_FLAGS=--xla_backend_optimization_level=2` (XLA's default)
# runs the suite as a server compiles; every test passes at both levels.
if "--xla_backend_optimization_level" not in _flags:
    _flags = f"{_flags} --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAXSERVE_KERNEL_CHECKS", "1")  # tests run the checked CPU kernel: a bad block id raises
# the CPU attention kernel is built once per session, here, not in the home folder (Ray workers inherit it);
# the folder goes when the session ends
if "JAXSERVE_KERNEL_CACHE" not in os.environ:
    os.environ["JAXSERVE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="jaxserve-kernels-")
    atexit.register(shutil.rmtree, os.environ["JAXSERVE_KERNEL_CACHE"], True)
# One persistent XLA compilation cache per session, shared by every test, subprocess and Ray worker: the suite
# builds the same tiny models with the same shapes in many tests, and compiling is most of its time (two parity
# files measured 49 s of compiles in a 72 s run). A hit still logs "Compiling ..." and still fires JAX's
# backend-compile event, so the no-compile witnesses (jax_log_compiles, the actors' num_compiles) count the same.
# A fresh folder per session, removed at its end: no test reads another session's programs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxserve-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
