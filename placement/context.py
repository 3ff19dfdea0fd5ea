"""Building planner inputs from command-line style values (shared by `jaxserve plan` and `jaxserve simulate`)."""

from __future__ import annotations

import argparse
import sys

from jaxserve.limits import DEFAULT_LIMITS
from models.config import get_config
from placement.goodput import base_workload
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, ProfileError, load_profile
from placement.sim_types import SimOptions
from placement.slo import SloSpec
from placement.workload import Workload


class UsageError(ValueError):
    """A bad command-line value; the CLI prints it on one line and exits 2."""


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="OPT preset, e.g. opt-13b")
    parser.add_argument("--device", default="a100-80gb", help="a100-80gb, a100-40gb, h100-80gb, h200, tpu-v5e, cpu")
    parser.add_argument("--nodes", type=int, default=1, help="nodes in the cluster")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--inter-node-gbps", type=float, default=25.0, help="network between nodes, Gbit/s")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument(
        "--profile",
        default=None,
        help="latency profile: a built-in name (a100-80gb-distserve) or a JSON file; default roofline",
    )
    parser.add_argument(
        "--prefill-tokens", type=int, default=None, help="L_m, the bubble-balancing prefill target (default: profile's)"
    )
    limits = parser.add_argument_group("serving limits (jaxserve/limits.py; the defaults of `jaxserve serve`)")
    limits.add_argument(
        "--max-decode-batch",
        type=int,
        default=DEFAULT_LIMITS.max_decode_batch,
        help="running sequences per decode / colocated instance (serve --max-decode-batch-size)",
    )
    limits.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help=f"engine token cap of a prefill step (default: the profile's, else {DEFAULT_LIMITS.max_batch_tokens})",
    )
    limits.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per decode / colocated instance (default: what the device memory holds)",
    )
    limits.add_argument("--block-size", type=int, default=DEFAULT_LIMITS.block_size, help="paged KV block, tokens")
    limits.add_argument(
        "--prefill-buffer-slots",
        type=int,
        default=DEFAULT_LIMITS.prefill_buffer_slots,
        help="prefilled sequences a prefill instance holds until pulled",
    )
    parser.add_argument(
        "--workload", default="sharegpt", help="sharegpt | humaneval | longbench | fixed:IN:OUT | trace.jsonl"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="requests per simulation")
    parser.add_argument(
        "--cv", type=float, default=1.0, help="coefficient of variation of inter-arrival times (1 = Poisson)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft", type=float, default=None, help="TTFT SLO, seconds")
    parser.add_argument("--tpot", type=float, default=None, help="TPOT SLO, seconds")
    parser.add_argument("--attainment", type=float, default=0.9, help="target share of requests meeting the SLOs")
    parser.add_argument(
        "--slo-mode", choices=["joint", "p90"], default="joint", help="joint: both SLOs per request; p90: each metric"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def build_latency(args: argparse.Namespace) -> LatencyProvider:
    try:
        cfg = get_config(args.model, args.dtype)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    try:
        device = get_device(args.device)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    profile = None
    if args.profile:
        try:
            profile = load_profile(args.profile)
        except ProfileError as e:
            raise UsageError(str(e)) from None
        if profile.device and profile.device != device.name:
            print(
                f"warning: profile {profile.name} was measured on {profile.device}, not {device.name}", file=sys.stderr
            )
        if not profile.supported_tps("disagg", cfg.name) and not profile.supported_tps("colocated", cfg.name):
            raise UsageError(f"profile {profile.name} has no coefficients for {cfg.name}")
    if args.prefill_tokens is not None and args.prefill_tokens < 1:
        raise UsageError("--prefill-tokens must be >= 1")
    return LatencyProvider(cfg, device, profile, prefill_tokens=args.prefill_tokens)


def build_cluster(args: argparse.Namespace, latency: LatencyProvider) -> ClusterSpec:
    if args.nodes < 1 or args.devices_per_node < 1:
        raise UsageError("--nodes and --devices-per-node must be >= 1")
    if args.inter_node_gbps <= 0:
        raise UsageError("--inter-node-gbps must be positive")
    return ClusterSpec(
        latency.device, args.nodes, args.devices_per_node, inter_node_bandwidth=args.inter_node_gbps * 1e9 / 8
    )


def build_slo(args: argparse.Namespace, required: bool) -> SloSpec | None:
    if args.ttft is None or args.tpot is None:
        if required:
            raise UsageError("--ttft and --tpot are required here")
        return None
    try:
        return SloSpec(args.ttft, args.tpot, args.attainment, args.slo_mode)
    except ValueError as e:
        raise UsageError(str(e)) from None


def build_base_workload(args: argparse.Namespace, latency: LatencyProvider, default_requests: int) -> Workload:
    """The requests at rate 1 (goodput probes rescale them): a named distribution, fixed:IN:OUT, or a trace."""
    n = args.num_requests if args.num_requests is not None else default_requests
    if n < 1:
        raise UsageError("--num-requests must be >= 1")
    if args.cv <= 0:
        raise UsageError("--cv must be positive")
    try:
        if args.workload.endswith(".jsonl"):
            return Workload.from_jsonl(args.workload).head(n).with_rate(1.0)
        return base_workload(args.workload, n, args.seed, args.cv, latency.cfg.max_position_embeddings)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None


def build_options(args: argparse.Namespace) -> SimOptions:
    """The simulated engine's limits from `--max-decode-batch`, `--max-batch-tokens`, `--num-kv-blocks`, ..."""
    for name in ("max_decode_batch", "block_size", "prefill_buffer_slots"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_batch_tokens", "num_kv_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    return SimOptions(
        block_size=args.block_size,
        max_decode_batch=args.max_decode_batch,
        max_batch_tokens=args.max_batch_tokens,
        num_kv_blocks=args.num_kv_blocks,
        prefill_buffer_slots=args.prefill_buffer_slots,
    )
