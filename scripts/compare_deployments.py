#!/usr/bin/env python
"""Colocated vs disaggregated on this machine: per-device goodput, measured and predicted.

The paper's Figure 1 scaled to a CPU: every request `fixed:IN:OUT` (default 256 in / 32 out, the
paper's 8:1), SLOs as multiples of the fitted model's own step times (`--ttft-factor` × one prefill,
`--tpot-factor` × one batch-1 decode step; the paper's 0.4 s / 0.04 s are ≈ 4× and ≈ 2× OPT-13B's on
an A100). Each deployment is served on as many cores as it has devices (`serve --cpus`), the bench
client on the remaining cores when there are any, so "per device" means per core.

1. Scaling check: the same prefill on one device, then on two at once in one process — how much
   of two cores two XLA CPU devices really get (a diagnostic; the devices share one thread pool).
2. `jaxserve profile` of each deployment's engines on its own cores (or `--profile`): the
   engine-profile prediction of each deployment's goodput (`placement.goodput.max_rate`).
3. For each deployment a real pinned `jaxserve serve`, warmed up, calibrated (bursts and one
   Poisson run, then `jaxserve profile --from-server` on its recorded steps: the served profile
   and its prediction), then measured with `jaxserve bench --sweep-rates` (bisection from the
   served prediction).
4. `jaxserve plan --profile <both served profiles>` for a 2-device CPU machine with the servers'
   limits: colocated or disaggregated, whichever it predicts serves more per device.
5. One table and one plot (`--plot`, default docs/compare_deployments.png): attainment vs rate per
   device, measured probes (solid) and the simulator's curve (dashed).

    .venv/bin/python scripts/compare_deployments.py [--num-requests 80] [--profile p.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import check_simulator as cs  # noqa: E402

from jaxserve.core.plan import parse_deployment  # noqa: E402
from jaxserve.tools.bench import launch  # noqa: E402
from models.config import get_config  # noqa: E402
from placement.goodput import GoodputSearch, max_rate  # noqa: E402
from placement.slo import SloSpec  # noqa: E402

DEPLOYMENTS = ("colocated:tp1", "disagg:prefill=tp1,decode=tp1")


def scaling_check(model: str) -> dict[str, float]:
    code = f"import json; from jaxserve.runtime.profiling import parallel_scaling; print(json.dumps(parallel_scaling({model!r})))"
    env = {**os.environ, "XLA_FLAGS": launch.cpu_xla_flags(2), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def predicted_goodput(cfg: cs.CheckConfig, latency, spec: str, slo: SloSpec, num_requests: int) -> float:  # type: ignore[no-untyped-def]
    plan = parse_deployment(spec).assign_devices()
    base = cs.generate(cfg.workload, 1.0, num_requests, np.random.default_rng(cfg.seed))
    opts = dataclasses.replace(cs.sim_options(cfg, latency, plan), stop_early=True)
    return max_rate(GoodputSearch(plan, latency, cs.cluster_for(plan), base, slo, opts), rel_tol=0.02)


def predicted_curve(
    cfg: cs.CheckConfig, latency, spec: str, slo: SloSpec, rates: list[float]
) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    base = cs.base_workload(cfg)
    return [(r, cs.predict(cfg, latency, spec, base.with_rate(r), slo)["attainment"]) for r in rates]


def plan_choice(cfg: cs.CheckConfig, profile: Path, slo: SloSpec) -> str:
    cmd = [
        sys.executable, "-m", "jaxserve", "plan", "--model", cfg.model, "--device", "cpu", "--nodes", "1",
        "--devices-per-node", "2", "--workload", cfg.workload, "--ttft", str(slo.ttft_s), "--tpot", str(slo.tpot_s),
        "--profile", str(profile), "--no-progress", "--workers", "1", "--num-requests", str(cfg.num_requests),
        "--max-decode-batch", str(cfg.max_decode_batch),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return f"(plan failed: {done.stderr.strip()[-300:]})"
    return done.stdout.strip()


def measured_sweep(
    cfg: cs.CheckConfig, latency, spec: str, slo: SloSpec, workdir: Path, max_probes: int
) -> tuple[dict, Path, float]:  # type: ignore[no-untyped-def]
    """Calibrate on the warmed-up server (its served profile), then bisect its goodput from that profile's
    prediction; returns the sweep, the served profile's path and the served prediction (rps)."""
    n_in, n_out = cs.fixed_lengths(cfg.workload)
    out = workdir / f"bench-{spec.replace(':', '_').replace(',', '_').replace('=', '')}.json"
    log = workdir / f"serve-{out.stem}.log"
    server_cpus, client_cpus = cs.placement_cpus(cfg, spec)
    with launch.ServeProcess(
        spec, cfg.model, cs.server_args(cfg, latency, spec), log_path=log, cpus=server_cpus
    ) as server:
        launch.warm_up(server.grpc_address, n_in, n_out, cfg.max_decode_batch, get_config(cfg.model).vocab_size)
        served = cs.served_profile(cfg, latency, spec, server, workdir)
        start = predicted_goodput(cfg, served, spec, slo, cfg.num_requests)
        cmd = [
            sys.executable, "-m", "jaxserve", "bench", "--target", server.grpc_address, "--workload", cfg.workload,
            "--rate", f"{max(start, 0.05):.4f}", "--num-requests", str(cfg.num_requests), "--seed", str(cfg.seed),
            "--ttft", str(slo.ttft_s), "--tpot", str(slo.tpot_s), "--sweep-rates", "--max-probes", str(max_probes),
            "--rel-tol", "0.1", "--json", str(out), "--quiet",
        ]  # fmt: skip
        pin = (lambda: os.sched_setaffinity(0, set(client_cpus))) if client_cpus else None
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, preexec_fn=pin)
        if done.returncode != 0:
            raise RuntimeError(f"bench failed: {done.stderr[-1500:]}")
        print(done.stdout.strip(), file=sys.stderr)
    return dict(json.loads(out.read_text())["targets"][0]), workdir / f"served-{cs.engine_of(spec)}.json", start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-mini")
    p.add_argument("--workload", default="fixed:256:32")
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-factor", type=float, default=4.0)
    p.add_argument("--tpot-factor", type=float, default=2.0)
    p.add_argument("--ttft", type=float, default=None, help="TTFT SLO, seconds (overrides the factor)")
    p.add_argument("--tpot", type=float, default=None, help="TPOT SLO, seconds (overrides the factor)")
    p.add_argument("--max-probes", type=int, default=6)
    p.add_argument("--profile", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--plot", default=str(ROOT / "docs" / "compare_deployments.png"))
    p.add_argument("--json", default=None)
    p.add_argument("--skip-scaling", action="store_true")
    args = p.parse_args()
    started = time.perf_counter()
    cfg = cs.CheckConfig(
        deployments=DEPLOYMENTS,
        model=args.model,
        workload=args.workload,
        num_requests=args.num_requests,
        seed=args.seed,
        ttft_factor=args.ttft_factor,
        tpot_factor=args.tpot_factor,
        ttft_s=args.ttft,
        tpot_s=args.tpot,
        profile=args.profile,
    )
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="jaxserve-compare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict = {"workload": cfg.workload, "model": cfg.model}
    if not args.skip_scaling:
        scaling = scaling_check(cfg.model)
        report["scaling"] = scaling
        print(
            f"scaling: one prefill alone {1e3 * scaling['alone_s_per_call']:.1f} ms/call; two devices at once do "
            f"{scaling['speedup']:.2f}x the work of one",
            file=sys.stderr,
        )
    profile = Path(cfg.profile) if cfg.profile else cs.profile_all(cfg, workdir)
    latency = cs.provider(cfg, profile)
    slo = cs.default_slo(cfg, latency)
    report["slo"] = dataclasses.asdict(slo)
    report["profile"] = str(profile)
    print(f"SLO: TTFT <= {1e3 * slo.ttft_s:.1f} ms, TPOT <= {1e3 * slo.tpot_s:.1f} ms", file=sys.stderr)
    rows: list[tuple[str, int, float, float, float]] = []
    curves_meas: dict[str, list[tuple[float, float]]] = {}
    curves_pred: dict[str, list[tuple[float, float]]] = {}
    served_entries: list[dict] = []
    for spec in DEPLOYMENTS:
        devices = parse_deployment(spec).num_devices
        pred_engine = predicted_goodput(cfg, latency, spec, slo, cfg.num_requests)  # the bench's very requests
        sweep, served_path, pred = measured_sweep(cfg, latency, spec, slo, workdir, args.max_probes)
        served_entries += json.loads(served_path.read_text())["entries"]
        served = cs.provider(cfg, served_path)
        meas = float(sweep["sweep"]["goodput_rps"])
        probes = [(float(q["rate"]), float(q["attainment"])) for q in sweep["sweep"]["probes"]]
        rows.append((spec, devices, meas, pred, pred_engine))
        curves_meas[spec] = [(r / devices, a) for r, a in probes]
        grid = sorted({r for r, _ in probes} | set(np.geomspace(max(pred, 0.05) / 3, max(pred, 0.05) * 2.5, 10)))
        curves_pred[f"{spec} (simulated)"] = [
            (r / devices, a) for r, a in predicted_curve(cfg, served, spec, slo, grid)
        ]
        report.setdefault("deployments", []).append(
            {
                "deployment": spec,
                "devices": devices,
                "measured_goodput_rps": meas,
                "predicted_goodput_rps": pred,
                "engine_profile_predicted_goodput_rps": pred_engine,
                "served_profile": str(served_path),
                "probes": probes,
            }
        )
    served_all = workdir / "served.json"
    served_all.write_text(json.dumps({"name": f"{cfg.model}-served", "device": "cpu", "entries": served_entries}))
    choice = plan_choice(cfg, served_all, slo)
    report["plan_output"] = choice
    print(
        f"\n{'deployment':<32}{'devices':>8}{'measured rps':>14}{'per device':>12}{'predicted rps':>15}"
        f"{'per device':>12}{'engine-profile rps':>20}{'per device':>12}"
    )
    for spec, devices, meas, pred, pred_engine in rows:
        print(
            f"{spec:<32}{devices:>8}{meas:>14.3f}{meas / devices:>12.3f}{pred:>15.3f}{pred / devices:>12.3f}"
            f"{pred_engine:>20.3f}{pred_engine / devices:>12.3f}"
        )
    best_meas = max(rows, key=lambda r: r[2] / r[1])[0]
    best_pred = max(rows, key=lambda r: r[3] / r[1])[0]
    print(f"best per device: measured {best_meas}, predicted {best_pred}")
    print(f"\njaxserve plan --profile {served_all} says:\n" + choice)
    report["best_measured"], report["best_predicted"] = best_meas, best_pred
    report["seconds"] = time.perf_counter() - started
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        from jaxserve.tools.bench.plot import plot_attainment

        plot_attainment(
            args.plot,
            curves_meas,
            target=slo.attainment,
            dashed=curves_pred,
            rate_label="rate per device (req/s/device)",
            title=f"{cfg.model}, {cfg.workload}, TTFT<={1e3 * slo.ttft_s:.0f}ms TPOT<={1e3 * slo.tpot_s:.0f}ms, pinned",
        )
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
