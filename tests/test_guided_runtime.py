"""Guided decoding in the runtime: the compile bounds, the matcher replayed from a request's tokens (the one
mechanism behind prefill -> decode hand-offs and resumed requests), the mask on the device, and a guided request
whose decode instance dies going on, token for token, on the other one."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serving_helpers import tiny_tokenizer

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import InstanceSpec, parse_deployment
from jaxserve.core.request import GenerateRequest, GuidedSpec, SamplingParams
from jaxserve.runtime.controller import Controller, ControllerConfig
from jaxserve.runtime.engines.contract import KVPages, StepBatch
from jaxserve.runtime.guided import GrammarCache, GuidedDecoder, GuidedLimits, GuidedRow, apply_bitmask
from jaxserve.runtime.instances import build_engines
from models.config import get_config

pytestmark = pytest.mark.timeout(600)
CFG = get_config("opt-tiny")  # vocab 512 = the tiny tokenizer's
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 50},
        "kind": {"enum": ["x", "yy", "zzz"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["id", "kind", "tags"],
}
SPEC = GuidedSpec("json_schema", json.dumps(SCHEMA), strict=True)


def _decoder(limits: GuidedLimits | None = None) -> GuidedDecoder:
    return GuidedDecoder(tiny_tokenizer(), CFG.vocab_size, CFG.eos_token_ids, limits)


def _allowed(mask_row: np.ndarray) -> list[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits[: CFG.vocab_size])]


class _StuckCompiler:
    """A grammar compiler whose compile does not finish until the test releases it: the compile the time bound
    is for, deterministically (a real compile's time depends on the machine and on when the library frees the GIL)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def compile_json_schema(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        self.release.wait(60)
        raise RuntimeError("released by the test")


def test_a_compile_past_its_time_bound_is_a_400_and_the_same_spec_is_refused_at_once() -> None:
    stuck = _StuckCompiler()
    grammars = GrammarCache(stuck, GuidedLimits(compile_timeout_s=0.05))
    try:
        with pytest.raises(InvalidRequestError, match="within") as e:
            grammars.get(SPEC)
        assert e.value.field == "response_format"
        with pytest.raises(InvalidRequestError, match="within"):
            grammars.get(SPEC)  # remembered: no second compile thread
        assert stuck.calls == 1
    finally:
        stuck.release.set()


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "array", "uniqueItems": True}, "'uniqueItems' at #"),
        ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}}, "'not' at #/properties/a"),
        ({"anyOf": [{"type": "integer"}, {"if": {}}]}, "'if' at #/anyOf/1"),
    ],
)
def test_a_keyword_the_grammar_would_ignore_is_refused_by_name(schema: dict, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says.replace("$", r"\$")):
        _decoder().check(GuidedSpec("json_schema", json.dumps(schema)))


def test_the_matcher_replayed_from_tokens_gives_the_mask_of_the_one_that_stepped() -> None:
    """One decoder steps a request token by token; fresh decoders see it as a decode instance after the hand-off
    (its first token only) and as a resumed request (prompt + output but the last, then the last): same masks."""
    prompt = (2, 40, 41)
    stepped = _decoder()
    out: list[int] = []
    masks = [stepped.bitmask([GuidedRow("r", SPEC, prompt, 0)])[0]]
    while len(out) < 40:
        allowed = _allowed(masks[-1])
        if not allowed or any(t in CFG.eos_token_ids for t in allowed):
            break
        out.append(allowed[len(out) % len(allowed)])  # walk different branches of the grammar
        masks.append(stepped.bitmask([GuidedRow("r", SPEC, (out[-1],), len(out))])[0])
    assert len(out) > 5 and all(len(_allowed(m)) < CFG.vocab_size for m in masks)
    handed_off = _decoder()  # a decode instance: its first row carries the first token, sample index 1
    np.testing.assert_array_equal(handed_off.bitmask([GuidedRow("r", SPEC, (out[0],), 1)])[0], masks[1])
    for k in (3, len(out)):
        resumed = _decoder()  # prompt + out[:k-1] prefilled (its sample discarded), then out[k-1] as a decode row
        resumed.bitmask([GuidedRow("r", SPEC, prompt + tuple(out[: k - 1]), 0)])
        np.testing.assert_array_equal(resumed.bitmask([GuidedRow("r", SPEC, (out[k - 1],), k)])[0], masks[k])


def test_apply_bitmask_sets_forbidden_logits_to_minus_infinity() -> None:
    logits = jnp.arange(2 * 70, dtype=jnp.float32).reshape(2, 70)
    mask = np.zeros((2, 3), np.int32)
    mask[0, 0] = 1 << 5  # row 0: token 5 only
    mask[0, 2] = 1 << 1  # and token 65
    mask[1] = -1  # row 1: unconstrained
    out = np.asarray(apply_bitmask(logits, mask))
    assert [int(t) for t in np.flatnonzero(np.isfinite(out[0]))] == [5, 65]
    np.testing.assert_array_equal(out[1], np.asarray(logits[1]))


class _DiesOnDecode:
    """A model engine whose decode steps fail from the `die_at`-th on (the instance dies; its requests move)."""

    def __init__(self, inner: object, die_at: int | None) -> None:
        self.inner, self.die_at, self.num_calls = inner, die_at, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    @property
    def guided(self) -> object:
        return self.inner.guided  # type: ignore[attr-defined]

    @guided.setter
    def guided(self, value: object) -> None:
        self.inner.guided = value  # type: ignore[attr-defined]

    def _count(self) -> None:
        self.num_calls += 1
        if self.die_at is not None and self.num_calls >= self.die_at:
            raise RuntimeError("device lost")

    def decode_step(self, batch: StepBatch, pages: KVPages):  # type: ignore[no-untyped-def]
        self._count()
        return self.inner.decode_step(batch, pages)  # type: ignore[attr-defined]

    def decode_step_logprobs(self, batch: StepBatch, pages: KVPages):  # type: ignore[no-untyped-def]
        self._count()
        return self.inner.decode_step_logprobs(batch, pages)  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", ["disagg:prefill=tp1,decode=2xtp1", "colocated:2xtp1,chunk=16"])
def test_a_guided_request_whose_instance_dies_goes_on_with_identical_output(tmp_path, spec: str) -> None:
    from jaxserve.runtime.engines.model import model_engine_factory
    from jaxserve.testing.hf import make_hf_checkpoint

    base = model_engine_factory(str(make_hf_checkpoint(tmp_path / "opt-tiny-hf", CFG, seed=5)))
    plan = parse_deployment(spec)
    config = ControllerConfig(limits=ServingLimits(block_size=4, num_kv_blocks=128, max_batch_tokens=64))
    prompts = [(2, 100, 31, 7, 8), (2, 5, 6), (2, 300, 301, 302, 17)]
    victim = "decode-0" if spec.startswith("disagg") else "colocated-0"

    def run(die_at: int | None) -> tuple[list[list[int]], Controller]:
        counts: dict[str, int] = {}

        def factory(inst: InstanceSpec, devices: Sequence[jax.Device]) -> object:
            i = counts.get(inst.role, 0)
            counts[inst.role] = i + 1
            engine = base(inst, devices)
            return _DiesOnDecode(engine, die_at) if f"{inst.role}-{i}" == victim else engine

        c = Controller(build_engines(plan, factory), plan, config)  # type: ignore[arg-type]
        c.tokenizer = tiny_tokenizer()
        c.start()
        try:
            sampling = [SamplingParams(max_tokens=60, temperature=1.0, seed=10 + i, guided=SPEC) for i in range(3)]
            streams = [c.submit(GenerateRequest(f"r{i}", p, sampling[i])) for i, p in enumerate(prompts)]
            return [s.collect(timeout_s=300)[0] for s in streams], c
        finally:
            c.shutdown(drain_timeout_s=0)

    reference, _ = run(None)
    moved, c = run(die_at=6)
    assert c.stats().faults.num_rerouted_requests > 0
    assert moved == reference
    tok = tiny_tokenizer()
    for ids in reference:
        text = tok.decode([t for t in ids if t not in CFG.eos_token_ids])
        value = json.loads(text)
        assert set(value) == {"id", "kind", "tags"} and 0 <= value["id"] <= 50 and value["kind"] in ("x", "yy", "zzz")


def test_llm_generate_takes_a_guided_spec_and_a_fake_deployment_refuses_it() -> None:
    import jaxserve
    from jaxserve.assets import default_model_path
    from jaxserve.runtime.engines.fake import fake_engine_factory

    spec = jaxserve.GuidedSpec("json_schema", json.dumps(SCHEMA), strict=True)
    with jaxserve.LLM(model=str(default_model_path()), deployment="colocated:tp1") as llm:
        outs = llm.generate(["import os\n", "def f():"], jaxserve.SamplingParams(max_tokens=80, guided=spec))
        tok = llm.controller.tokenizer
        for out in outs:
            assert out.finish_reason == "stop"
            value = json.loads(tok.decode(list(out.token_ids)))
            assert set(value) == {"id", "kind", "tags"} and value["kind"] in ("x", "yy", "zzz")
    fake = jaxserve.LLM(model="opt-tiny", deployment="colocated:tp1", engine_factory=fake_engine_factory(CFG))
    with fake, pytest.raises(InvalidRequestError, match="engines that mask logits"):
        fake.generate([2, 7], jaxserve.SamplingParams(max_tokens=4, guided=spec))


def test_after_the_grammar_ends_ignore_eos_tokens_go_unconstrained_quietly(caplog) -> None:
    decoder = _decoder()
    spec = GuidedSpec("json_schema", json.dumps({"type": "integer", "minimum": 0, "maximum": 5}))
    first = _allowed(decoder.bitmask([GuidedRow("r", spec, (2, 7), 0)])[0])
    assert first and len(first) < CFG.vocab_size
    ends = _allowed(decoder.bitmask([GuidedRow("r", spec, (first[0],), 1)])[0])
    eos = CFG.eos_token_ids[0]
    assert eos in ends
    after = decoder.bitmask([GuidedRow("r", spec, (eos,), 2)])[0]  # the stop token accepted: the grammar ended
    assert len(_allowed(after)) == CFG.vocab_size
    later = decoder.bitmask([GuidedRow("r", spec, (9,), 3)])[0]  # ignore_eos: the request goes on, unconstrained
    assert len(_allowed(later)) == CFG.vocab_size and "unconstrained" not in caplog.text


@pytest.mark.parametrize("spec", ["colocated:tp1,chunk=8", "disagg:prefill=tp1,decode=tp1"])
def test_guided_through_chunked_prefill_and_a_prefix_cache_hit(tmp_path, spec: str) -> None:
    """The first token is sampled under the mask where the prompt's last chunk runs (a 45-token prompt in chunks of
    8 on a colocated instance; whole on a prefill instance), and a second request for the same prompt, served from
    the prefix cache, rebuilds its matcher from its own tokens: the same valid output as a run without chunks or
    cache."""
    from jaxserve.core.scheduling import NO_PREFIX_CACHING
    from jaxserve.runtime.engines.model import model_engine_factory
    from jaxserve.testing.hf import make_hf_checkpoint

    factory = model_engine_factory(str(make_hf_checkpoint(tmp_path / "opt-tiny-hf", CFG, seed=5)))
    limits = ServingLimits(block_size=4, num_kv_blocks=128, max_batch_tokens=64)
    prompt = (2, *range(40, 84))  # 45 tokens: six chunks of 8, eleven whole blocks of 4
    sampling = SamplingParams(max_tokens=60, temperature=0.0, guided=SPEC)

    def run(plan_spec: str, config: ControllerConfig, times: int) -> list[tuple[list[int], int]]:
        plan = parse_deployment(plan_spec)
        c = Controller(build_engines(plan, factory), plan, config)  # type: ignore[arg-type]
        c.tokenizer = tiny_tokenizer()
        c.start()
        try:
            outs = []
            for i in range(times):  # one after another: the second finds the first's blocks
                ids, last = c.submit(GenerateRequest(f"r{i}", prompt, sampling)).collect(timeout_s=300)
                assert last.timings is not None
                outs.append((ids, last.timings.cached_prompt_tokens))
            return outs
        finally:
            c.shutdown(drain_timeout_s=0)

    (reference, _), = run(spec.split(",chunk")[0].replace("disagg:prefill=tp1,decode=tp1", "colocated:tp1"),
                          ControllerConfig(limits=limits, prefix_policy=NO_PREFIX_CACHING), 1)  # fmt: skip
    (first, first_cached), (again, again_cached) = run(spec, ControllerConfig(limits=limits), 2)
    assert first_cached == 0 and again_cached > 0
    assert first == reference and again == reference
    text = tiny_tokenizer().decode([t for t in reference if t not in CFG.eos_token_ids])
    value = json.loads(text)
    assert set(value) == {"id", "kind", "tags"} and value["kind"] in ("x", "yy", "zzz")
