"""Test session set-up: 8 virtual CPU devices for meshes, set before JAX is imported."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the CPU attention kernel is built once per session, here, not in the home folder (Ray workers inherit it);
# the folder goes when the session ends
if "JAXSERVE_KERNEL_CACHE" not in os.environ:
    os.environ["JAXSERVE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="jaxserve-kernels-")
    atexit.register(shutil.rmtree, os.environ["JAXSERVE_KERNEL_CACHE"], True)
