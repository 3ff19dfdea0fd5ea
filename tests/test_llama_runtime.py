"""Llama-style models (GQA, MQA, MHA) through every runtime path: greedy tokens equal Hugging Face `generate`.

Random tiny checkpoints (`tests/llama_hf.py`): Llama with 2 K/V heads for 4 query heads and llama3 RoPE
scaling, Qwen2 with one K/V head (MQA), biases and a tied head, Mistral (MHA). Each path the OPT parity
tests cover runs here too: colocated (prefill priority and chunked), disaggregated with a tp change between
the phases — K/V heads split over tp on one side and replicated across it on the other —, pp2, prefix
caching, multi-step decoding with Llama 3's several EOS ids, logprobs, `n` > 1 over HTTP, and a live switch.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llama_hf import make_hf_llama, save_hf_llama  # noqa: E402
from serving_helpers import running_server  # noqa: E402

from jaxserve.core.limits import ServingLimits  # noqa: E402
from jaxserve.core.plan import parse_deployment  # noqa: E402
from jaxserve.core.request import GenerateRequest, SamplingParams  # noqa: E402
from jaxserve.core.scheduling import PrefixPolicy  # noqa: E402
from jaxserve.runtime.controller import Controller, ControllerConfig  # noqa: E402
from jaxserve.testing.hf import hf_logprobs  # noqa: E402

PROMPTS = [(1, 100, 31, 7, 8), (1, 5, 6), (1, 30, 31, 32, 17, 9, 44, 11, 5, 6, 7, 150, 13)]
MAX_TOKENS = 8
LIMITS = ServingLimits(block_size=4, num_kv_blocks=64, max_batch_tokens=64)


class Checkpoint:
    """A saved random model of one kind and its Hugging Face twin (the reference)."""

    def __init__(self, kind: str, root: Path) -> None:
        self.kind = kind
        self.model = make_hf_llama(kind, seed=3)
        self.path = save_hf_llama(self.model, root / kind)

    def generate(self, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS, eos: Any = None) -> list[int]:
        kwargs: dict[str, Any] = {"eos_token_id": eos, "pad_token_id": 0}
        if eos is None:
            kwargs["min_new_tokens"] = max_tokens
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, **kwargs)
        return out[0, len(prompt) :].tolist()


_CACHE: dict[str, Checkpoint] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("llama-runtime")

    def get(kind: str) -> Checkpoint:
        if kind not in _CACHE:
            _CACHE[kind] = Checkpoint(kind, root)
        return _CACHE[kind]

    yield get
    _CACHE.clear()


def serve(ck: Checkpoint, spec: str, requests: list[GenerateRequest], **config: Any) -> list[list[int]]:
    c = Controller.from_plan(str(ck.path), parse_deployment(spec), config=ControllerConfig(limits=LIMITS, **config))
    c.start()
    try:
        streams = [c.submit(r) for r in requests]
        return [s.collect(timeout_s=300)[0] for s in streams]
    finally:
        c.shutdown(drain_timeout_s=0)


def greedy(tag: str, max_tokens: int = MAX_TOKENS) -> list[GenerateRequest]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [GenerateRequest(f"{tag}{i}", p, sampling) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize(
    "kind,spec",
    [
        # the default run keeps the GQA split and the MQA replicated cases; .ci/run's slow part the rest
        pytest.param("llama-gqa-llama3", "colocated:tp1", marks=pytest.mark.slow),
        ("llama-gqa-llama3", "disagg:prefill=tp1,decode=tp2"),  # 2 K/V heads: split 1 + 1 on decode
        ("qwen2-mqa-tied", "disagg:prefill=tp2,decode=tp1"),  # 1 K/V head: replicated on the prefill side
        pytest.param("mistral-mha", "colocated:tp1,chunk=8", marks=pytest.mark.slow),
        pytest.param("llama-gqa-llama3", "disagg:prefill=tp1pp2,decode=tp4", marks=pytest.mark.slow),  # replicated
        pytest.param("qwen2-mqa-tied", "colocated:tp2,chunk=8", marks=pytest.mark.slow),
        pytest.param("llama-headdim-linear-bias", "disagg:prefill=tp2,decode=tp1", marks=pytest.mark.slow),
    ],
)
def test_greedy_tokens_equal_transformers(kind: str, spec: str, checkpoints: Any) -> None:
    ck = checkpoints(kind)
    got = serve(ck, spec, greedy("r"))
    assert got == [ck.generate(p) for p in PROMPTS]


def test_every_eos_id_stops_multi_step_decoding(checkpoints: Any, tmp_path: Path) -> None:
    """Llama 3 lists several EOS ids: any of them ends a sequence, in the on-device multi-step loop too."""
    ck = checkpoints("llama-gqa-llama3")
    free_run = [ck.generate(p, 16) for p in PROMPTS]
    # Two EOS ids the greedy outputs do reach (the second one earlier than the first in some prompt).
    seen = [t for out in free_run for t in out[2:]]
    eos = (seen[-1], seen[0])
    config = json.loads((ck.path / "config.json").read_text())
    config["eos_token_id"] = list(eos)
    path = tmp_path / "multi-eos"
    path.mkdir()
    for f in ck.path.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    (path / "config.json").write_text(json.dumps(config))
    expected = [ck.generate(p, 16, eos=list(eos)) for p in PROMPTS]
    assert any(len(e) < 16 for e in expected)
    sampling = SamplingParams(max_tokens=16)
    requests = [GenerateRequest(f"e{i}", p, sampling) for i, p in enumerate(PROMPTS)]
    c = Controller.from_plan(
        str(path), parse_deployment("disagg:prefill=tp1,decode=tp2"),
        config=ControllerConfig(limits=LIMITS, decode_steps_per_call=4),
    )  # fmt: skip
    c.start()
    try:
        got = []
        for s in [c.submit(r) for r in requests]:
            ids, last = s.collect(timeout_s=300)
            got.append(ids)
            assert last.finish_reason == ("stop" if ids[-1] in eos else "length")
    finally:
        c.shutdown(drain_timeout_s=0)
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["colocated:tp1", "disagg:prefill=tp1,decode=tp2"])
def test_prefix_caching_keeps_the_tokens(spec: str, checkpoints: Any) -> None:
    ck = checkpoints("llama-gqa-llama3")
    turn1 = PROMPTS[2]
    out1 = ck.generate(turn1)
    turn2 = turn1 + tuple(out1) + (40, 41, 42)
    config = ControllerConfig(limits=LIMITS, prefix_policy=PrefixPolicy(enabled=True))
    c = Controller.from_plan(str(ck.path), parse_deployment(spec), config=config)
    c.start()
    try:
        sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        ids1, _ = c.submit(GenerateRequest("t1", turn1, sampling)).collect(timeout_s=300)
        ids2, last2 = c.submit(GenerateRequest("t2", turn2, sampling)).collect(timeout_s=300)
    finally:
        c.shutdown(drain_timeout_s=0)
    assert (ids1, ids2) == (out1, ck.generate(turn2))
    assert last2.timings is not None and last2.timings.cached_prompt_tokens >= 12


@pytest.mark.slow
def test_logprobs_equal_transformers_log_softmax(checkpoints: Any) -> None:
    ck = checkpoints("qwen2-mqa-tied")
    top = 3
    sampling = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=top)
    requests = [GenerateRequest(f"l{i}", p, sampling) for i, p in enumerate(PROMPTS[:2])]
    c = Controller.from_plan(
        str(ck.path), parse_deployment("disagg:prefill=tp2,decode=tp1"),
        config=ControllerConfig(limits=LIMITS, decode_steps_per_call=4),
    )  # fmt: skip
    c.start()
    try:
        for r in requests:
            chunks = list(c.submit(r))
            ids = [t for ch in chunks for t in ch.token_ids]
            lps = [lp for ch in chunks for lp in (ch.logprobs or ())]
            want = hf_logprobs(ck.model, r.prompt_token_ids, ids)
            assert len(lps) == len(ids)
            for row, tok, lp in zip(want, ids, lps, strict=True):
                assert lp.logprob == pytest.approx(row[tok], abs=2e-4)
                assert [t for t, _ in lp.top] == np.argsort(-row, kind="stable")[:top].tolist()
    finally:
        c.shutdown(drain_timeout_s=0)


@pytest.mark.slow
def test_openai_completions_with_n_choices(checkpoints: Any) -> None:
    """`n` = 2 greedy choices over real HTTP: both are transformers' tokens."""
    ck = checkpoints("llama-gqa-llama3")
    c = Controller.from_plan(
        str(ck.path), parse_deployment("disagg:prefill=tp1,decode=tp2"), config=ControllerConfig(limits=LIMITS)
    )
    with c, running_server(c) as server:
        with urllib.request.urlopen(f"{server.http_url}/v1/models", timeout=30) as resp:
            name = json.loads(resp.read())["data"][0]["id"]
        body = {"model": name, "prompt": list(PROMPTS[0]), "max_tokens": MAX_TOKENS, "n": 2, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        req = urllib.request.Request(
            f"{server.http_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            choices = json.loads(resp.read())["choices"]
    assert [ch["token_ids"] for ch in choices] == [ck.generate(PROMPTS[0])] * 2


@pytest.mark.slow
def test_live_switch_keeps_every_stream_token_identical(checkpoints: Any) -> None:
    """1P1D -> a decode instance at tp2 (K/V heads split), while requests stream: every one equals transformers."""
    from jaxserve.runtime.engines.model import model_engine_factory
    from jaxserve.runtime.switch import PlanSwitcher

    ck = checkpoints("llama-gqa-llama3")
    c = Controller.from_plan(
        str(ck.path), parse_deployment("disagg:prefill=tp1,decode=tp1"), config=ControllerConfig(limits=LIMITS)
    )
    c.start()
    switcher = PlanSwitcher(c, model_engine_factory(str(ck.path)), drain_timeout_s=60)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    results: dict[str, list[int]] = {}

    def client(k: int) -> None:
        for j, p in enumerate(PROMPTS):
            rid = f"s{k}-{j}"
            results[rid] = c.submit(GenerateRequest(rid, p, sampling)).collect(timeout_s=300)[0]

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        report = switcher.switch(parse_deployment("disagg:prefill=tp1,decode=tp2"))
        for t in threads:
            t.join(timeout=600)
        after = serve_on(c, greedy("after", 24))
    finally:
        c.shutdown(drain_timeout_s=0)
    assert report.added and c.plan.describe() == "disagg:prefill=tp1,decode=tp2"
    want = [ck.generate(p, 24) for p in PROMPTS]
    assert len(results) == 3 * len(PROMPTS)
    for rid, ids in results.items():
        assert ids == want[int(rid.split("-")[1])], rid
    assert after == want


def serve_on(c: Controller, requests: list[GenerateRequest]) -> list[list[int]]:
    return [s.collect(timeout_s=300)[0] for s in [c.submit(r) for r in requests]]
