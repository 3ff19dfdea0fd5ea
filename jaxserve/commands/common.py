"""What several subcommands share: the embedded default model and the CPU device count.

Imports nothing heavy: `ensure_host_devices` must run before JAX is imported.
"""

from __future__ import annotations

import os
import sys

# The embedded default: the small code model shipped under jaxserve/assets/ when the
# package has it, else a preset (random weights, with a warning at load time).
FALLBACK_MODEL = "opt-tiny"
DEFAULT_DEPLOYMENT = "disagg:prefill=tp1,decode=tp1"


def default_model() -> str:
    """The model a command runs when neither --model nor a plan names one."""
    from jaxserve.assets import DEFAULT_MODEL_DIR

    if (DEFAULT_MODEL_DIR / "config.json").exists():
        return str(DEFAULT_MODEL_DIR)
    return FALLBACK_MODEL


def ensure_host_devices(num_devices: int, extra_flags: str = "") -> None:
    """Give a CPU-only run `num_devices` virtual XLA devices (and `extra_flags`).

    Only effective before JAX is imported, and never overrides a device count the
    user set in XLA_FLAGS. On an accelerator the flag is harmless: it shapes only
    the host platform.
    """
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={max(num_devices, 1)}"
    for flag in extra_flags.split():
        if flag.split("=")[0] not in flags:
            flags += f" {flag}"
    os.environ["XLA_FLAGS"] = flags.strip()
