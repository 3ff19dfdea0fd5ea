"""`warmup.logprobs` (`serve --warmup-logprobs`): after the bucket warm-up, requests asking for logprobs
compile nothing either.

Without it the warm-up compiles the token programs only: the first request with `logprobs` in each
row bucket compiled the log-softmax + top-k of its logits (and, multi-step, the loop program's logprob
variant) while its user waited. JAX's compile log is the witness, as in `test_runtime_warmup.py`. The
instances run on devices no other test of the suite uses, so no program is already compiled.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import pytest
from test_runtime_warmup import MULTI_STEP, SINGLE_STEP, _Compiles

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.core.request import GenerateRequest, SamplingParams
from jaxserve.core.scheduling import PrefixPolicy
from jaxserve.runtime.controller import AdmissionConfig, Controller, ControllerConfig, WarmupConfig
from jaxserve.testing.hf import make_hf_checkpoint
from models.config import get_config

CFG = get_config("opt-tiny")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-warm-lp"), CFG, seed=5)


def _burst(c: Controller, tag: str) -> None:
    """Mixed prompt lengths and batch sizes, greedy and sampled, most asking for logprobs."""
    reqs = []
    for i in range(11):
        prompt = (2, *range(10, 10 + 3 * i + 1))
        sampling = SamplingParams(
            max_tokens=3 + i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True,
            logprobs=None if i % 3 == 0 else i % 6,
        )  # fmt: skip
        reqs.append(GenerateRequest(f"{tag}-{i}", prompt, sampling))
    streams = [c.submit(r) for r in reqs]
    for s in streams:
        s.collect(timeout_s=300)


@pytest.mark.parametrize(
    ("spec", "steps", "caching", "first_device", "limits"),
    [
        # slow (~45 s): every logprob bucket compiled; the default run keeps test_engine_warmup's no-compile check
        pytest.param("disagg:prefill=tp1,decode=tp1", 1, False, 6, SINGLE_STEP, marks=pytest.mark.slow),
        # the multi-step loop's logprob variants (caching off: test_runtime_warmup covers caching's programs)
        pytest.param("disagg:prefill=tp1,decode=tp1", 4, False, 4, MULTI_STEP, marks=pytest.mark.slow),
    ],
)
def test_after_logprob_warmup_no_logprob_request_compiles(
    spec: str, steps: int, caching: bool, first_device: int, limits: ServingLimits, checkpoint: Path
) -> None:
    config = ControllerConfig(
        admission=AdmissionConfig(max_prompt_tokens=40, max_tokens_limit=24),
        warmup=WarmupConfig(buckets=True, logprobs=True),
        prefix_policy=PrefixPolicy(enabled=caching),
        limits=limits,
        decode_steps_per_call=steps,
    )
    devices = jax.devices()[first_device : first_device + 2]
    c = Controller.from_plan(str(checkpoint), parse_deployment(spec), devices=devices, config=config)
    handler = _Compiles()
    logger = logging.getLogger("jax")
    c.start()
    try:
        c.warmup()
        logger.addHandler(handler)
        jax.config.update("jax_log_compiles", True)
        jax.jit(lambda x: x * 5 + 2)(jax.numpy.ones(9)).block_until_ready()  # the witness sees a compile
        assert handler.lines, "jax_log_compiles logged nothing for a fresh program: the check would be blind"
        handler.lines.clear()
        _burst(c, "after")
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        c.shutdown()
    assert handler.lines == [], f"{len(handler.lines)} compilations after the warm-up, first: {handler.lines[:2]}"
