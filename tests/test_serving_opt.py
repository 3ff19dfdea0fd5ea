"""The real tiny Flax OPT behind the servers, and `jaxserve serve` itself.

The model is `opt-tiny` (random weights) saved as a jaxserve checkpoint directory with a
tokenizer next to it, so the text path is exercised too. The served tokens and text must
equal offline `LLM.generate` on a colocated deployment: the same model reached through
the disaggregated runtime (prefill tp2, decode tp1), the KV transfer, the gRPC/HTTP
servers and the client.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import pytest
from serving_helpers import running_server, tiny_tokenizer

from jaxserve.client import Client
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import SamplingParams
from jaxserve.llm import LLM
from jaxserve.runtime.controller import Controller
from models.checkpoint import save_checkpoint
from models.sharding import ShardedOPT

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[2, 100, 31, 7], [2, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 400]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """opt-tiny's random weights as a checkpoint directory, with the tests' tiny BPE as its tokenizer."""
    path = tmp_path_factory.mktemp("opt-tiny-ckpt")
    save_checkpoint(path, ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[:1]))
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model=model_dir, deployment="colocated:tp1")
    assert llm.has_tokenizer
    yield llm
    llm.controller.shutdown()


@pytest.fixture(scope="module")
def server(model_dir):
    plan = parse_deployment("disagg:prefill=tp2,decode=tp1")
    controller = Controller.from_plan(model_dir, plan, devices=jax.devices()[2:5])
    with running_server(controller) as s:
        yield s


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}])
def test_grpc_stream_equals_offline_generate(offline, server, sampling):
    params = SamplingParams(max_tokens=12, ignore_eos=True, **sampling)
    reference = [list(out.token_ids) for out in offline.generate(PROMPTS, params)]
    with Client(server.grpc_address, timeout_s=120) as client:
        for prompt, expected in zip(PROMPTS, reference, strict=True):
            chunks = list(client.stream(prompt_ids=prompt, max_tokens=12, ignore_eos=True, **sampling))
            assert [t for c in chunks for t in c.token_ids] == expected
            assert chunks[-1].finish_reason == "length"
            timings = chunks[-1].timings
            assert timings is not None and timings.kv_transfer_bytes > 0
            assert timings.prefill_instance == "prefill-0" and timings.decode_instance == "decode-0"


def test_text_prompts_equal_offline_generate_on_both_protocols(offline, server):
    prompt = "def add(a, b):\n    return"
    (expected,) = offline.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))
    assert expected.text is not None
    with Client(server.grpc_address, timeout_s=120) as client:
        chunks = list(client.stream(prompt, max_tokens=16, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
    assert "".join(c.text for c in chunks) == expected.text
    assert chunks[-1].num_prompt_tokens == len(expected.prompt_token_ids)
    r = httpx.post(
        f"{server.http_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected.text


def test_http_completion_equals_offline_generate(offline, server):
    (expected,) = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=10, ignore_eos=True))
    r = httpx.post(
        f"{server.http_url}/v1/completions",
        json={"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == list(expected.token_ids)
    assert r.json()["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 10,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.slow  # ~35 s: a whole `jaxserve serve` process; the default run stays well under 15 minutes
def test_jaxserve_serve_subprocess_ready_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the command must set the device count itself
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # its compilation cache and kernel build, not the home folder's
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve", "serve", "--grpc-port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the ready line (or EOF if the server died)
        m = re.fullmatch(r"ready grpc=(127\.0\.0\.1:\d+) http=(127\.0\.0\.1:\d+)\n", line)
        assert m, f"unexpected first line {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        grpc_address, http_address = m.groups()
        with Client(grpc_address, timeout_s=120) as client:
            result = client.generate(prompt_ids=[2, 100, 31], max_tokens=5, ignore_eos=True)
            assert len(result.token_ids) == 5 and result.finish_reason == "length"
            assert client.deployment().describe() == "disagg:prefill=tp1,decode=tp1"
        r = httpx.post(f"http://{http_address}/v1/completions", json={"prompt": [2, 100], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with Client(grpc_address, timeout_s=120) as client:
            if client.model_info().has_tokenizer:  # the shipped trained model: text in, text out, same on both
                prompt = "def add(a, b):\n"
                g = client.generate(prompt, max_tokens=12, temperature=0.0)
                body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
                h = httpx.post(f"http://{http_address}/v1/completions", json=body, timeout=60).json()
                assert g.text and h["choices"][0]["text"] == g.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a hang guard; how fast it stops is measured by hand (docs/serving.md)
        stderr = proc.stderr.read() if proc.stderr else ""
        assert re.search(
            r"instance prefill-0: role=prefill tp=1 x pp=1 precision=checkpoint devices=\[\S+\]", stderr
        ), stderr
        assert re.search(r"instance decode-0: role=decode tp=1 x pp=1 precision=checkpoint devices=\[\S+\]", stderr), (
            stderr
        )
        # No --num-kv-blocks: the pool is sized from the memory the weights leave, and the size is logged.
        assert re.search(
            r"KV pool: \d+ blocks x 16 tokens per decode / colocated instance \(--kv-memory-fraction 0.9\)", stderr
        ), stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_http_n_samples_use_seed_plus_index(offline, server):
    """n seeded samples of one prompt: sample j is exactly the offline result with seed + j, and they differ."""
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=7 + j, ignore_eos=True) for j in range(3)]
    expected = [list(offline.generate([PROMPTS[1]], p)[0].token_ids) for p in params]
    r = httpx.post(
        f"http://{server.http_address}/v1/completions",
        json={"prompt": PROMPTS[1], "n": 3, "seed": 7, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert got == expected
    assert len({tuple(g) for g in got}) > 1
