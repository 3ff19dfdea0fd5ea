"""DistServe's Figure 1 and the public simulator's quick start with the shipped A100 profile."""

from __future__ import annotations

import pytest

from placement.paper import figure1, quickstart


@pytest.fixture(scope="module")
def fig1():
    return figure1(num_requests=600)


def test_figure1_disaggregation_beats_colocation_per_gpu(fig1) -> None:
    # The paper: 2 prefill + 1 decode GPUs serve 3.3 rps per GPU, 2.1x colocated's 1.6.
    assert fig1.disagg_per_device_gain >= 1.8
    # Each phase alone outruns colocation, and decode-only outruns prefill-only (paper: 10 vs 5.6).
    assert fig1.decode_only > fig1.prefill_only > fig1.colocated
    # Two prefill GPUs feed one decode GPU: the pair is decode-bound, as in the paper.
    assert fig1.two_prefill_one_decode == pytest.approx(fig1.decode_only, rel=0.05)


@pytest.mark.xfail(
    strict=True,
    reason="the artifact's coloc coefficients give ~2.3 rps in our simulator (paper's measured vLLM: 1.6); "
    "every Figure 1 rate is ~1.5-2x the paper's measurement, see the planner report",
)
def test_figure1_colocated_within_25_percent_of_paper(fig1) -> None:
    assert fig1.colocated == pytest.approx(1.6, rel=0.25)


def test_quickstart_chooses_prefill_tp2_decode_tp1() -> None:
    result = quickstart(num_requests=200, workers=1)
    assert {i.shape for i in result.plan.of_role("prefill")} == {"tp2"}
    assert {i.shape for i in result.plan.of_role("decode")} == {"tp1"}
