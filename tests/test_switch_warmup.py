"""A live switch warms the new instances' buckets before routing to them: after it, no request compiles.

The issue: `Controller.warm_up_staged` sent one short request through each new instance, so the first
users of every other batch / prompt / table-width bucket on the new devices waited on XLA (a jitted
function compiles again for arguments on other devices). JAX's compile log is the witness, as in
`tests/test_runtime_warmup.py`: a burst of mixed requests after the switch must log no compilation.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import pytest
from test_runtime_warmup import _burst, _Compiles  # the same witness and burst as the serve warm-up test

from jaxserve.core.limits import ServingLimits
from jaxserve.core.plan import parse_deployment
from jaxserve.runtime.controller import AdmissionConfig, Controller, ControllerConfig, WarmupConfig
from jaxserve.runtime.engines.model import model_engine_factory
from jaxserve.runtime.switch import PlanSwitcher
from jaxserve.testing.hf import make_hf_checkpoint
from models.config import get_config

pytestmark = (
    pytest.mark.slow
)  # 68-123 s at load 2-3.4 on 2 cores with caching on: every bucket and KV copy of three instances compiles

CFG = get_config("opt-tiny")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-switch-warm"), CFG, seed=7)


def test_after_a_switch_to_new_instances_no_request_compiles(checkpoint: Path) -> None:
    # Fewer buckets than the serve warm-up test (decode batches 1-8, tables of 1-8 blocks of 8), every dimension
    # still several: the burst of 11 mixed requests spans them, and each new instance compiles all of them.
    config = ControllerConfig(
        admission=AdmissionConfig(max_prompt_tokens=40, max_tokens_limit=24),
        warmup=WarmupConfig(buckets=True),
        limits=ServingLimits(block_size=8, num_kv_blocks=64, max_batch_tokens=64, max_decode_batch=8),
        # prefix caching on (the default): the burst's prompts share prefixes, so the new decode instance pulls
        # only the rest of some (a slice of the kept prefill's KV, resharded onto tp2: warmed like a whole pull)
    )
    factory = model_engine_factory(str(checkpoint))
    c = Controller.from_plan(str(checkpoint), parse_deployment("disagg:prefill=tp1,decode=tp1"), None, factory, config)
    switcher = PlanSwitcher(c, factory, drain_timeout_s=30)
    handler = _Compiles()
    logger = logging.getLogger("jax")
    c.start()
    try:
        c.warmup()
        # keeps prefill-0 (device 0); adds a tp1 prefill on device 2 and a tp2 decode on 3-4; retires decode-0
        report = switcher.switch(parse_deployment("disagg:prefill=2xtp1,decode=tp2"))
        assert report.kept == ("prefill-0",) and len(report.added) == 2
        assert report.warmup_s > 0 and report.to_dict()["warmup_s"] == report.warmup_s
        assert [i.devices for i in c.plan.instances] == [(0,), (2,), (3, 4)]
        logger.addHandler(handler)
        jax.config.update("jax_log_compiles", True)  # global: the instances compile on their own threads
        jax.jit(lambda x: x * 5 + 2)(jax.numpy.ones(9)).block_until_ready()  # the witness sees a compile
        assert handler.lines, "jax_log_compiles logged nothing for a fresh program: the check would be blind"
        handler.lines.clear()
        _burst(c, "after-switch")
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        c.shutdown()
    assert handler.lines == [], f"{len(handler.lines)} compilations after the switch, first: {handler.lines[:2]}"
