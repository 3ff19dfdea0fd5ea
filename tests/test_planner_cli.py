"""`jaxserve plan` and `jaxserve simulate` end to end through the CLI dispatcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxserve.cli import main
from jaxserve.core.plan import DeploymentPlan, parse_deployment

COMMON = ["--model", "opt-13b", "--device", "a100-80gb", "--profile", "a100-80gb-distserve", "--num-requests", "150"]


def test_plan_json_is_a_deployment_plan(capsys, tmp_path) -> None:
    out_file = tmp_path / "plan.json"
    argv = ["plan", *COMMON, "--nodes", "1", "--devices-per-node", "4", "--workload", "fixed:512:64"]
    argv += [
        "--ttft",
        "0.4",
        "--tpot",
        "0.04",
        "--slo-mode",
        "p90",
        "--workers",
        "1",
        "--no-progress",
        "--json",
        "-o",
        str(out_file),
    ]
    assert main(argv) == 0
    plan = DeploymentPlan.from_json(capsys.readouterr().out)
    assert plan.model == "opt-13b" and plan.kind == "disagg"
    assert plan.num_devices <= 4
    assert all(i.devices is not None and i.nodes == (0,) * i.pp for i in plan.instances)
    assert plan.expected["goodput_rps_per_device"] == pytest.approx(plan.expected["goodput_rps"] / plan.num_devices)
    assert parse_deployment(str(out_file)) == plan  # a plan file is a deployment spec too


def test_plan_table_and_low_affinity(capsys) -> None:
    argv = ["plan", *COMMON, "--nodes", "1", "--devices-per-node", "2", "--workload", "fixed:512:64"]
    argv += ["--ttft", "0.4", "--tpot", "0.04", "--affinity", "low", "--workers", "1", "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "disagg:prefill=tp1,decode=tp1" in text and "chosen:" in text and "why:" in text


def test_simulate_goodput_json_keys(capsys) -> None:
    argv = ["simulate", *COMMON, "--workload", "fixed:512:64", "--deployment", "disagg:prefill=2xtp1,decode=tp1"]
    argv += ["--goodput", "--ttft", "0.4", "--tpot", "0.04", "--slo-mode", "p90", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["goodput_rps"] > 0
    assert out["goodput_rps_per_device"] == pytest.approx(out["goodput_rps"] / 3)


def test_simulate_rate_reports_phases(capsys, tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    argv = [
        "simulate",
        *COMMON,
        "--workload",
        "sharegpt",
        "--deployment",
        "disagg:prefill=tp2,decode=tp1",
        "--devices-per-node",
        "4",
    ]
    argv += ["--rate", "2", "--ttft", "0.25", "--tpot", "0.1", "--json", "--trace-out", str(trace)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0.0 <= out["attainment"] <= 1.0 and out["num_finished"] == 150
    for phase in ("prefill_queue", "prefill", "transfer", "decode_queue", "decode"):
        assert out[f"{phase}_mean_s"] >= 0.0
    assert len(trace.read_text().splitlines()) == 150


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--model", "opt-999b", "--deployment", "colocated:tp1", "--rate", "1"],
        ["simulate", "--model", "opt-13b", "--deployment", "colocated:tpx", "--rate", "1"],
        ["simulate", "--model", "opt-13b", "--deployment", "colocated:tp1", "--rate", "-1"],
        ["simulate", "--model", "opt-13b", "--deployment", "colocated:tp1", "--goodput"],
        [
            "simulate",
            "--model",
            "opt-13b",
            "--deployment",
            "colocated:tp8",
            "--rate",
            "1",
            "--profile",
            "a100-80gb-distserve",
        ],
        ["simulate", "--model", "opt-13b", "--deployment", "colocated:tp1", "--rate", "1", "--workload", "nosuch"],
        ["plan", "--model", "opt-13b", "--ttft", "0.25"],
        ["plan", "--model", "opt-13b", "--ttft", "0.25", "--tpot", "0.1", "--profile", "nosuch"],
        ["plan", "--model", "opt-13b", "--ttft", "0.25", "--tpot", "0.1", "--nodes", "0"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err


def test_argparse_errors_exit_2_and_planner_does_not_import_jax() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "simulate", "--model", "opt-13b"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    # The planner and its two commands, driven without the full dispatcher, never load JAX or Flax.
    code = (
        "import argparse, sys\n"
        "from jaxserve.commands import plan, simulate\n"
        "p = argparse.ArgumentParser(); simulate.add_arguments(p)\n"
        "a = p.parse_args(['--model','opt-13b','--deployment','colocated:tp1','--rate','1','--num-requests','5'])\n"
        "assert simulate.run(a) == 0\n"
        "p = argparse.ArgumentParser(); plan.add_arguments(p)\n"
        "a = p.parse_args(['--model','opt-13b','--ttft','1','--tpot','1','--num-requests','20','--devices-per-node','2',"
        "'--workload','fixed:64:4','--workers','1','--no-progress','--max-pp','1'])\n"
        "assert plan.run(a) == 0\n"
        "import placement.search, placement.context, placement.paper\n"
        "assert 'jax' not in sys.modules and 'flax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _cpu_profile(tmp_path, dist_slowdown: float) -> str:
    """An opt-mini CPU profile whose dist engines are `dist_slowdown` x the colocated one."""
    base = {"model": "opt-mini", "tp": 1, "C1": 2e-11, "C2": 1e-9, "C3": 2e-3, "C4": 0.0, "C5": 1e-9, "L_m": 256}
    slow = {k: (v * dist_slowdown if k.startswith("C") else v) for k, v in base.items()}
    path = tmp_path / f"cpu-{dist_slowdown}.json"
    entries = [{**base, "engine": "colocated"}, {**slow, "engine": "disagg"}]
    path.write_text(json.dumps({"name": f"cpu-x{dist_slowdown}", "device": "cpu", "entries": entries}))
    return str(path)


@pytest.mark.parametrize(("slowdown", "kind"), [(1.6, "colocated"), (1.0, "disagg")])
def test_plan_chooses_the_kind_with_more_goodput_per_device(capsys, tmp_path, slowdown: float, kind: str) -> None:
    # Devices whose split phases run 1.6x slower (e.g. two "devices" sharing cores) make the colocated
    # plan the better one per device; equal engines leave the disaggregated plan ahead on this workload.
    argv = ["plan", "--model", "opt-mini", "--device", "cpu", "--nodes", "1", "--devices-per-node", "2"]
    argv += ["--profile", _cpu_profile(tmp_path, slowdown), "--workload", "fixed:256:32", "--num-requests", "100"]
    argv += ["--ttft", "0.08", "--tpot", "0.008", "--max-decode-batch", "32", "--workers", "1", "--no-progress"]
    assert main([*argv, "--json"]) == 0
    plan = DeploymentPlan.from_json(capsys.readouterr().out)
    assert plan.kind == kind
    assert plan.num_devices <= 2
    exp = plan.expected
    assert exp["colocated_goodput_rps_per_device"] > 0 and exp["disagg_goodput_rps_per_device"] > 0
    chosen = max(exp["colocated_goodput_rps_per_device"], exp["disagg_goodput_rps_per_device"])
    assert exp["goodput_rps_per_device"] == pytest.approx(chosen, rel=1e-6)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "best colocated:" in text and "best disaggregated:" in text and "why:" in text


def test_plan_kind_disagg_skips_the_colocated_search(capsys) -> None:
    argv = ["plan", *COMMON, "--nodes", "1", "--devices-per-node", "2", "--workload", "fixed:512:64"]
    argv += ["--ttft", "0.4", "--tpot", "0.04", "--kind", "disagg", "--workers", "1", "--no-progress", "--json"]
    assert main(argv) == 0
    plan = DeploymentPlan.from_json(capsys.readouterr().out)
    assert plan.kind == "disagg" and "colocated_goodput_rps_per_device" not in plan.expected


def test_plan_falls_back_to_the_kind_that_meets_the_slos(capsys, tmp_path) -> None:
    # 3x slower split phases cannot meet these SLOs at all: auto still answers, with a colocated plan,
    # and says why; asking for disagg only is an error.
    argv = ["plan", "--model", "opt-mini", "--device", "cpu", "--nodes", "1", "--devices-per-node", "2"]
    argv += ["--profile", _cpu_profile(tmp_path, 3.0), "--workload", "fixed:256:32", "--num-requests", "100"]
    argv += ["--ttft", "0.08", "--tpot", "0.008", "--max-decode-batch", "32", "--workers", "1", "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "chosen: colocated:2xtp1" in text and "no plan of this kind: disaggregated" in text
    assert main([*argv, "--kind", "disagg"]) == 1
    assert "no configuration meets the SLOs" in capsys.readouterr().err
