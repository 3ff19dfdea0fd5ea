"""Step records: what a serving process's steps cost, served at /debug/steps and fitted by
`jaxserve profile --from-server`.

A real server on loopback runs the fake engine slowed by known delays (30 ms per prefill, 10 ms per
decode step); requests go through the real gRPC client. The records must carry the true shapes
(prompt lengths, decode rows, context) and at least the engine's delay; the profile fitted to them
must predict those step times back.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from serving_helpers import fake_controller, running_server

from jaxserve.cli import main
from jaxserve.client import Client
from jaxserve.core.request import SamplingParams
from jaxserve.runtime.colocated_instance import _step_record
from jaxserve.runtime.engines.contract import StepRow
from models.config import get_config
from placement.hardware import get_device
from placement.latency import LatencyProvider, load_profile
from placement.step_time import decode_step_s, prefill_step_s

PREFILL_S, DECODE_S = 0.030, 0.010
PROMPT_LEN, MAX_TOKENS = 20, 6


def _drive(address: str, api_key: str) -> None:
    """Waves of 1, 2 and 4 concurrent requests, so decode steps run at several batch sizes. Each prompt has its
    own first token: a prefix-cache hit (caching is on by default) would make a "mixed" step, not a prefill."""
    prompts = iter([[10 + n, *range(40, 39 + PROMPT_LEN)] for n in range(7)])
    with Client(address, api_key=api_key) as client, ThreadPoolExecutor(4) as pool:
        for wave in (1, 2, 4):
            calls = [
                pool.submit(client.generate, prompt_ids=next(prompts), max_tokens=MAX_TOKENS, ignore_eos=True)
                for _ in range(wave)
            ]
            assert all(len(c.result(timeout=60).token_ids) == MAX_TOKENS for c in calls)


# The gated case checks what the records must be on any machine (shapes, counts, no step shorter than the
# engine's delay, a profile the planner loads); how much longer a step may run, how batches formed and how
# well the fit predicts the medians are wall-clock figures: the `timing` case, by hand (docs/timing-checks.md).
@pytest.mark.parametrize(
    "timed", [pytest.param(False, id="records"), pytest.param(True, id="timed", marks=pytest.mark.timing)]
)
def test_server_records_its_steps_and_the_profile_fits_them(tmp_path: Path, timed: bool) -> None:
    controller = fake_controller(prefill_delay_s=PREFILL_S, decode_delay_s=DECODE_S)
    with running_server(controller, api_key="k", admin_key="admin-k") as server:
        http = f"http://{server.http_address}"
        assert httpx.get(f"{http}/debug/steps").status_code == 401  # an operator route: the admin key guards it
        assert httpx.get(f"{http}/debug/steps", headers={"Authorization": "Bearer k"}).status_code == 403
        auth = {"Authorization": "Bearer admin-k"}
        start = httpx.get(f"{http}/debug/steps", params={"since": 1e300}, headers=auth).json()
        assert all(inst["steps"] == [] for inst in start["instances"])
        _drive(server.grpc_address, "k")
        got = httpx.get(f"{http}/debug/steps", params={"since": start["now"]}, headers=auth).json()
        roles = {inst["role"]: inst["steps"] for inst in got["instances"]}
        assert set(roles) == {"prefill", "decode"}
        prefills, decodes = roles["prefill"], roles["decode"]
        # 7 requests; a prefill batch holds whole prompts, each of PROMPT_LEN tokens
        assert sum(len(s["prompt_lengths"]) for s in prefills) == 7
        assert all(s["kind"] == "prefill" and set(s["prompt_lengths"]) == {PROMPT_LEN} for s in prefills)
        assert all(s["seconds"] >= PREFILL_S for s in prefills)
        if timed:
            assert all(s["seconds"] < PREFILL_S + 0.25 for s in prefills)
        # every request decodes MAX_TOKENS - 1 tokens (its first came from prefill), one per step it is in
        assert sum(s["batch"] for s in decodes) == 7 * (MAX_TOKENS - 1)
        if timed:  # the waves' requests met in one batch: their prefills ended close enough together
            assert {s["batch"] for s in decodes} >= {1, 2}
            assert all(s["seconds"] < DECODE_S + 0.25 for s in decodes)
        for s in decodes:
            assert s["kind"] == "decode" and s["seconds"] >= DECODE_S
            # each row's new token sits at a position in [PROMPT_LEN, PROMPT_LEN + MAX_TOKENS - 2]
            assert s["batch"] * PROMPT_LEN <= s["ctx_sum"] <= s["batch"] * (PROMPT_LEN + MAX_TOKENS - 2)
        # the same records, fitted into a profile the planner loads
        out = tmp_path / "served.json"
        argv = ["profile", "--model", "opt-tiny", "--deployment", "disagg:prefill=tp1,decode=tp1"]
        argv += ["--from-server", server.http_address, "--since", str(start["now"]), "--admin-key", "admin-k"]
        argv += ["-o", str(out)]
        argv += ["--prefill-tokens", "512", "--no-padding"]
        assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert [e["engine"] for e in doc["entries"]] == ["disagg"] and doc["entries"][0]["L_m"] == 512
    if not timed:
        return
    # predicted as the simulator charges a step: the kernel model plus the fitted step overhead
    provider = LatencyProvider(get_config("opt-tiny"), get_device("cpu"), load_profile(str(out)))
    model, overhead = provider.instance("disagg", 1, 1), provider.step_overhead("disagg", 1)
    median_prefill = float(np.median([s["seconds"] for s in prefills if len(s["prompt_lengths"]) == 1]))
    assert prefill_step_s(model, overhead, [PROMPT_LEN]) == pytest.approx(median_prefill, rel=0.25)
    one_row = [s["seconds"] for s in decodes if s["batch"] == 1]
    assert decode_step_s(model, overhead, 1, PROMPT_LEN + 2) == pytest.approx(float(np.median(one_row)), rel=0.25)


def test_from_server_needs_the_deployment_and_a_reachable_server(capsys, tmp_path: Path) -> None:
    out = str(tmp_path / "p.json")
    assert main(["profile", "--model", "opt-tiny", "--from-server", "127.0.0.1:9", "-o", out]) == 2
    assert "--deployment" in capsys.readouterr().err
    argv = ["profile", "--model", "opt-tiny", "--deployment", "colocated:tp1", "--from-server", "127.0.0.1:9"]
    assert main([*argv, "-o", out]) == 2
    assert "could not read" in capsys.readouterr().err


def test_colocated_steps_are_classified_by_their_rows() -> None:
    greedy = SamplingParams(max_tokens=4)

    def row(tokens: int, position: int, prompt: bool) -> StepRow:
        return StepRow("r", tuple(range(tokens)), position, (0,), greedy, 0, 0, is_prompt=prompt)

    pre = _step_record((row(12, 0, True), row(7, 0, True)), [True, True], 1.0, 1.5)
    assert (pre.kind, pre.prompt_lengths, pre.seconds) == ("prefill", (12, 7), 0.5)
    dec = _step_record((row(1, 40, False), row(1, 9, False)), [False, False], 2.0, 2.25)
    assert (dec.kind, dec.batch, dec.ctx_sum, dec.at) == ("decode", 2, 49, 2.25)
    chunk = _step_record((row(8, 0, True),), [False], 0.0, 0.1)  # the first chunk of a longer prompt
    assert chunk.kind == "mixed"
