"""The planner's command-line flags, shared by `jaxserve plan` and `jaxserve simulate`, and their mapping onto
the plain builders of `placement/context.py`."""

from __future__ import annotations

import argparse
from typing import NamedTuple

from jaxserve.core.limits import DEFAULT_LIMITS
from placement.context import (
    build_base_workload,
    build_cluster,
    build_latency,
    build_options,
    build_slo,
)
from placement.hardware import ClusterSpec
from placement.latency import LatencyProvider
from placement.simulator import SimOptions
from placement.slo import SloSpec
from placement.workload import Workload


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="model preset: OPT (opt-13b, opt-66b, ...) or Llama-style (llama-3.1-70b, qwen2-7b, ...)",
    )
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
    limits = parser.add_argument_group("serving limits (jaxserve/core/limits.py; the defaults of `jaxserve serve`)")
    limits.add_argument(
        "--max-decode-batch",
        type=int,
        default=None,
        help="running sequences per decode / colocated instance (the same flag on serve; default: the cap the "
        f"profile's engines ran with, else {DEFAULT_LIMITS.max_decode_batch})",
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


class PlannerInputs(NamedTuple):
    latency: LatencyProvider
    cluster: ClusterSpec
    slo: SloSpec | None
    options: SimOptions
    workload: Workload


def inputs_from_args(args: argparse.Namespace, default_requests: int, slo_required: bool) -> PlannerInputs:
    """Raises `placement.context.UsageError` for a bad value."""
    latency = build_latency(args.model, args.device, args.profile, args.dtype, args.prefill_tokens)
    return PlannerInputs(
        latency,
        build_cluster(latency, args.nodes, args.devices_per_node, args.inter_node_gbps),
        build_slo(args.ttft, args.tpot, args.attainment, args.slo_mode, required=slo_required),
        build_options(
            args.max_decode_batch, args.block_size, args.prefill_buffer_slots, args.max_batch_tokens, args.num_kv_blocks
        ),
        build_base_workload(
            args.workload,
            latency,
            args.num_requests if args.num_requests is not None else default_requests,
            args.seed,
            args.cv,
        ),
    )
