"""One source of truth for the serving limits: the server's config, the simulator's options and the plan/simulate/
serve command lines take their defaults from `jaxserve/core/limits.py`; a plan records the limits it was planned with
and `serve --plan` applies them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.cli import build_parser, main
from jaxserve.commands.serve import serving_limits
from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.plan import DeploymentPlan, PlanError, parse_deployment
from jaxserve.runtime.controller import ControllerConfig
from models.config import get_config
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, kv_capacity_tokens
from placement.simulator import SimOptions


def test_server_and_simulator_defaults_are_the_limits() -> None:
    assert ControllerConfig().limits == DEFAULT_LIMITS  # the server composes the limits, re-declares none
    # "What the memory holds" (None) is a planner value: a running server needs a number of blocks.
    with pytest.raises(ValueError, match="num_kv_blocks"):
        ControllerConfig(limits=ServingLimits(num_kv_blocks=None))
    # The simulator composes the limits too: the serving defaults, the KV left to the device's memory.
    o = SimOptions()
    assert o.limits == dataclasses.replace(DEFAULT_LIMITS, num_kv_blocks=None)
    # The token cap left to the profile resolves to the default without one.
    lp = LatencyProvider(get_config("opt-13b"), get_device("a100-80gb"))
    assert o.profile_token_cap and lp.profile_token_cap("disagg", 1) is None
    assert o.token_cap(lp.profile_token_cap("disagg", 1)) == DEFAULT_LIMITS.max_batch_tokens
    assert o.token_cap(4096) == 4096  # a profile's cap replaces the default ...
    assert SimOptions.planning(max_batch_tokens=100).token_cap(4096) == 100  # ... unless one is given
    # The same options from the limits, and back.
    assert SimOptions.from_limits(DEFAULT_LIMITS).served_limits(DEFAULT_LIMITS.max_batch_tokens) == DEFAULT_LIMITS


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_command_line_defaults_are_the_limits(command: str) -> None:
    extra = ["--deployment", "colocated:tp1", "--rate", "1"] if command == "simulate" else []
    args = build_parser().parse_args([command, "--model", "opt-13b", *extra])
    assert args.max_decode_batch is None  # the profile's engines' cap, else DEFAULT_LIMITS' (below)
    assert args.block_size == DEFAULT_LIMITS.block_size
    assert args.prefill_buffer_slots == DEFAULT_LIMITS.prefill_buffer_slots
    serve_args = build_parser().parse_args(["serve"])
    assert serving_limits(serve_args, parse_deployment("colocated:tp1")) == DEFAULT_LIMITS


def test_plan_file_records_limits_and_serve_applies_them(tmp_path) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "opt-13b", "--profile", "a100-80gb-distserve", "--num-requests", "100"]
    argv += ["--devices-per-node", "2", "--workload", "fixed:512:64", "--ttft", "0.4", "--tpot", "0.04"]
    argv += ["--kind", "colocated", "--max-decode-batch", "48", "--workers", "1", "--no-progress", "-o", str(out)]
    assert main(argv) == 0
    plan = DeploymentPlan.from_json(out.read_text())
    assert plan.limits is not None and plan.limits.max_decode_batch == 48
    # The KV the planner's simulation gave each instance: what an A100-80GB holds for opt-13b at that shape.
    inst = plan.instances[0]
    a100, cfg = get_device("a100-80gb"), get_config("opt-13b", "float16")
    assert plan.limits.num_kv_blocks == kv_capacity_tokens(cfg, a100, inst.tp, inst.pp) // 16
    served = serving_limits(build_parser().parse_args(["serve", "--plan", str(out)]), plan)
    assert served == plan.limits
    # A flag on the command line still wins over the plan.
    overridden = serving_limits(build_parser().parse_args(["serve", "--max-decode-batch", "8"]), plan)
    assert overridden == dataclasses.replace(plan.limits, max_decode_batch=8)
    # Every limit's flag is its name; the old `--max-decode-batch-size` spelling still works.
    argv = ["serve", "--max-decode-batch-size", "8", "--prefill-buffer-slots", "3", "--block-size", "8"]
    flagged = serving_limits(build_parser().parse_args(argv), plan)
    assert flagged == dataclasses.replace(plan.limits, max_decode_batch=8, prefill_buffer_slots=3, block_size=8)


def test_generate_takes_the_limit_flags_serve_takes() -> None:
    from jaxserve.commands.common import limits_from_args

    argv = [
        "generate",
        "--prompt-ids",
        "2",
        "--max-decode-batch",
        "4",
        "--num-kv-blocks",
        "40",
        "--max-batch-tokens",
        "64",
    ]
    args = build_parser().parse_args(argv)
    assert limits_from_args(args, DEFAULT_LIMITS) == ServingLimits(
        num_kv_blocks=40, max_decode_batch=4, max_batch_tokens=64
    )


def test_plan_limits_round_trip_and_validation() -> None:
    limits = ServingLimits(num_kv_blocks=1000, max_decode_batch=64, max_batch_tokens=8192)
    plan = dataclasses.replace(parse_deployment("disagg:prefill=tp1,decode=tp1"), limits=limits)
    assert DeploymentPlan.from_json(plan.to_json()) == plan
    bad = plan.to_dict()
    bad["limits"]["max_decode_batch"] = 0
    with pytest.raises(PlanError, match="max_decode_batch"):
        DeploymentPlan.from_dict(bad)
    bad["limits"] = {"decode_batch": 3}
    with pytest.raises(PlanError, match="unknown"):
        DeploymentPlan.from_dict(bad)


def test_a_profile_carries_the_decode_batch_cap_its_engines_ran_with(tmp_path) -> None:
    """a100-80gb-distserve was measured on DistServe's evaluation engines: decode instances run with
    --decoding-max-batch-size 1024 and vLLM with --max-num-seqs 1024. Without --max-decode-batch a plan on it
    assumes that cap (and says so); with the flag, or with no profile limits, the flag's or the serving default."""
    from placement.context import build_latency, build_options
    from placement.simulator import simulate
    from placement.workload import Workload

    distserve = build_latency("opt-13b", "a100-80gb", "a100-80gb-distserve")
    assert distserve.profile_decode_batch("disagg") == distserve.profile_decode_batch("colocated") == 1024
    roofline = build_latency("opt-13b", "a100-80gb")
    assert roofline.profile_decode_batch("disagg") is None
    # The simulator's decode batch: of 300 requests arriving together, more than 32 decode at once under the
    # profile's cap; under the serving default never more than 32.
    plan = parse_deployment("disagg:prefill=tp1,decode=tp1")
    n = 300
    w = Workload(np.zeros(n), np.full(n, 16), np.full(n, 64), 1.0)
    cluster = ClusterSpec(get_device("a100-80gb"), 1, 2)

    def most_decoding(options: SimOptions) -> int:
        r = simulate(plan, distserve, cluster, w, None, options)
        return max(int(np.sum((r.decode_start_at <= t) & (t < r.finish_at))) for t in r.decode_start_at)

    assert most_decoding(build_options()) > 32
    assert most_decoding(build_options(max_decode_batch=32)) == 32
    assert build_options().decode_batch_cap(roofline.profile_decode_batch("disagg")) == DEFAULT_LIMITS.max_decode_batch
    # the plan records the cap it assumed, and the command says where it came from
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "opt-13b", "--profile", "a100-80gb-distserve", "--num-requests", "100"]
    argv += ["--devices-per-node", "2", "--workload", "fixed:512:64", "--ttft", "0.4", "--tpot", "0.04"]
    argv += ["--kind", "colocated", "--workers", "1", "--no-progress", "--seeds", "0", "-o", str(out)]
    assert main(argv) == 0
    limits = DeploymentPlan.from_json(out.read_text()).limits
    assert limits is not None and limits.max_decode_batch == 1024
