"""`core.request.validate_request`: the one check of a request before admission, on plain limits (no runtime).

The servers' answers to the same errors (field, status) are tests/test_serving_errors.py's; here each rule
is stepped by hand at its boundary.
"""

from __future__ import annotations

import pytest

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.request import GenerateRequest, RequestLimits, SamplingParams, validate_request

LIMITS = RequestLimits(vocab_size=50, max_positions=64, max_prompt_tokens=40, max_tokens_limit=30, kv_pool_tokens=48)


def _field(request: GenerateRequest, limits: RequestLimits = LIMITS) -> str | None:
    try:
        validate_request(request, limits)
    except InvalidRequestError as e:
        return e.field
    return None


def test_a_request_inside_every_limit_passes() -> None:
    assert _field(GenerateRequest("r", (1,) * 18, SamplingParams(max_tokens=30))) is None  # 48 tokens: the pool


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (GenerateRequest("", (1,)), "request_id"),
        (GenerateRequest("r", ()), "prompt_token_ids"),
        (GenerateRequest("r", (50,)), "prompt_token_ids"),  # vocabulary is [0, 50)
        (GenerateRequest("r", (True,)), "prompt_token_ids"),
        (GenerateRequest("r", (1,) * 41, SamplingParams(max_tokens=1)), "prompt_token_ids"),  # 41 > 40
        (GenerateRequest("r", (1,), SamplingParams(max_tokens=31)), "max_tokens"),  # the sampling check
        (GenerateRequest("r", (1,), SamplingParams(stop_token_ids=(50,))), "stop_token_ids"),
        (GenerateRequest("r", (1,) * 19, SamplingParams(max_tokens=30)), "max_tokens"),  # 49 > the 48-token pool
    ],
)
def test_the_first_bad_field_is_named(request_: GenerateRequest, field: str) -> None:
    assert _field(request_) == field


def test_positions_come_before_the_pool() -> None:
    big_pool = RequestLimits(50, 64, 60, 30, kv_pool_tokens=1000)
    assert _field(GenerateRequest("r", (1,) * 34, SamplingParams(max_tokens=30)), big_pool) is None  # 64 positions
    with pytest.raises(InvalidRequestError, match=r"exceeds the model's 64 positions"):
        validate_request(GenerateRequest("r", (1,) * 35, SamplingParams(max_tokens=30)), big_pool)


def test_logprobs_need_engines_that_compute_them() -> None:
    no_logprobs = RequestLimits(50, 64, 40, 30, 48, logprobs=False)
    assert _field(GenerateRequest("r", (1,), SamplingParams(logprobs=2)), no_logprobs) == "logprobs"
    assert _field(GenerateRequest("r", (1,), SamplingParams()), no_logprobs) is None
    assert _field(GenerateRequest("r", (1,), SamplingParams(logprobs=2))) is None


def test_a_caching_prefill_pool_bounds_the_prompt_alone() -> None:
    small_prefill = RequestLimits(50, 64, 40, 30, kv_pool_tokens=48, prefill_pool_tokens=8)
    assert _field(GenerateRequest("r", (1,) * 8, SamplingParams(max_tokens=30)), small_prefill) is None
    with pytest.raises(InvalidRequestError, match=r"prefill instance's KV pool \(8 tokens\)"):
        validate_request(GenerateRequest("r", (1,) * 9, SamplingParams(max_tokens=1)), small_prefill)
