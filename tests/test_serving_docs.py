"""The examples in docs/serving.md run as written against a live server (fake engine + a tiny BPE).

`python` blocks are executed; `bash` blocks (curl) are run by bash. The documented
addresses (127.0.0.1:50051, http://127.0.0.1:8000) are pointed at this test's server.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from serving_helpers import fake_controller, running_server, tiny_tokenizer

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
BLOCKS = re.findall(r"```(python|bash)\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


@pytest.fixture(scope="module")
def server():
    with running_server(fake_controller(tokenizer=tiny_tokenizer())) as s:
        yield s


def _localize(code: str, server) -> str:
    return code.replace("http://127.0.0.1:8000", server.http_url).replace("127.0.0.1:50051", server.grpc_address)


def test_the_page_has_examples():
    kinds = [k for k, _ in BLOCKS]
    assert kinds.count("python") >= 4 and kinds.count("bash") >= 2


@pytest.mark.parametrize("index", [i for i, (k, _) in enumerate(BLOCKS) if k == "python"])
def test_python_example_runs(server, index):
    code = _localize(BLOCKS[index][1], server)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{DOC.name}[block {index}]", "exec"), {"__name__": "__docs__"})
    assert out.getvalue().strip(), "the example printed nothing"


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
@pytest.mark.parametrize("index", [i for i, (k, _) in enumerate(BLOCKS) if k == "bash"])
def test_curl_example_runs(server, index):
    done = subprocess.run(
        ["bash", "-c", _localize(BLOCKS[index][1], server)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    if done.stdout.startswith("data: "):
        assert done.stdout.rstrip().endswith("data: [DONE]")
    else:
        body = json.loads(done.stdout)
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1


def test_demo_script_runs_end_to_end(tmp_path):
    """scripts/demo.py (the README's first command) starts a server, streams, prints TTFT/TPOT, stops it."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "demo.py"
    done = subprocess.run(
        [sys.executable, str(script), "--tiny", "--max-tokens", "6", "--", "--engine", "fake", "--no-warmup"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},  # the compilation cache goes here, not to ~/.cache
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\[server\] ready grpc=\S+ http=\S+$", done.stdout, flags=re.MULTILINE)
    assert len(re.findall(r"-> finish=length TTFT=[\d.]+ ms TPOT=[\d.]+ ms", done.stdout)) == 3
    assert "server stopped (exit code 0)" in done.stdout
