"""Cold buckets: after `Controller.warmup()` with `warmup.buckets`, no request shape the limits allow compiles.

The issue: the server compiled only batch size 1 before `ready`, so the first users of every other
batch / prompt / table-width bucket waited on XLA. JAX's own compile log is the witness: with
`jax_log_compiles` on, every compilation logs a line; a burst of mixed requests after the warm-up
must log none.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import pytest

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import AdmissionConfig, Controller, ControllerConfig, WarmupConfig
from jaxserve.testing.hf import make_hf_checkpoint
from models.config import get_config

CFG = get_config("opt-tiny")
# Decode batches 1-8 and tables of 1-8 blocks of 8: several buckets in every dimension for `_burst` to span.
SINGLE_STEP = ServingLimits(block_size=8, num_kv_blocks=64, max_batch_tokens=64, max_decode_batch=8)
# Multi-step decoding adds a loop program per row bucket x table width x sampling: batches 1-4 and tables of 1-4
# blocks of 16 still give several buckets in each dimension, at about half the programs (the CI time it costs).
MULTI_STEP = ServingLimits(block_size=16, num_kv_blocks=32, max_batch_tokens=64, max_decode_batch=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-warm"), CFG, seed=5)


class _Compiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "Compiling" in msg or "compilation" in msg.lower():
            self.lines.append(msg)


def _burst(c: Controller, tag: str) -> list[list[int]]:
    """Mixed prompt lengths and batch sizes, greedy and sampled (seeded), all at once; the tokens."""
    reqs = []
    for i in range(11):
        prompt = (2, *range(10, 10 + 3 * i + 1))  # 2 .. 32 tokens: several prompt buckets
        sampling = SamplingParams(max_tokens=3 + i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        reqs.append(GenerateRequest(f"{tag}-{i}", prompt, sampling))
    streams = [c.submit(r) for r in reqs]
    return [s.collect(timeout_s=300)[0] for s in streams]


@pytest.mark.parametrize(
    ("spec", "steps", "caching", "background"),
    [
        # slow (~35 s): the default run keeps test_engine_warmup's no-compile check on the engine itself
        pytest.param("disagg:prefill=tp1,decode=tp1", 1, False, False, marks=pytest.mark.slow),
        # multi-step decoding: its loop programs are warmed too (slow: every row bucket x table width x sampling)
        pytest.param("disagg:prefill=tp1,decode=tp1", 4, False, False, marks=pytest.mark.slow),
        pytest.param("colocated:tp1,chunk=16", 1, False, False, marks=pytest.mark.slow),
        pytest.param("colocated:tp1", 4, False, False, marks=pytest.mark.slow),
        # prefix caching: the prefill instance's insert, gather, slices and paged prompt-row programs (the second
        # burst hits the first's blocks), all before ready; or what caching needs first (inserts, gathers, the
        # prompt-row steps that hold the others) and the rest on the background thread, stopped right after ready
        # (covering and the slices' fallback alone: the second burst still hits, issue 41's first minute) or left
        # to finish (every program compiled ahead of time is the one the requests run)
        pytest.param("disagg:prefill=tp1,decode=tp1", 1, True, False, marks=pytest.mark.slow),
        pytest.param("disagg:prefill=tp1,decode=tp1", 1, True, "stopped", marks=pytest.mark.slow),
        pytest.param("disagg:prefill=tp1,decode=tp1", 1, True, "done", marks=pytest.mark.slow),
    ],
)
def test_after_bucket_warmup_no_request_compiles(
    spec: str, steps: int, caching: bool, background: bool | str, checkpoint: Path
) -> None:
    config = ControllerConfig(
        admission=AdmissionConfig(max_prompt_tokens=40, max_tokens_limit=24),
        warmup=WarmupConfig(buckets=True, background=bool(background)),
        prefix_policy=PrefixPolicy(enabled=caching),
        limits=MULTI_STEP if steps > 1 else SINGLE_STEP,
        decode_steps_per_call=steps,
    )
    c = Controller.from_plan(str(checkpoint), parse_deployment(spec), config=config)
    handler = _Compiles()
    logger = logging.getLogger("jax")
    c.start()
    try:
        c.warmup()
        for inst in c.instances:
            if background == "done":
                assert inst.engine.background_warmup_done(timeout_s=600)  # type: ignore[attr-defined]
            # covering alone: what the thread had not compiled runs padded up (or takes a fallback), never compiles
            inst.engine.stop_background_warmup()
        logger.addHandler(handler)
        jax.config.update("jax_log_compiles", True)  # global: the instances compile on their own threads
        jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(7)).block_until_ready()  # the witness sees a compile
        assert handler.lines, "jax_log_compiles logged nothing for a fresh program: the check would be blind"
        handler.lines.clear()
        first = _burst(c, "after")
        if caching:  # the same prompts: cached prefixes (paged step, or recomputed while its bucket compiles)
            assert _burst(c, "again") == first
            hits = sum(s.num_prefix_hit_tokens for s in c.stats().instances if s.role == "prefill")
            assert hits > 0, "the second burst must hit the prefill instance's cache"
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        c.shutdown()
    lines = handler.lines
    assert lines == [], f"{len(lines)} compilations after the warm-up, first: {lines[:2]}"
