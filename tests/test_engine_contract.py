"""The engine contract: each backend's capabilities match the calls it has, and a call it lacks fails loudly."""

from __future__ import annotations

import jax
import pytest

from jaxserve.core.request import SamplingParams
from jaxserve.core.step_cost import PrefillPipe
from jaxserve.runtime.engines.contract import (
    Engine,
    EngineCapabilities,
    PrefillItem,
    StepBatch,
    StepRow,
    UnsupportedEngineCall,
    WarmupSpec,
    start_prefill,
)
from jaxserve.runtime.engines.fake import FakeEngine, reference_tokens
from jaxserve.runtime.engines.model import ModelEngine
from jaxserve.runtime.engines.timed import TimedEngine
from jaxserve.runtime.ray_backend.actors import ActorInfo, ModelSignature
from jaxserve.runtime.ray_backend.remote_engine import RemoteDecodeEngine, RemotePrefillEngine
from jaxserve.runtime.worker import FaultCounters
from models.config import get_config

CFG = get_config("opt-tiny")

OPTIONAL_CALLS = (
    "prefill", "prefill_async", "prefill_rows", "kv_layout", "init_pages", "decode_step", "decode_step_logprobs",
    "decode_steps", "decode_steps_logprobs", "insert", "kv_blocks_for_memory", "warmup",
)  # fmt: skip


def claimed_calls(caps: EngineCapabilities) -> set[str]:
    """The calls an engine with these capabilities must have (the contract's docstring, as data)."""
    calls = set()
    if caps.prefill:
        calls.add("prefill")
    if caps.decode:
        calls |= {"kv_layout", "init_pages", "decode_step"}
    if caps.async_prefill:
        calls.add("prefill_async")
    if caps.paged_prefill:
        calls |= {"prefill_rows", "init_pages"}
    if caps.dense_insert:
        calls.add("insert")
    if caps.multi_step_decode:
        calls.add("decode_steps")
    if caps.logprobs and caps.decode:
        calls.add("decode_step_logprobs")
    if caps.logprobs and caps.multi_step_decode:
        calls.add("decode_steps_logprobs")
    if caps.bucket_warmup:
        calls.add("warmup")
    if caps.memory_sized_pool:
        calls.add("kv_blocks_for_memory")
    return calls


class _FixedCost:
    """A step-cost contract that charges nothing (the capabilities are under test, not the times)."""

    pp = 1

    def prefill_s(self, lengths: object) -> float:
        return 0.0

    def prefill_pipe(self, lengths: object) -> PrefillPipe:
        return PrefillPipe(0.0, 0.0, 0.0)

    def decode_s(self, batch: int, ctx_sum: float) -> float:
        return 0.0

    def mixed_s(self, chunks: object, priors: object, decode_batch: int, decode_ctx_sum: float) -> float:
        return 0.0


def _info(logprobs: bool) -> ActorInfo:
    signature = ModelSignature.of(CFG, "float32", 16)
    return ActorInfo("a", 1, "node", "127.0.0.1", 1, signature, CFG, (CFG.num_layers,), logprobs)


def _capabilities() -> list[tuple[type, EngineCapabilities]]:
    remote = {"name": "a", "actor": None, "model_config": CFG, "restart_timeout_s": 1.0, "counters": FaultCounters()}
    prefill = RemotePrefillEngine(info=_info(True), lease_s=1.0, **remote)  # type: ignore[arg-type]
    decode = RemoteDecodeEngine(info=_info(False), stage_layers=(CFG.num_layers,), **remote)  # type: ignore[arg-type]
    return [
        (ModelEngine, ModelEngine.capabilities),
        (FakeEngine, FakeEngine.capabilities),
        (TimedEngine, TimedEngine.capabilities),
        (RemotePrefillEngine, prefill.capabilities),
        (RemoteDecodeEngine, decode.capabilities),
    ]


@pytest.mark.parametrize(("cls", "caps"), _capabilities(), ids=lambda x: getattr(x, "__name__", ""))
def test_an_engine_has_exactly_the_calls_its_capabilities_claim(cls: type, caps: EngineCapabilities) -> None:
    implemented = {call for call in OPTIONAL_CALLS if getattr(cls, call) is not getattr(Engine, call)}
    extra = implemented - claimed_calls(caps)
    if cls in (RemotePrefillEngine, RemoteDecodeEngine):
        # Whether a proxy's actor computes logprobs is the actor's say (ActorInfo), so the decode proxy has the
        # logprob step either way; the prefill proxy's kv_layout names the stages of its actor's pool.
        extra -= {"decode_step_logprobs", "kv_layout"}
    assert claimed_calls(caps) <= implemented, f"{cls.__name__} claims calls it lacks"
    assert not extra, f"{cls.__name__} has {sorted(extra)} but claims no capability for them"


def test_roles_of_the_ray_proxies_and_logprobs_from_their_actor() -> None:
    (_, _), (_, _), (_, _), (_, prefill), (_, decode) = _capabilities()
    assert (prefill.prefill, prefill.decode, prefill.paged_prefill, prefill.logprobs) == (True, False, True, True)
    assert (decode.prefill, decode.decode, decode.dense_insert, decode.logprobs) == (False, True, False, False)


def test_an_unsupported_call_fails_loudly_and_start_prefill_follows_the_capability() -> None:
    engine = FakeEngine(CFG, jax.devices()[:1])
    item = PrefillItem("r", (5, 6, 7), SamplingParams(), seed=0)
    with pytest.raises(UnsupportedEngineCall, match=r"FakeEngine has no `prefill_async`.*async_prefill"):
        engine.prefill_async([item])
    pages = engine.init_pages(4, 4)
    row = StepRow("r", (9,), 3, (0,), SamplingParams(), seed=0, sample_index=1)
    with pytest.raises(UnsupportedEngineCall, match="decode_steps"):
        engine.decode_steps(StepBatch((row,)), pages, 2)
    with pytest.raises(UnsupportedEngineCall, match="warmup"):
        engine.warmup(WarmupSpec(num_blocks=4, block_size=4))
    with pytest.raises(UnsupportedEngineCall, match="kv_blocks_for_memory"):
        engine.kv_blocks_for_memory(4)
    # no async prefill: the batch runs at once and its handle is already done
    handle = start_prefill(engine, [item])
    handle.wait_first_stage()
    assert handle.result().sequences[0].first_token == reference_tokens((5, 6, 7), 1, CFG.vocab_size)[0]
    # the timed engine has it: the same call dispatches asynchronously
    timed = TimedEngine(CFG, jax.devices()[:1], _FixedCost())
    assert timed.capabilities.async_prefill
    assert start_prefill(timed, [item]).result().sequences[0].num_tokens == 3
