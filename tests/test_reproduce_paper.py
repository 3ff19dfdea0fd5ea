"""DistServe's Figure 1 and the public simulator's quick start with the shipped A100 profile."""

from __future__ import annotations

import pytest

from placement.paper import PUBLIC_SIMULATOR_FIGURE1, figure1, quickstart


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


def test_figure1_colocated_within_25_percent_of_paper(fig1) -> None:
    # Was an xfail at ~2.2-2.3 rps: the shipped profile left out the artifact's per-step host overhead.
    assert fig1.colocated == pytest.approx(1.6, rel=0.25)


def test_figure1_agrees_with_the_public_simulator(fig1) -> None:
    # DistServe's own simulator on the same setting (measured, see placement/paper.py): within 20 % (600 requests
    # here; one seed moves a max rate by ~5 %; at 1000 requests ours is +10 % colocated, +13 % prefill, +9 % 2P1D).
    assert fig1.colocated == pytest.approx(PUBLIC_SIMULATOR_FIGURE1["colocated"], rel=0.2)
    assert fig1.prefill_only == pytest.approx(PUBLIC_SIMULATOR_FIGURE1["prefill_only"], rel=0.2)
    assert fig1.two_prefill_one_decode == pytest.approx(PUBLIC_SIMULATOR_FIGURE1["2p1d"], rel=0.2)


def test_quickstart_chooses_prefill_tp2_decode_tp1() -> None:
    result = quickstart(num_requests=200, workers=1)
    assert {i.shape for i in result.plan.of_role("prefill")} == {"tp2"}
    assert {i.shape for i in result.plan.of_role("decode")} == {"tp1"}
