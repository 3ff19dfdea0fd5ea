"""Prefix caching on the Ray backend, on a real local Ray cluster (127.0.0.1, no auth, a temp dir).

The `PrefixCache` of every instance lives in the controller's process (the instance loops run there);
the paged pools live in the actors. So a prefill actor runs the uncached suffixes on its own pool and
holds each prompt's whole KV under a lease, and a decode actor pulls only the positions its instance's
cache lacks (the prefill actor slices them). Checked here:

* by hand, with the fake engine (block size 8): a conversation's second turn hits both caches, the
  pull moves only the missing positions, the HTTP `usage` reports the hit, and the tokens are the
  fake's arithmetic (a wrong block changes them);
* cancels while pulls run: nothing stays pinned in any cache, no KV stays leased in a prefill actor
  or staged in a decode actor;
* a decode actor killed mid-conversation: the restarted pool is rebuilt, its unpinned cached blocks
  are forgotten, and the streams go on token-identical;
* the tiny OPT: greedy tokens of multi-turn conversations with caching on (Ray) equal those without
  (embedded), tp2 prefill -> tp1 decode.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when Ray is imported: bind loopback only

import httpx
import pytest
from ray_cluster import local_cluster
from serving_helpers import running_server

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import NO_PREFIX_CACHING, PrefixPolicy
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.fake import reference_tokens
from models.config import get_config

ray = pytest.importorskip("ray")

from jaxserve.runtime.kv_connectors.ray_pull import TransferConfig  # noqa: E402
from jaxserve.runtime.ray_backend.deployment import RayConfig, RayController  # noqa: E402
from jaxserve.runtime.ray_backend.placement_groups import ResourceConfig  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CFG = get_config("opt-tiny")  # vocab 512, 256 positions, 4 heads, 2 layers
V = CFG.vocab_size
BS = 8
TOKEN_BYTES = 2 * CFG.num_layers * CFG.num_heads * 4  # the fake's K and V: [L, T, H, 1] float32
LEASE_S = 2.0


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(4, prefix="rp") as c:
        yield c


def _ray_config(engine: str = "model") -> RayConfig:
    return RayConfig(
        transfer=TransferConfig(lease_s=LEASE_S, pull_timeout_s=20.0),
        resources=ResourceConfig(num_cpus_per_actor=0.5),
        engine=engine,  # type: ignore[arg-type]
        fake_config=CFG if engine == "fake" else None,
    )


@pytest.fixture(scope="module")
def fake(cluster):
    config = ControllerConfig(
        prefix_policy=PrefixPolicy(enabled=True), limits=ServingLimits(block_size=BS, num_kv_blocks=64)
    )
    controller = RayController.launch("fake", parse_deployment("disagg:prefill=tp1,decode=tp1"), config,
                                      _ray_config("fake"))  # fmt: skip
    controller.start()
    yield controller
    controller.shutdown(drain_timeout_s=5)


def _req(rid: str, prompt: Sequence[int], max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _assert_nothing_held(c: RayController) -> None:
    """The leak check of the embedded tests (every block free or evictable, nothing pinned), plus the actors:
    no KV leased in a prefill actor, none staged in a decode actor."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pinned = any(inst.cache.num_pinned for inst in c.instances)
        leased = sum(c.buffer_stats(p.name).num_held for p in c.prefill_instances)
        staged = sum(c.decode_stats(d.name).num_staged for d in c.decode_instances)
        if not (pinned or leased or staged):
            break
        time.sleep(0.1)
    for inst in c.instances:
        assert inst.cache.num_pinned == 0, inst.name
        assert inst.cache.num_available == inst.cache.num_blocks, inst.name
    assert c.stats().num_live_requests == 0
    assert [c.buffer_stats(p.name).num_held for p in c.prefill_instances] == [0]
    assert [c.decode_stats(d.name).num_staged for d in c.decode_instances] == [0]


def test_second_turn_hits_both_caches_and_pulls_only_what_decode_lacks(fake) -> None:
    p1 = tuple(range(1, 21))  # 20 tokens: 2 full blocks + 4
    ids1, last1 = fake.submit(_req("t1", p1)).collect(timeout_s=60)
    p2 = p1 + tuple(ids1) + tuple(range(100, 110))  # 36 tokens: 4 full blocks + 4
    ids2, last2 = fake.submit(_req("t2", p2)).collect(timeout_s=60)
    assert ids1 == reference_tokens(p1, 6, V) and ids2 == reference_tokens(p2, 6, V)
    t1, t2 = last1.timings, last2.timings
    assert t1 is not None and t2 is not None
    assert (t1.cached_prompt_tokens, t1.kv_transfer_tokens, t1.kv_transfer_bytes) == (0, 20, 32 * TOKEN_BYTES)
    # The prefill actor's pool holds turn 1's 2 full prompt blocks; the decode cache holds turn 1's prompt
    # + answer but its last token (25 tokens: 3 full blocks), so the pull moves 36 - 24 = 12 positions
    # (sliced by the prefill actor, padded to 16).
    assert t2.cached_prompt_tokens == 16
    assert (t2.kv_transfer_tokens, t2.kv_transfer_bytes) == (12, 16 * TOKEN_BYTES)
    assert fake.prefill_instances[0].num_computed_tokens == 20 + 20
    hits = {s.name: s.num_prefix_hit_tokens for s in fake.stats().instances}
    assert hits == {"prefill-0": 16, "decode-0": 24}
    _assert_nothing_held(fake)


def test_cancels_while_pulls_run_leave_nothing_pinned_leased_or_staged(fake) -> None:
    system = tuple(range(300, 324))  # 3 shared blocks
    history = {k: system + tuple(range(10 * k, 10 * k + 5)) for k in range(6)}
    for rnd in range(3):
        streams = {k: fake.submit(_req(f"c{rnd}-{k}", history[k], max_tokens=10)) for k in history}
        for k in (1, 4) if rnd != 1 else (0, 2, 5):
            streams[k].cancel()
        for k, stream in streams.items():
            ids, last = stream.collect(timeout_s=60)
            if last.finish_reason == "abort":
                continue
            assert ids == reference_tokens(history[k], 10, V), (rnd, k)
            history[k] = history[k] + tuple(ids) + (7, 7, 7)
    assert sum(s.num_prefix_hit_tokens for s in fake.stats().instances) > 0
    _assert_nothing_held(fake)


def test_decode_actor_killed_mid_conversation_is_rebuilt_and_forgets_its_cache(fake) -> None:
    prompts = [tuple(range(400 + 3 * k, 400 + 3 * k + 20)) for k in range(3)]
    for k, p in enumerate(prompts):  # turn 1: the decode cache names these blocks
        assert fake.submit(_req(f"k1-{k}", p)).collect(timeout_s=60)[0] == reference_tokens(p, 6, V)
    decode = fake.decode_instances[0]
    assert decode.cache.num_cached > 0
    streams = [fake.submit(_req(f"k2-{k}", p, max_tokens=40)) for k, p in enumerate(prompts)]
    first = [s.next_chunk(timeout_s=60) for s in streams]  # the prefill token of each
    assert all(c is not None for c in first)
    ray.kill(fake.actor("decode-0"), no_restart=False)
    for p, s, c in zip(prompts, streams, first, strict=True):
        ids, _ = s.collect(timeout_s=120)
        assert c is not None and list(c.token_ids) + ids == reference_tokens(p, 40, V)
    assert fake.stats().faults.num_instance_restarts >= 1
    for k, p in enumerate(prompts):  # after the restart: every hit is a block the new pool really holds
        assert fake.submit(_req(f"k3-{k}", p)).collect(timeout_s=60)[0] == reference_tokens(p, 6, V)
    _assert_nothing_held(fake)


def test_http_usage_reports_the_cached_tokens_of_a_second_turn(fake) -> None:
    """Last of the fake-engine tests: the server stops (and shuts down) the deployment on exit."""
    prompt = list(range(200, 236))  # 36 tokens: 4 full blocks + 4
    body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    with running_server(fake) as server, httpx.Client(base_url=server.http_url, timeout=60) as http:
        first = http.post("/v1/completions", json=body).json()
        second = http.post("/v1/completions", json=body).json()
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == reference_tokens(prompt, 4, V)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # 4 blocks on the prefill actor


# ---- the tiny OPT: caching on (Ray) == caching off (embedded), greedy -----------------------------

OPT_PLAN = "disagg:prefill=tp2,decode=tp1"
OPT_CONFIG = ControllerConfig(  # caching off (the "without" arm); the cached arm turns it on below
    limits=ServingLimits(num_kv_blocks=96, block_size=16, max_decode_batch=8, max_batch_tokens=128),
    prefix_policy=NO_PREFIX_CACHING,
)


def _conversations(c: Controller) -> list[list[tuple[list[int], int]]]:
    """3 rounds over 4 conversations sharing a 40-token system prompt: each turn's tokens and cached count."""
    system = tuple(range(40, 80))
    history = {k: system + tuple(range(100 + 9 * k, 100 + 9 * k + 7)) for k in range(4)}
    out: list[list[tuple[list[int], int]]] = [[] for _ in history]
    for rnd in range(3):
        sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        streams = {k: c.submit(GenerateRequest(f"o{rnd}-{k}", history[k], sampling)) for k in history}
        for k, stream in streams.items():
            ids, last = stream.collect(timeout_s=120)
            assert last.timings is not None
            out[k].append((ids, last.timings.cached_prompt_tokens))
            history[k] = history[k] + tuple(ids) + (300 + rnd, 301 + rnd)
    return out


def test_opt_greedy_tokens_with_caching_on_ray_equal_embedded_without(cluster) -> None:
    plan = parse_deployment(OPT_PLAN)
    with Controller.from_plan("opt-tiny", plan, config=OPT_CONFIG) as embedded:
        without = _conversations(embedded)
    cached_config = dataclasses.replace(OPT_CONFIG, prefix_policy=PrefixPolicy(enabled=True))
    c = RayController.launch("opt-tiny", plan, cached_config, _ray_config())
    c.start()
    try:
        with_cache = _conversations(c)
        assert [[ids for ids, _ in conv] for conv in with_cache] == [[ids for ids, _ in conv] for conv in without]
        assert all(n == 0 for conv in without for _, n in conv)
        assert all(n > 0 for conv in with_cache for _, n in conv[1:])  # every later turn hits
        _assert_nothing_held(c)
    finally:
        c.shutdown(drain_timeout_s=5)
