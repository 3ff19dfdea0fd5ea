#!/usr/bin/env python
"""Simulator vs engine on this machine: does `jaxserve simulate` predict what `jaxserve bench` measures?

Steps (all live, nothing precomputed):

1. `jaxserve profile` times the real engine on a grid around the workload's shapes and fits the
   Appendix-A coefficients and L_m — pinned to the cores the deployment will be served on.
2. For each deployment (default: `disagg:prefill=tp1,decode=tp1` and `colocated:tp1`), a real
   `jaxserve serve` is started with the runtime limits the simulator is told about (L_m from the
   profile, decode batch, KV blocks enough that the batch limit binds first) and warmed up.
3. Calibration (`--profile-from server`, the default): bursts of 1, 2, 4 … requests and one Poisson
   run, then `jaxserve profile --from-server` fits the model to the steps the server recorded — what
   a step costs in the serving process, not in the engine alone. These runs are not checked.
4. The bench drives the server at 4 rates chosen to span ~50–100 % predicted attainment, and the
   simulator runs the same deployment over the *same trace* — the requests' real send times and
   lengths — with the served profile; its attainment and P90 TTFT/TPOT are printed next to the
   measured ones, and the engine profile's attainment next to those.

    .venv/bin/python scripts/check_simulator.py                       # the defaults below
    .venv/bin/python scripts/check_simulator.py --num-requests 120 --json out.json --plot docs/x.png

Pinning (default; `--no-pin` turns it off): the server runs on its first N cores (`serve --cpus`,
N = its devices; all of them if the machine has no more), the load generator — this process — on
the rest (or shares them when none are left), and each deployment's engines are profiled on the
same cores, in padded shapes (the `jaxserve profile` default). XLA runs every device of a
process on one intra-op pool sized to the cores it may use (at least one thread per device), so
without pinning a "device" is not one core, the client steals from the server, and an idle pool
pays wake-ups that a busy one does not.

The SLOs default to multiples of the fitted model's own step times (`--ttft-factor`, `--tpot-factor`),
so the check means the same on a faster or slower machine. `check()` is what the slow test calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jaxserve.core.limits import DEFAULT_LIMITS  # noqa: E402
from jaxserve.core.plan import DeploymentPlan, parse_deployment  # noqa: E402
from jaxserve.tools.bench import launch, loadgen  # noqa: E402
from jaxserve.tools.bench.records import RequestRecord, summarize  # noqa: E402
from models.config import get_config  # noqa: E402
from placement.goodput import GoodputSearch  # noqa: E402
from placement.hardware import ClusterSpec, get_device  # noqa: E402
from placement.latency import (  # noqa: E402
    DeploymentKind,
    LatencyProvider,
    load_profile,
)
from placement.simulator import SimOptions, simulate  # noqa: E402
from placement.slo import SloSpec  # noqa: E402
from placement.step_time import decode_step_s, prefill_step_s  # noqa: E402
from placement.workload import Workload, generate, get_length_distribution  # noqa: E402

DEFAULT_DEPLOYMENTS = ("disagg:prefill=tp1,decode=tp1", "colocated:tp1")


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    model: str = "opt-mini"
    workload: str = "fixed:256:32"
    num_requests: int = 60
    seed: int = 0
    deployments: tuple[str, ...] = DEFAULT_DEPLOYMENTS
    ttft_factor: float = 2.5  # TTFT SLO = factor × one prompt's prefill (fitted)
    tpot_factor: float = 3.0  # TPOT SLO = factor × one batch-1 decode step (fitted)
    ttft_s: float | None = None
    tpot_s: float | None = None
    max_decode_batch: int = DEFAULT_LIMITS.max_decode_batch
    block_size: int = DEFAULT_LIMITS.block_size
    rates: dict[str, tuple[float, ...]] | None = None  # per deployment; default: chosen by prediction
    profile: str | None = None  # an existing profile instead of profiling now
    workdir: str | None = None
    log: bool = True
    # Time the dist (prefill/decode) engines with the neighbouring device busy with the other phase:
    # a disaggregated deployment's two devices share its cores and one XLA thread pool.
    busy_neighbour: bool = True
    # Serve each deployment on its own cores (N devices: cores 0..N-1) and run the client on the rest.
    pin: bool = True
    # Predict from what each server's own steps cost ("server": `jaxserve profile --from-server` after a
    # calibration pass of bursts and one Poisson run, separate from the checked runs) or from the
    # engine timed alone ("engine"); the other prediction is printed next to it.
    profile_from: str = "server"


@dataclasses.dataclass
class RatePoint:
    deployment: str
    rate: float
    measured: float
    predicted: float
    measured_p90_ttft_s: float
    predicted_p90_ttft_s: float
    measured_p90_tpot_s: float
    predicted_p90_tpot_s: float
    num_failed: int
    other: dict[str, float] | None = None  # the prediction from the other profile (engine or served)

    @property
    def diff_points(self) -> float:
        return 100 * (self.predicted - self.measured)

    @property
    def other_diff_points(self) -> float:
        return 100 * (self.other["attainment"] - self.measured) if self.other else math.nan


@dataclasses.dataclass
class CheckResult:
    profile_path: str
    slo: SloSpec
    points: list[RatePoint]
    seconds: float
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)  # os.getloadavg() before and after
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    profile_from: str = "engine"

    def diffs(self) -> np.ndarray:
        return np.array([p.diff_points for p in self.points])

    def table(self) -> str:
        head = (
            f"{'deployment':<32}{'rate':>7}{'attain meas':>12}{'pred':>7}{'diff':>7}"
            f"{'P90 TTFT meas':>15}{'pred':>8}{'P90 TPOT meas':>15}{'pred':>8}"
            f"{'| other profile: pred':>22}{'diff':>7}"
        )
        lines = [head, "-" * len(head)]
        for p in self.points:
            lines.append(
                f"{p.deployment:<32}{p.rate:>7.2f}{100 * p.measured:>11.1f}%{100 * p.predicted:>6.1f}%"
                f"{p.diff_points:>+7.1f}{1e3 * p.measured_p90_ttft_s:>13.1f}ms{1e3 * p.predicted_p90_ttft_s:>6.1f}ms"
                f"{1e3 * p.measured_p90_tpot_s:>13.1f}ms{1e3 * p.predicted_p90_tpot_s:>6.1f}ms"
                + (f"{100 * p.other['attainment']:>21.1f}%{p.other_diff_points:>+7.1f}" if p.other else "")
            )
        d = np.abs(self.diffs())
        lines.append(
            f"predicted from the {self.profile_from} profile; SLO: TTFT <= {1e3 * self.slo.ttft_s:.1f} ms, TPOT <= {1e3 * self.slo.tpot_s:.1f} ms; "
            f"|diff| max {d.max():.1f} points, median {np.median(d):.1f} points; "
            f"load average before {self.load_before[0]:.2f}, after {self.load_after[0]:.2f}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile_path,
            "slo": dataclasses.asdict(self.slo),
            "profile_from": self.profile_from,
            "points": [
                {**dataclasses.asdict(p), "diff_points": p.diff_points, "other_diff_points": p.other_diff_points}
                for p in self.points
            ],
            "max_abs_diff_points": float(np.abs(self.diffs()).max()),
            "median_abs_diff_points": float(np.median(np.abs(self.diffs()))),
            "seconds": self.seconds,
            "load_before": self.load_before,
            "load_after": self.load_after,
        }


def _say(cfg: CheckConfig, msg: str) -> None:
    if cfg.log:
        print(f"[check] {msg}", file=sys.stderr, flush=True)


def fixed_lengths(workload: str) -> tuple[int, int]:
    dist = get_length_distribution(workload)
    if not isinstance(dist.input, int) or not isinstance(dist.output, int):
        raise ValueError("the check uses a fixed:IN:OUT workload (its grid and warm-up follow those shapes)")
    return dist.input, dist.output


def run_profile(
    cfg: CheckConfig, out: Path, tps: list[int], engine: str = "disagg,colocated", cpus: tuple[int, ...] | None = None
) -> Path:
    """`jaxserve profile` in a child process (so its XLA flags apply) on a grid around the workload."""
    n_in, n_out = fixed_lengths(cfg.workload)
    lengths = sorted({max(16, n_in // 4), max(16, n_in // 2), n_in, 2 * n_in})
    contexts = sorted({n_in, n_in + n_out // 2, n_in + n_out})
    # Between powers of two too: the engine pads a decode batch to the next power of two, and the fit
    # should average over those steps as the running batch wanders, not interpolate between bucket edges.
    batches = [b for b in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64) if b <= cfg.max_decode_batch]
    cmd = [
        sys.executable, "-m", "jaxserve", "profile", "--model", cfg.model, "--tp", ",".join(map(str, tps)),
        "--prefill-lengths", ",".join(map(str, lengths)), "--prefill-batches", "1,2,3,4",
        "--decode-batches", ",".join(map(str, batches)), "--decode-contexts", ",".join(map(str, contexts)),
        "--block-size", str(cfg.block_size), "-o", str(out), "--samples-out", str(out.with_suffix(".samples.json")),
        "--engines", engine,
    ]  # fmt: skip
    if cpus:
        cmd += ["--cpus", ",".join(map(str, cpus))]
    if cfg.busy_neighbour and "disagg" in engine:
        # dist engines timed while a peer device runs the other phase, as in the disaggregated deployment
        cmd += ["--busy-neighbour", str(n_in)]
    devices = 2 * max(tps) if cfg.busy_neighbour and "disagg" in engine else max(tps)
    env = {**os.environ, "XLA_FLAGS": launch.cpu_xla_flags(devices), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"jaxserve profile failed:\n{done.stderr[-2000:]}")
    _say(cfg, done.stdout.strip())
    return out


def provider(cfg: CheckConfig, profile_path: Path) -> LatencyProvider:
    return LatencyProvider(get_config(cfg.model), get_device("cpu"), load_profile(str(profile_path)))


def default_slo(cfg: CheckConfig, latency: LatencyProvider) -> SloSpec:
    n_in, _ = fixed_lengths(cfg.workload)
    engine: DeploymentKind = "disagg" if latency.supports("disagg", 1) else "colocated"
    model, overhead = latency.instance(engine, 1, 1), latency.step_overhead(engine, 1)
    # a step as the simulator charges it: kernels plus the profile's per-step overhead
    ttft = cfg.ttft_s or cfg.ttft_factor * prefill_step_s(model, overhead, [n_in])
    tpot = cfg.tpot_s or cfg.tpot_factor * decode_step_s(model, overhead, 1, float(n_in))
    return SloSpec(round(ttft, 4), round(tpot, 4))


def sim_options(cfg: CheckConfig, latency: LatencyProvider, plan: DeploymentPlan) -> SimOptions:
    engine: DeploymentKind = "colocated" if plan.kind == "colocated" else "disagg"
    return SimOptions.planning(
        block_size=cfg.block_size,
        max_decode_batch=cfg.max_decode_batch,
        max_batch_tokens=latency.prefill_token_budget(engine, plan.instances[0].tp),
        stop_early=False,
    )


def cluster_for(plan: DeploymentPlan) -> ClusterSpec:
    return ClusterSpec(get_device("cpu"), num_nodes=1, devices_per_node=max(plan.num_devices, 1))


def predict(cfg: CheckConfig, latency: LatencyProvider, spec: str, trace: Workload, slo: SloSpec) -> dict[str, float]:
    plan = parse_deployment(spec).assign_devices()
    result = simulate(plan, latency, cluster_for(plan), trace, None, sim_options(cfg, latency, plan))
    done = result.finished
    return {
        "attainment": result.attainment(slo),
        "p90_ttft_s": float(np.percentile(result.ttft_s[done], 90)) if done.any() else math.inf,
        "p90_tpot_s": float(np.percentile(result.tpot_s[done], 90)) if done.any() else math.inf,
    }


def base_workload(cfg: CheckConfig) -> Workload:
    return generate(cfg.workload, 1.0, cfg.num_requests, np.random.default_rng(cfg.seed))


def choose_rates(cfg: CheckConfig, latency: LatencyProvider, spec: str, slo: SloSpec) -> tuple[float, ...]:
    """Four rates spanning the *predicted* fall of attainment from ~100 % to ~50 %.

    The prediction only places the rates; the measurement is independent of it. A fixed-length workload
    can fall off a cliff, so the rates are spread geometrically between the last rate predicted at
    ≥ 97 % (or a quarter of the next, if that is higher: long runs at tiny rates add nothing) and the
    first predicted below 50 %, rather than picked at attainment levels.
    """
    plan = parse_deployment(spec).assign_devices()
    base = base_workload(cfg)
    search = GoodputSearch(plan, latency, cluster_for(plan), base, slo, sim_options(cfg, latency, plan))
    grid = np.geomspace(search.throughput_bound() / 20, search.throughput_bound() * 1.5, 60)
    att = np.array([predict(cfg, latency, spec, base.with_rate(r), slo)["attainment"] for r in grid])
    below = np.nonzero(att < 0.5)[0]
    hi_i = int(below[0]) if len(below) else len(grid) - 1
    ok = np.nonzero(att[:hi_i] >= 0.97)[0]
    lo_i = int(ok[-1]) if len(ok) else 0
    hi = float(grid[hi_i])
    lo = max(float(grid[lo_i]), hi / 4)  # a slow fall is sampled from a quarter of the 50 % rate up
    return tuple(round(float(r), 3) for r in np.geomspace(lo, hi, 4))


def server_args(cfg: CheckConfig, latency: LatencyProvider, spec: str) -> list[str]:
    """Runtime limits the simulator is told about; KV blocks enough that the batch limit binds first."""
    plan = parse_deployment(spec)
    engine: DeploymentKind = "colocated" if plan.kind == "colocated" else "disagg"
    n_in, n_out = fixed_lengths(cfg.workload)
    blocks = cfg.max_decode_batch * -(-(n_in + n_out) // cfg.block_size) + 16
    return [
        "--max-batch-tokens", str(latency.prefill_token_budget(engine, plan.instances[0].tp)),
        "--max-decode-batch", str(cfg.max_decode_batch), "--num-kv-blocks", str(blocks),
        "--block-size", str(cfg.block_size), "--max-queued-requests", "100000",
        "--no-prefix-caching",  # the simulator checked against is cache-blind
    ]  # fmt: skip


def served_profile(
    cfg: CheckConfig, latency: LatencyProvider, spec: str, server: launch.ServeProcess, workdir: Path
) -> LatencyProvider:
    """A calibration pass against the warmed-up server, then `jaxserve profile --from-server` on its steps.

    The pass — bursts of 1, 2, 4 … simultaneous requests (every decode batch size) and one Poisson run
    at the engine profile's lowest check rate — is not one of the checked runs.
    """
    n_in, n_out = fixed_lengths(cfg.workload)
    since = _server_now(server.http_address)
    launch.warm_up(server.grpc_address, n_in, n_out, cfg.max_decode_batch, get_config(cfg.model).vocab_size, rounds=1)
    rate = choose_rates(cfg, latency, spec, default_slo(cfg, latency))[0]
    loadgen.run(base_workload(cfg).with_rate(rate), loadgen.Target(server.grpc_address), seed=cfg.seed + 1)
    out = workdir / f"served-{engine_of(spec)}.json"
    cmd = [
        sys.executable, "-m", "jaxserve", "profile", "--model", cfg.model, "--deployment", spec,
        "--from-server", server.http_address, "--since", repr(since), "--block-size", str(cfg.block_size),
        "--prefill-tokens", str(latency.prefill_token_budget(engine_of(spec), parse_deployment(spec).instances[0].tp)),
        "--device-name", "cpu",
        "-o", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"jaxserve profile --from-server failed:\n{done.stderr[-2000:]}")
    _say(cfg, done.stdout.strip())
    return provider(cfg, out)


def _server_now(http_address: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://{http_address}/debug/steps?since=1e300", timeout=30) as response:
        return float(json.loads(response.read())["now"])


def measure_deployment(
    cfg: CheckConfig,
    latency: LatencyProvider,
    spec: str,
    slo: SloSpec,
    workdir: Path,
    server_cpus: tuple[int, ...] | None = None,
) -> list[RatePoint]:
    n_in, n_out = fixed_lengths(cfg.workload)
    vocab = get_config(cfg.model).vocab_size
    points = []
    log = workdir / f"serve-{spec.replace(':', '_').replace(',', '_').replace('=', '')}.log"
    with launch.ServeProcess(
        spec, cfg.model, server_args(cfg, latency, spec), log_path=log, cpus=server_cpus
    ) as server:
        _say(cfg, f"{spec}: serving at {server.grpc_address}; warming up")
        launch.warm_up(server.grpc_address, n_in, n_out, cfg.max_decode_batch, vocab)
        target = loadgen.Target(server.grpc_address)
        info = loadgen.probe(target)
        engine_profile, other = latency, None
        if cfg.profile_from == "server":
            latency, other = served_profile(cfg, engine_profile, spec, server, workdir), engine_profile
        rates = (cfg.rates or {}).get(spec) or choose_rates(cfg, latency, spec, slo)
        _say(cfg, f"{spec}: rates {rates}")
        base = base_workload(cfg)
        for rate in rates:
            run = loadgen.run(base.with_rate(rate), target, info=info, seed=cfg.seed)
            records: list[RequestRecord] = run.records
            measured = summarize(records, slo)
            trace = loadgen.workload_from_records(records, rate)
            predicted = predict(cfg, latency, spec, trace, slo)
            point = RatePoint(
                spec,
                rate,
                measured["attainment"],
                predicted["attainment"],
                measured["ttft_s"]["p90"],
                predicted["p90_ttft_s"],
                measured["tpot_s"]["p90"],
                predicted["p90_tpot_s"],
                measured["failed"],
                predict(cfg, other, spec, trace, slo) if other is not None else None,
            )
            points.append(point)
            _say(
                cfg,
                f"{spec} @ {rate:.2f} rps: measured {point.measured:.1%} predicted {point.predicted:.1%} "
                f"(P90 TTFT {1e3 * point.measured_p90_ttft_s:.1f}/{1e3 * point.predicted_p90_ttft_s:.1f} ms, "
                f"P90 TPOT {1e3 * point.measured_p90_tpot_s:.1f}/{1e3 * point.predicted_p90_tpot_s:.1f} ms)"
                + (f"; engine profile predicted {point.other['attainment']:.1%}" if point.other else ""),
            )
            time.sleep(0.3)
    return points


def placement_cpus(cfg: CheckConfig, spec: str) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(server cores, client cores) for a deployment: its N devices on the first N cores, the client on the rest."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    n = parse_deployment(spec).num_devices
    if not cfg.pin or n >= len(cores):
        return (cores if cfg.pin else None), None
    return cores[:n], cores[n:]


def engine_of(spec: str) -> DeploymentKind:
    return "colocated" if parse_deployment(spec).kind == "colocated" else "disagg"


def profile_all(cfg: CheckConfig, workdir: Path) -> Path:
    """One profile run per deployment (each on the cores it will be served on), merged into one file."""
    merged: dict[str, Any] = {"entries": []}
    samples: dict[str, Any] = {"measurements": []}
    for spec in cfg.deployments:
        engine = engine_of(spec)
        tps = sorted({i.tp for i in parse_deployment(spec).instances})
        server_cpus, _ = placement_cpus(cfg, spec)
        if any(e["engine"] == engine and e["tp"] in tps for e in merged["entries"]):
            continue
        _say(cfg, f"profiling {cfg.model} {engine} at tp {tps} on CPUs {server_cpus}")
        out = run_profile(cfg, workdir / f"profile-{engine}.json", tps, engine, server_cpus)
        part = json.loads(out.read_text())
        merged = {**part, "entries": merged["entries"] + part["entries"]}
        raw = json.loads(out.with_suffix(".samples.json").read_text())
        samples["measurements"] += [{**m, "engines": [engine]} for m in raw["measurements"]]
    path = workdir / "profile.json"
    path.write_text(json.dumps(merged, indent=2) + "\n")
    path.with_suffix(".samples.json").write_text(json.dumps(samples))
    return path


def check(cfg: CheckConfig) -> CheckResult:
    started = time.perf_counter()
    load_before = os.getloadavg()
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="jaxserve-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    profile_path = Path(cfg.profile) if cfg.profile else profile_all(cfg, workdir)
    latency = provider(cfg, profile_path)
    slo = default_slo(cfg, latency)
    _say(cfg, f"SLO: TTFT <= {1e3 * slo.ttft_s:.1f} ms, TPOT <= {1e3 * slo.tpot_s:.1f} ms")
    points: list[RatePoint] = []
    mine = os.sched_getaffinity(0)
    try:
        for spec in cfg.deployments:
            server_cpus, client_cpus = placement_cpus(cfg, spec)
            _say(cfg, f"{spec}: server CPUs {server_cpus}, client CPUs {client_cpus or 'shared'}")
            os.sched_setaffinity(0, set(client_cpus) if client_cpus else mine)
            points.extend(measure_deployment(cfg, latency, spec, slo, workdir, server_cpus))
    finally:
        os.sched_setaffinity(0, mine)
    return CheckResult(
        str(profile_path), slo, points, time.perf_counter() - started, load_before, os.getloadavg(), cfg.profile_from
    )


def plot(result: CheckResult, path: str) -> None:
    from jaxserve.tools.bench.plot import plot_attainment

    solid: dict[str, list[tuple[float, float]]] = {}
    dashed: dict[str, list[tuple[float, float]]] = {}
    for p in result.points:
        solid.setdefault(f"{p.deployment} measured", []).append((p.rate, p.measured))
        dashed.setdefault(f"{p.deployment} simulated", []).append((p.rate, p.predicted))
    solid_by_dep = {k.removesuffix(" measured"): v for k, v in solid.items()}
    dashed_by_dep = {f"{k.removesuffix(' simulated')} (simulated)": v for k, v in dashed.items()}
    plot_attainment(
        path,
        solid_by_dep,
        target=None,
        dashed=dashed_by_dep,
        title=f"measured (solid) vs simulated (dashed); TTFT<={1e3 * result.slo.ttft_s:.0f}ms "
        f"TPOT<={1e3 * result.slo.tpot_s:.0f}ms",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = CheckConfig()
    p.add_argument("--model", default=d.model)
    p.add_argument("--workload", default=d.workload, help="fixed:IN:OUT")
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--deployment", action="append", default=None, help="repeat; default disagg 1+1 and colocated tp1")
    p.add_argument("--ttft-factor", type=float, default=d.ttft_factor)
    p.add_argument("--tpot-factor", type=float, default=d.tpot_factor)
    p.add_argument("--ttft", type=float, default=None, help="TTFT SLO, seconds (overrides the factor)")
    p.add_argument("--tpot", type=float, default=None, help="TPOT SLO, seconds (overrides the factor)")
    p.add_argument("--rates", action="append", default=None, help="SPEC=R1,R2,… (repeat per deployment)")
    p.add_argument("--profile", default=None, help="use this profile instead of profiling now")
    p.add_argument("--workdir", default=None)
    p.add_argument("--alone", action="store_true", help="profile the dist engines without a busy neighbour")
    p.add_argument("--no-pin", action="store_true", help="let servers, profiler and client share every core")
    p.add_argument(
        "--profile-from",
        choices=["server", "engine"],
        default=d.profile_from,
        help="predict from each server's recorded steps (after a calibration pass) or the engine timed alone",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    rates = None
    if args.rates:
        rates = {}
        for item in args.rates:
            spec, _, values = item.rpartition("=")
            rates[spec] = tuple(float(x) for x in values.split(","))
    cfg = CheckConfig(
        model=args.model,
        workload=args.workload,
        num_requests=args.num_requests,
        seed=args.seed,
        deployments=tuple(args.deployment or DEFAULT_DEPLOYMENTS),
        ttft_factor=args.ttft_factor,
        tpot_factor=args.tpot_factor,
        ttft_s=args.ttft,
        tpot_s=args.tpot,
        rates=rates,
        profile=args.profile,
        workdir=args.workdir,
        busy_neighbour=not args.alone,
        pin=not args.no_pin,
        profile_from=args.profile_from,
    )
    result = check(cfg)
    print(result.table())
    print(f"({result.seconds:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)
    d_abs = np.abs(result.diffs())
    return 0 if d_abs.max() <= 5 and np.median(d_abs) <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
