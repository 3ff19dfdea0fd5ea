"""`jaxserve plan`: search the per-phase parallelism and instance counts that maximise per-device goodput.

High node affinity runs Algorithm 1 (phases searched independently), low affinity Algorithm 2 (prefill
and decode segments of each stage on one node). With `--kind auto` (the default) the best colocated
shape is searched too and the plan is whichever kind serves more goodput per device — the disaggregated
side judged by a joint simulation of its chosen plan — so a machine where splitting the phases does not
pay (slow interconnect, devices that share cores) gets a colocated plan. Prints the candidates and the
choice, or with `--json` the `DeploymentPlan` (devices and nodes filled in) that `jaxserve serve --plan` reads.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.core.plan import DeploymentPlan
    from placement.latency import DeploymentKind, LatencyProvider
    from placement.search import SearchContext


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxserve.commands.planner_args import add_common_arguments

    add_common_arguments(parser)
    parser.add_argument(
        "--affinity", choices=["high", "low"], default="high", help="high: Algorithm 1; low: Algorithm 2"
    )
    parser.add_argument("--rate", type=float, default=None, help="target request rate; default: fill the cluster")
    parser.add_argument("--workers", type=int, default=2, help="processes evaluating candidates")
    parser.add_argument(
        "--max-pp", type=int, default=None, help="most pipeline stages per instance (default: no limit)"
    )
    parser.add_argument(
        "--precisions",
        default="checkpoint",
        help="weight precisions the search may give each instance, comma-separated: checkpoint (the model's own), "
        "int8, int4 (weight-only), w8a8, fp8 (devices with fp8: h100-80gb, h200); each phase picks its own. Default: "
        "checkpoint only, so a plan never quantizes unless asked (placement/precision.py)",
    )
    parser.add_argument(
        "--no-verify", action="store_true", help="skip the joint simulation of the chosen plan (Algorithm 1 only)"
    )
    parser.add_argument(
        "--kind",
        choices=["auto", "disagg", "colocated"],
        default="auto",
        help="auto: search both and choose the higher goodput per device; disagg / colocated: only that kind",
    )
    parser.add_argument(
        "--compare-colocated",
        action="store_true",
        help="with --kind disagg: still search and print the best colocated shape (auto always does)",
    )
    parser.add_argument(
        "--ratio-devices",
        type=int,
        default=0,
        help="also search the prefill:decode replica ratio (xPyD) of the chosen shapes within N devices, jointly simulated",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=2,
        help="re-simulate the chosen plan, the runner-up and the leading candidates on this many more workload "
        "samples (0: none)",
    )
    parser.add_argument(
        "--interval-top",
        type=int,
        default=3,
        help="with --seeds: how many of each phase's / kind's best candidates get a range over the seeds",
    )
    caching = parser.add_argument_group("multi-turn workload with prefix caching (placement/prefix_plan.py)")
    caching.add_argument(
        "--conversations",
        type=int,
        default=None,
        help="plan for N sampled chat conversations (placement.conversations defaults) served with prefix "
        "caching: screen on the cache-adjusted workload, judge with the cache-aware simulator "
        "(disaggregated and colocated, as --kind says)",
    )
    caching.add_argument(
        "--local-prefill-tokens",
        default="0,256",
        help="conditional-disaggregation thresholds to judge, comma-separated (0: always disaggregate)",
    )
    parser.add_argument(
        "--unit-nodes",
        type=int,
        default=None,
        help="search a unit of this many nodes and replicate it over the cluster (default: 4; 0: search the "
        "whole cluster at once, slow beyond 8 nodes)",
    )
    parser.add_argument(
        "--check-units",
        type=int,
        default=None,
        help="a replicated plan's goodput: this many units simulated together (default: 2; 0: the units' sum)",
    )
    parser.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from jaxserve.commands.planner_args import inputs_from_args
    from jaxserve.core.plan import PlanError
    from placement.cluster_plan import DEFAULT_CHECK_UNITS, DEFAULT_UNIT_NODES, plan_cluster
    from placement.context import UsageError, build_base_workload, build_precisions
    from placement.latency import ProfileError
    from placement.precision import describe, shape
    from placement.search import SearchContext
    from placement.workload import Workload

    try:
        latency, cluster, slo, options, workload = inputs_from_args(args, 400, slo_required=True)
        assert slo is not None
        if args.rate is not None and args.rate <= 0:
            raise UsageError("--rate must be positive")
        if args.workers < 1:
            raise UsageError("--workers must be >= 1")
        if args.ratio_devices < 0:
            raise UsageError("--ratio-devices must be >= 0")
        if args.max_pp is not None and args.max_pp < 1:
            raise UsageError("--max-pp must be >= 1")
        if args.seeds < 0 or args.interval_top < 0:
            raise UsageError("--seeds and --interval-top must be >= 0")
        if (args.unit_nodes or 0) < 0 or (args.check_units or 0) < 0:
            raise UsageError("--unit-nodes and --check-units must be >= 0")
        precisions = build_precisions(args.precisions, latency)
    except UsageError as e:
        print(f"jaxserve plan: error: {e}", file=sys.stderr)
        return 2

    ctx = SearchContext(latency, cluster, workload, slo, options, max_pp=args.max_pp, precisions=precisions)
    if args.conversations is not None:
        return _run_conversations(args, ctx)

    def reseed(seed: int) -> Workload:
        return build_base_workload(args.workload, latency, len(workload), seed, args.cv)

    progress = None if args.no_progress else _progress_bar()
    try:
        scaled = plan_cluster(
            ctx,
            kind=args.kind,
            affinity=args.affinity,
            rate=args.rate,
            unit_nodes=DEFAULT_UNIT_NODES if args.unit_nodes is None else args.unit_nodes,
            workers=args.workers,
            verify=not args.no_verify,
            compare_colocated=args.compare_colocated,
            ratio_devices=args.ratio_devices,
            progress=progress,
            reseed=None if args.json else reseed,
            seeds=args.seeds,
            interval_top=args.interval_top,
            check_units=DEFAULT_CHECK_UNITS if args.check_units is None else args.check_units,
        )
    except (PlanError, ProfileError) as e:
        print(f"jaxserve plan: error: {e}", file=sys.stderr)
        return 1
    finally:
        if progress is not None:
            progress.close()
    report = scaled.unit  # the search: its candidates, choice and reasons (the whole cluster when one unit)
    plan, disagg, colocated, ratio = scaled.plan, report.disagg, report.colocated, report.ratio
    simulated, disagg_pd, goodput_rps = report.joint_rps, report.disagg_per_device, scaled.goodput_rps
    if _emit_json(args, plan):
        return 0

    source = latency.profile.name if latency.profile else f"roofline of {cluster.device.name}"
    print(
        f"{latency.cfg.name} on {cluster.num_nodes} x {cluster.devices_per_node} {cluster.device.name}, workload {args.workload}, "
        f"TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s at {slo.attainment:.0%} ({slo.mode}); latency from {source}"
    )
    if scaled.replicated:
        print(
            f"searched one unit of {scaled.unit_nodes} node(s) at the rate it serves, then replicated it "
            f"(placement/cluster_plan.py); the candidates below are the unit's"
        )
    print(f"\n{'candidate':<34} {'devices':>7} {'goodput rps':>12} {'rps/device':>11}  {'range over seeds':>17}")
    rows = (list(disagg.candidates) if disagg else []) + (list(colocated.candidates) if colocated else [])
    for c in rows:
        if c.pruned_bound_rps is not None:
            bound = c.pruned_bound_rps
            print(f"{c.label:<34} {c.num_devices:>7} {'<=' + format(bound, '.3f'):>12} "
                  f"{'<=' + format(bound / c.num_devices, '.3f'):>11}  {'':>17} (pruned)")  # fmt: skip
            continue
        mark = " *" if c.at_bound else ""
        span = report.interval(c)
        spread = f"[{span[0]:.3f}, {span[1]:.3f}]" if span else ""
        print(f"{c.label:<34} {c.num_devices:>7} {c.goodput_rps:>12.3f} {c.per_device:>11.3f}  {spread:>17}{mark}")
    if any(c.at_bound for c in rows):
        print("* met the SLOs at its throughput bound (the search's ceiling); its true goodput is at most this")
    if any(c.pruned for c in rows):
        print(
            "(pruned): not simulated; its throughput bound (shown) was already below the best candidates "
            "found, so it could not have been chosen"
        )
    if report.candidate_intervals:
        n = len(report.candidate_intervals[0][1])
        print(
            f"range over seeds: rps/device on the search's workload and {n - 1} more samples of it (the same samples "
            f"for every candidate), for the best {args.interval_top} of each phase / kind"
        )
    if disagg is not None:
        print(f"\nbest disaggregated: {disagg.reason}")
        if simulated is not None:
            print(
                f"joint simulation of it (both SLOs, KV transfers included): {simulated:.3f} rps, {disagg_pd:.3f} rps/device"
            )
    if colocated is not None:
        print(f"best colocated: {describe(colocated.plan)} {colocated.goodput_per_device:.3f} rps/device")
    print(
        f"\nchosen: {describe(plan)} on {plan.num_devices} device(s): {goodput_rps:.3f} rps, "
        f"{goodput_rps / plan.num_devices:.3f} rps/device"
    )
    if precisions != (None,):
        print(_precision_line(plan, latency, precisions))
    print(f"why: {report.why}; {report.result.reason}")
    print(_assumed_limits(plan, latency, flagged=args.max_decode_batch is not None))
    if scaled.replicated:
        print(f"over the cluster: {scaled.why}")
    lead = report.lead()
    if lead is not None:
        print(f"sure of it? {lead}")
    for failure in report.failures:
        print(f"no plan of this kind: {failure}")
    if ratio is not None:
        print(f"\nprefill:decode ratios within {args.ratio_devices} devices (joint simulation):")
        for c in ratio.candidates:
            print(f"  {c.label:<40} {c.num_devices:>3} devices {c.goodput_rps:8.3f} rps {c.per_device:8.3f} rps/device")
        print(f"  best: {ratio.reason}")
    shown = report.plan.instances if scaled.replicated else plan.instances  # a unit stands for its copies
    if scaled.replicated:
        print(f"the unit's instances (copy k on nodes + {scaled.unit_nodes}·k; -o / --json hold every instance):")
    for inst in shown:
        print(f"  {inst.role:<8} {shape(inst):<8} devices {list(inst.devices or ())} nodes {list(inst.nodes or ())}")
    if args.output:
        print(f"plan written to {args.output}")
    return 0


def _precision_line(plan: DeploymentPlan, latency: LatencyProvider, allowed: tuple[str | None, ...]) -> str:
    """Which precisions were allowed, which each role got, and where their latency came from."""
    from placement.precision import precision_name

    kind: DeploymentKind = "colocated" if plan.kind == "colocated" else "disagg"
    roles: dict[str, str] = {}
    for inst in plan.instances:
        q = inst.quantization
        roles.setdefault(inst.role, f"{inst.role} {precision_name(q)} ({latency.precision_source(kind, inst.tp, q)})")
    allowed_names = ", ".join(precision_name(q) for q in allowed)
    return f"precision (allowed: {allowed_names}): {'; '.join(roles.values())}"


def _assumed_limits(plan: DeploymentPlan, latency: LatencyProvider, flagged: bool) -> str:
    """Which engine caps the plan assumed, and where the decode batch cap came from."""
    limits, profile = plan.limits, latency.profile
    assert limits is not None
    role = "colocated" if plan.kind == "colocated" else "decode"
    if flagged:
        source = "--max-decode-batch"
    elif profile is not None and latency.profile_decode_batch(plan.kind) is not None:
        source = f"the {plan.kind} engines of profile {profile.name} ({profile.limits_source or 'no source given'})"
    else:
        source = "the serving default (no profile limits)"
    return (
        f"assumed: at most {limits.max_decode_batch} running sequences per {role} instance, from {source}; "
        f"{limits.max_batch_tokens} tokens per prefill step; {limits.num_kv_blocks} KV blocks"
    )


def _emit_json(args: argparse.Namespace, plan: DeploymentPlan) -> bool:
    """Write the plan to `--output`; with `--json` print it too and say the table is not wanted."""
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(plan.to_json() + "\n")
    if args.json:
        print(plan.to_json())
    return bool(args.json)


def _run_conversations(args: argparse.Namespace, ctx: SearchContext) -> int:
    """`--conversations N`: plan a deployment and caching policy for a multi-turn workload."""
    import numpy as np

    from jaxserve.core.plan import PlanError
    from placement.conversations import ConversationSpec, generate_conversations
    from placement.precision import shape
    from placement.prefix_plan import Kind, plan_for_conversations

    try:
        thresholds = [int(t) for t in args.local_prefill_tokens.split(",") if t.strip()]
        if args.conversations < 1 or not thresholds or min(thresholds) < 0:
            raise ValueError
    except ValueError:
        print(
            "jaxserve plan: error: --conversations needs N >= 1 and --local-prefill-tokens integers >= 0",
            file=sys.stderr,
        )
        return 2
    kinds: tuple[Kind, ...] = ("disagg", "colocated") if args.kind == "auto" else (args.kind,)
    conversations = generate_conversations(ConversationSpec(), args.conversations, np.random.default_rng(args.seed))
    progress = None if args.no_progress else _progress_bar()
    try:
        report = plan_for_conversations(
            ctx, conversations, local_thresholds=thresholds, kinds=kinds, affinity=args.affinity,
            workers=args.workers, seed=args.seed, progress=progress,
        )  # fmt: skip
    except PlanError as e:
        print(f"jaxserve plan: error: {e}", file=sys.stderr)
        return 1
    finally:
        if progress is not None:
            progress.close()
    plan = report.plan
    if _emit_json(args, plan):
        return 0
    cfg, cluster, slo = ctx.latency.cfg, ctx.cluster, ctx.slo
    print(
        f"{cfg.name} on {cluster.num_nodes} x {cluster.devices_per_node} {cluster.device.name}, "
        f"{args.conversations} conversations ({len(conversations.turns)} requests; an unbounded cache would serve "
        f"{report.ideal_hit_rate:.1%} of prompt tokens), TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s "
        f"at {slo.attainment:.0%} ({slo.mode})"
    )
    print(f"\n{'proposed by':<12} {'plan':<34} {'caching':<28} {'goodput rps':>11} {'rps/device':>10}")
    for a in report.arms:
        screen = "cache screen" if a.source == "cached" else "plain screen"
        print(
            f"{screen:<12} {a.plan.describe():<34} {a.label:<28} {a.goodput_rps:>11.3f} {a.goodput_per_device:>10.3f}"
        )
    print()
    for kind in kinds:
        try:
            with_cache, without = report.best_of(kind, cached=True), report.best_of(kind, cached=False)
        except ValueError:
            print(f"{kind}: no plan met the SLOs")
            continue
        print(
            f"{kind}: {without.goodput_per_device:.3f} rps/device without caching ({without.plan.describe()}), "
            f"{with_cache.goodput_per_device:.3f} with ({with_cache.plan.describe()}, {with_cache.label})"
        )
    best, plain = report.best, report.best_without_caching()
    gain = best.goodput_per_device / plain.goodput_per_device if plain.goodput_per_device > 0 else float("inf")
    print(
        f"\nchosen: {plan.describe()} with {best.label}: {best.goodput_rps:.3f} rps, {best.goodput_per_device:.3f} "
        f"rps/device ({gain:.2f}x the best without caching, {plain.plan.describe()} {plain.goodput_per_device:.3f}); "
        f"hit rate {report.hit_rate:.1%} at that rate"
    )
    if best.policy.enabled:
        local = best.policy.local_prefill_tokens
        print("serve it with prefix caching (the default)" + (f" and --local-prefill-tokens {local}" if local else ""))
    else:
        print("serve it with: --no-prefix-caching")
    for inst in plan.instances:
        print(f"  {inst.role:<8} {shape(inst):<8} devices {list(inst.devices or ())} nodes {list(inst.nodes or ())}")
    if args.output:
        print(f"plan written to {args.output}")
    return 0


class _Progress:
    def __init__(self) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=0, desc="candidates", file=sys.stderr, leave=False, disable=None)  # off when not a tty

    def __call__(self, done: int, total: int) -> None:
        if self._bar.total != total or done == 1:
            self._bar.reset(total=total)
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _progress_bar() -> _Progress:
    return _Progress()
