"""What several subcommands share: the embedded default model, the serving-limit flags, the CPU device count,
CPU pinning.

Imports nothing heavy: `ensure_host_devices` must run before JAX is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits

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


def add_serving_limit_flags(group: argparse._ArgumentGroup, num_kv_blocks_help: str | None = None) -> None:
    """`serve` and `generate`'s flags for the serving limits: each is its `ServingLimits` name
    (`--max-decode-batch` -> `max_decode_batch`); default None: the plan's limits, else `DEFAULT_LIMITS`.
    (`plan` / `simulate` have their own, defaulting to `DEFAULT_LIMITS`: commands/planner_args.py.)"""
    group.add_argument("--block-size", type=int, default=None, help="paged KV block, tokens")
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help=num_kv_blocks_help
        or f"paged KV blocks per decode / colocated instance (default {DEFAULT_LIMITS.num_kv_blocks})",
    )
    group.add_argument(
        "--max-decode-batch",
        "--max-decode-batch-size",  # the old spelling, still accepted
        dest="max_decode_batch",
        type=int,
        default=None,
        help="running sequences per decode / colocated instance",
    )
    group.add_argument("--max-batch-tokens", type=int, default=None, help="engine token cap of one prefill step")
    group.add_argument(
        "--prefill-buffer-slots",
        type=int,
        default=None,
        help="prefilled sequences a prefill instance holds until a decode instance pulls them",
    )


def limits_from_args(args: argparse.Namespace, base: ServingLimits) -> ServingLimits:
    """`base` with each serving-limit flag given on the command line (`add_serving_limit_flags`)."""
    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServingLimits)}
    return dataclasses.replace(base, **{k: v for k, v in flags.items() if v is not None})


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


def parse_cpus(text: str) -> set[int]:
    """`0,2-3` -> {0, 2, 3}; raises ValueError naming the bad part or a CPU this process may not use."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad CPU list item {part!r} (expected N or N-M)") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("empty CPU list")
    count = os.cpu_count() or 1
    if max(cpus) >= count:
        raise ValueError(f"CPUs {sorted(c for c in cpus if c >= count)} do not exist (this machine has {count})")
    return cpus


def pin_to_cpus(cpus: set[int]) -> None:
    """Run this process (and the threads it starts from now on, XLA's included) on `cpus` only.

    On a CPU host one XLA "device" is not one core: every device of a process runs its kernels
    on one shared intra-op thread pool, sized when JAX starts to the cores the process may use
    (at least one thread per device), and a pool that sleeps between requests pays a wake-up on
    every hand-off. Pinning a server to its own cores (and the load generator to others) is what
    makes CPU timings repeatable; call it before JAX starts.
    """
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # e.g. outside this container's cpuset
        raise ValueError(f"cannot run on CPUs {sorted(cpus)}: {e.strerror}") from None


def pin_to_cpus_flag(cpus: str | None, error_prefix: str = "") -> bool:
    """`--cpus` (serve, profile): pin to those CPUs when given; False when the list is bad, with the error printed
    as `{error_prefix}error: --cpus: ...`."""
    if cpus is None:
        return True
    try:
        pin_to_cpus(parse_cpus(cpus))
    except ValueError as e:
        print(f"{error_prefix}error: --cpus: {e}", file=sys.stderr)
        return False
    return True


def configure_logging(level_name: str) -> None:
    """jaxserve's loggers (`jaxserve`, `models`, `placement`) at `level_name`; everything else (absl's Orbax chatter, JAX's backend probes, Ray) at
    WARNING unless `level_name` is debug. The handler sits on the root logger, so both reach stderr."""
    import logging

    level = getattr(logging, level_name.upper())
    logging.basicConfig(
        level=logging.DEBUG if level <= logging.DEBUG else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for ours in ("jaxserve", "models", "placement"):
        logging.getLogger(ours).setLevel(level)
    if level > logging.DEBUG:
        for name in ("absl", "jax", "orbax", "ray"):
            logging.getLogger(name).setLevel(logging.WARNING)
