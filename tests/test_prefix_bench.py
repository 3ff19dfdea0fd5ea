"""`jaxserve bench --conversations` against a real server with prefix caching (fake engine): the
closed loop builds each turn from the answer the server gave, and the hit rate it reports is the
server's usage.cached_tokens, which is computable from the trace by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
from serving_helpers import fake_controller, running_server

from jaxserve.cli import main
from jaxserve.core.limits import ServingLimits
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import ControllerConfig
from placement.conversations import ConversationSpec, generate_conversations

pytestmark = pytest.mark.timeout(180)

ARGS = dict(system_prompts=2, system_tokens=24, user_tokens=6, answer_tokens=4, min_turns=2, max_turns=3)


def test_bench_conversations_reports_the_servers_hits(tmp_path) -> None:
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True), limits=ServingLimits(block_size=8, num_kv_blocks=256)
    )
    out = tmp_path / "run.json"
    with running_server(fake_controller(config=config, first_device=6)) as server:
        argv = ["bench", "--target", server.grpc_address, "--conversations", "5", "--rate", "20"]
        argv += ["--think-time", "0.05", "--seed", "3", "--json", str(out), "--quiet"]
        argv += [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]
        assert main(argv) == 0
    (run,) = json.loads(out.read_text())["targets"][0]["runs"]
    requests = run["requests"]
    assert all(r["ok"] for r in requests) and run["summary"]["completed"] == len(requests)
    # The same trace, rebuilt: each later turn hits exactly the previous turn's prompt's full blocks
    # on the (single) prefill instance, which computed that prompt.
    spec = ConversationSpec(
        num_system_prompts=2, system_prompt_tokens=24, min_turns=2, max_turns=3, user_tokens=6, answer_tokens=4,
        think_time_s=0.05, max_positions=256, vocab_size=512,
    )  # fmt: skip
    trace = generate_conversations(spec, 5, np.random.default_rng(3)).at_rate(20)
    assert [r["input_len"] for r in requests] == trace.workload.input_lens.tolist()
    for i, r in enumerate(requests):
        if trace.turn[i] > 0:
            (prev,) = np.flatnonzero(trace.next_turn == i)
            assert r["cached_tokens"] == len(trace.prompts[prev]) // 8 * 8, i
    cached = sum(r["cached_tokens"] for r in requests)
    assert run["summary"]["hit_rate"] == pytest.approx(cached / sum(r["input_len"] for r in requests))
    assert cached > 0 and run["summary"]["kv_transfer_bytes"] > 0
