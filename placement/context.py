"""Building planner inputs from plain values (names, numbers): `jaxserve plan`/`simulate` map their flags onto
these (`jaxserve/commands/planner_args.py`); no argparse here."""

from __future__ import annotations

import sys

from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from models.config import get_model_config
from placement.goodput import base_workload
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, ProfileError, load_profile
from placement.precision import PrecisionError, parse_precisions
from placement.sim_types import SimOptions
from placement.slo import SloSpec
from placement.workload import Workload


class UsageError(ValueError):
    """A bad command-line value; the CLI prints it on one line and exits 2."""


def build_latency(
    model: str,
    device: str = "a100-80gb",
    profile_name: str | None = None,
    dtype: str = "float16",
    prefill_tokens: int | None = None,
) -> LatencyProvider:
    try:
        cfg = get_model_config(model, dtype)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    try:
        spec = get_device(device)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    profile = None
    if profile_name:
        try:
            profile = load_profile(profile_name)
        except ProfileError as e:
            raise UsageError(str(e)) from None
        if profile.device and profile.device != spec.name:
            print(f"warning: profile {profile.name} was measured on {profile.device}, not {spec.name}", file=sys.stderr)
        if not profile.supported_tps("disagg", cfg.name) and not profile.supported_tps("colocated", cfg.name):
            raise UsageError(f"profile {profile.name} has no coefficients for {cfg.name}")
    if prefill_tokens is not None and prefill_tokens < 1:
        raise UsageError("--prefill-tokens must be >= 1")
    return LatencyProvider(cfg, spec, profile, prefill_tokens=prefill_tokens)


def build_precisions(text: str, latency: LatencyProvider) -> tuple[str | None, ...]:
    """`--precisions`: the weight precisions a search may give an instance (None: the checkpoint's own)."""
    try:
        return parse_precisions(text, latency.device)
    except PrecisionError as e:
        raise UsageError(str(e)) from None


def build_cluster(
    latency: LatencyProvider, nodes: int = 1, devices_per_node: int = 8, inter_node_gbps: float = 25.0
) -> ClusterSpec:
    if nodes < 1 or devices_per_node < 1:
        raise UsageError("--nodes and --devices-per-node must be >= 1")
    if inter_node_gbps <= 0:
        raise UsageError("--inter-node-gbps must be positive")
    return ClusterSpec(latency.device, nodes, devices_per_node, inter_node_bandwidth=inter_node_gbps * 1e9 / 8)


def build_slo(
    ttft: float | None, tpot: float | None, attainment: float = 0.9, mode: str = "joint", required: bool = False
) -> SloSpec | None:
    if ttft is None or tpot is None:
        if required:
            raise UsageError("--ttft and --tpot are required here")
        return None
    try:
        return SloSpec(ttft, tpot, attainment, mode)  # type: ignore[arg-type]
    except ValueError as e:
        raise UsageError(str(e)) from None


def build_base_workload(
    workload: str, latency: LatencyProvider, num_requests: int, seed: int = 0, cv: float = 1.0
) -> Workload:
    """The requests at rate 1 (goodput probes rescale them): a named distribution, fixed:IN:OUT, or a trace."""
    n = num_requests
    if n < 1:
        raise UsageError("--num-requests must be >= 1")
    if cv <= 0:
        raise UsageError("--cv must be positive")
    try:
        if workload.endswith(".jsonl"):
            return Workload.from_jsonl(workload).head(n).with_rate(1.0)
        return base_workload(workload, n, seed, cv, latency.cfg.max_position_embeddings)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None


def build_options(
    max_decode_batch: int | None = None,
    block_size: int = DEFAULT_LIMITS.block_size,
    prefill_buffer_slots: int = DEFAULT_LIMITS.prefill_buffer_slots,
    max_batch_tokens: int | None = None,
    num_kv_blocks: int | None = None,
) -> SimOptions:
    """The simulated engine's limits (None: the profile's engine caps, else the serving defaults; the device
    memory's KV)."""
    for name, value in (
        ("max-decode-batch", max_decode_batch),
        ("block-size", block_size),
        ("prefill-buffer-slots", prefill_buffer_slots),
        ("max-batch-tokens", max_batch_tokens),
        ("num-kv-blocks", num_kv_blocks),
    ):
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be >= 1")
    limits = ServingLimits(
        block_size=block_size,
        max_decode_batch=max_decode_batch or DEFAULT_LIMITS.max_decode_batch,
        max_batch_tokens=max_batch_tokens or DEFAULT_LIMITS.max_batch_tokens,
        num_kv_blocks=num_kv_blocks,
        prefill_buffer_slots=prefill_buffer_slots,
    )
    return SimOptions(limits, profile_token_cap=max_batch_tokens is None, profile_decode_batch=max_decode_batch is None)
