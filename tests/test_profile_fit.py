"""The profile fit: recovers known coefficients from step times the latency model itself produced,
stays close under noise, finds L_m where throughput saturates, and writes entries `latency.py` loads."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import get_config
from placement.hardware import get_device
from placement.latency import AppendixCoefficients, AppendixModel, LatencyProvider, Profile, StepOverhead
from placement.padding import EnginePadding, PaddedModel
from placement.profile_fit import (
    DecodeSample,
    PrefillSample,
    detect_lm,
    fit_instance,
    nnls,
    profile_entry,
)
from placement.step_time import decode_step_s, prefill_step_s

CFG = get_config("opt-mini")
TRUE = AppendixCoefficients(C1=2.0e-11, C2=3.0e-10, C3=1.5e-3, C4=4.0e-10, C5=6.0e-10, C6=8.0e-4)
PREFILL_SHAPES = [(b, n) for b in (1, 2, 3, 4) for n in (16, 48, 128, 256) if b * n <= 512]
DECODE_SHAPES = [(b, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (16, 160, 320)]


def _model(coeffs: AppendixCoefficients, tp: int = 1) -> AppendixModel:
    return AppendixModel(CFG, coeffs, tp=tp, pp=1, link_bandwidth=10e9, stage_link_bandwidth=10e9)


def _samples(
    coeffs: AppendixCoefficients, tp: int = 1, noise: float = 0.0, seed: int = 0
) -> tuple[list[PrefillSample], list[DecodeSample]]:
    rng = np.random.default_rng(seed)
    m = _model(coeffs, tp)
    pre = []
    for b, n in PREFILL_SHAPES:
        s = m.prefill_stage_s(float(b * n), float(b * n * n), b)
        pre.append(PrefillSample((n,) * b, s * (1 + noise * rng.standard_normal())))
    dec = []
    for b, c in DECODE_SHAPES:
        s = m.decode_stage_s(b, float(b * c))
        dec.append(DecodeSample(b, b * c, s * (1 + noise * rng.standard_normal())))
    return pre, dec


def test_nnls_matches_hand_solution() -> None:
    # y = 2·x0 + 0·x1 exactly; unconstrained least squares would give x1 a negative weight on noise.
    a = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    assert nnls(a, np.array([2.0, 4.0, 6.0])) == pytest.approx([2.0, 0.0], abs=1e-12)
    # The unconstrained optimum (−1 intercept) is infeasible: NNLS drops the intercept.
    assert np.all(nnls(a, np.array([1.0, 3.0, 5.0])) >= 0)


def test_fit_recovers_exact_coefficients() -> None:
    pre, dec = _samples(TRUE)
    fit = fit_instance(CFG, 1, pre, dec)
    c = fit.coefficients
    # Large batches are compute-bound (C1·B > C4 from B = 20): the fit must use the roofline's max.
    assert TRUE.C1 * 64 > TRUE.C4 > TRUE.C1 * 16
    for name in ("C1", "C2", "C4", "C5"):
        assert c[name] == pytest.approx(getattr(TRUE, name), rel=1e-6)
    # At pp = 1 the per-step constants are step overhead: the decode constant C6 = 0.8 ms is fixed_s,
    # the prefill constant C3 = 1.5 ms is fixed_s + prefill_s (0.7 ms); nothing per context token.
    assert c["C3"] == 0.0 and c["C6"] == pytest.approx(0.0, abs=1e-12)
    fixed_s, per_ctx_token_s, prefill_s = fit.overhead
    assert fixed_s == pytest.approx(8.0e-4, rel=1e-6) and prefill_s == pytest.approx(7.0e-4, rel=1e-6)
    assert per_ctx_token_s == pytest.approx(0.0, abs=1e-15)
    assert fit.prefill_error.max_rel < 1e-9 and fit.decode_error.max_rel < 1e-9


def test_fit_yields_the_step_overhead_the_simulator_charges() -> None:
    """Step times from `placement/step_time.py` itself (padded kernels + a StepOverhead with every term,
    the per-token one on actual tokens): the fit returns that overhead, and the profile entry, loaded by
    the planner, predicts every step exactly."""
    kernel = AppendixCoefficients(C1=TRUE.C1, C2=TRUE.C2, C3=0.0, C4=TRUE.C4, C5=TRUE.C5, C6=0.0)
    overhead = StepOverhead(fixed_s=1.2e-3, per_ctx_token_s=2.0e-7, prefill_s=0.5e-3)
    pad = EnginePadding()
    engine = PaddedModel(_model(kernel), pad)
    pre = [PrefillSample((n,) * b, prefill_step_s(engine, overhead, (n,) * b)) for b, n in PREFILL_SHAPES]
    pre += [PrefillSample((n,) * b, prefill_step_s(engine, overhead, (n,) * b)) for b, n in [(1, 100), (3, 70)]]
    dec = [DecodeSample(b, b * c, decode_step_s(engine, overhead, b, float(b * c))) for b, c in DECODE_SHAPES]
    dec += [DecodeSample(b, b * c, decode_step_s(engine, overhead, b, float(b * c))) for b, c in [(3, 100), (5, 40)]]
    entry = profile_entry(CFG, 1, "disagg", pre, dec, padding=pad)
    assert entry["step_overhead"] == pytest.approx([1.2e-3, 2.0e-7, 0.5e-3], rel=1e-6)
    assert entry["C3"] == 0.0 and entry["C6"] == pytest.approx(0.0, abs=1e-12)
    # The Appendix form alone (the entry without its bucket costs) is exact; the bucket costs the entry
    # charges (placement/bucket_latency.py) fold each prompt's LM head row into its token bucket: 1e-3 here.
    appendix = {k: v for k, v in entry.items() if k != "bucket_costs"}
    for charged, rel in ((appendix, 1e-6), (entry, 1e-3)):
        provider = LatencyProvider(CFG, get_device("cpu"), Profile.from_dict({"name": "f", "entries": [charged]}))
        model, fitted = provider.instance("disagg", 1, 1), provider.step_overhead("disagg", 1)
        assert fitted == StepOverhead(*entry["step_overhead"])
        for b, n in [(1, 200), (2, 90), (5, 33)]:  # off the grid
            want = prefill_step_s(engine, overhead, (n,) * b)
            assert prefill_step_s(model, fitted, (n,) * b) == pytest.approx(want, rel=rel)
        for b, c in [(6, 77), (24, 200), (1, 500)]:
            want = decode_step_s(engine, overhead, b, float(b * c))
            assert decode_step_s(model, fitted, b, float(b * c)) == pytest.approx(want, rel=rel)


def test_a_decode_constant_above_the_prefill_one_goes_to_c6() -> None:
    # Prefill steps cost 0.4 ms beyond their kernels, decode steps 1 ms: fixed_s 0.4 ms, C6 0.6 ms, no prefill_s.
    coeffs = AppendixCoefficients(**{**TRUE.__dict__, "C3": 0.4e-3, "C6": 1.0e-3})
    pre, dec = _samples(coeffs)
    fit = fit_instance(CFG, 1, pre, dec)
    assert fit.overhead[0] == pytest.approx(0.4e-3, rel=1e-6) and fit.overhead[2] == pytest.approx(0.0, abs=1e-12)
    assert fit.coefficients["C6"] == pytest.approx(0.6e-3, rel=1e-6)


def test_fit_with_tensor_parallel_allreduce() -> None:
    coeffs = AppendixCoefficients(**{**TRUE.__dict__, "allreduce_s_per_byte": 2e-10})
    pre, dec = _samples(coeffs, tp=2)
    fit = fit_instance(CFG, 2, pre, dec)
    assert fit.coefficients["allreduce_s_per_byte"] == pytest.approx(2e-10, rel=1e-6)
    assert fit.coefficients["C1"] == pytest.approx(TRUE.C1, rel=1e-6)


def test_fit_under_noise_predicts_within_noise() -> None:
    pre, dec = _samples(TRUE, noise=0.05, seed=1)
    entry = profile_entry(CFG, 1, "disagg", pre, dec)
    provider = LatencyProvider(CFG, get_device("cpu"), Profile.from_dict({"name": "t", "entries": [entry]}))
    m_fit, overhead = provider.instance("disagg", 1, 1), provider.step_overhead("disagg", 1)
    m_true = _model(TRUE)
    for b, n in [(1, 200), (2, 100), (3, 64)]:
        t, t2 = float(b * n), float(b * n * n)
        assert prefill_step_s(m_fit, overhead, (n,) * b) == pytest.approx(m_true.prefill_stage_s(t, t2, b), rel=0.08)
    for b, c in [(3, 100), (24, 200)]:
        assert decode_step_s(m_fit, overhead, b, b * c) == pytest.approx(m_true.decode_stage_s(b, b * c), rel=0.08)
    assert entry["fit"]["prefill"]["mean_rel_error"] < 0.08
    assert entry["fit"]["decode"]["num_samples"] == len(DECODE_SHAPES)


def test_detect_lm_is_where_throughput_saturates() -> None:
    # 2 ms fixed + 0.1 ms/token: throughput t/(2 + 0.1 t) tokens/ms reaches 90 % of its best measured
    # value (at 1024 tokens: 9.81) first at 256 tokens (9.28); 128 tokens gives 8.65.
    samples = [PrefillSample((t,), (2.0 + 0.1 * t) / 1000) for t in (16, 64, 128, 256, 512, 1024)]
    assert detect_lm(samples, 0.9) == 256
    assert detect_lm(samples, 0.8) == 128


def test_profile_entry_round_trips_through_the_planner() -> None:
    pre, dec = _samples(TRUE)
    entry = profile_entry(CFG, 1, "colocated", pre, dec, l_m=384)
    profile = Profile.from_dict({"name": "fitted", "device": "cpu", "entries": [entry]})
    provider = LatencyProvider(CFG, get_device("cpu"), profile)
    assert provider.supports("colocated", 1) and not provider.supports("disagg", 1)
    assert provider.prefill_token_budget("colocated", 1) == 384
    model, overhead = provider.instance("colocated", 1, 1), provider.step_overhead("colocated", 1)
    assert decode_step_s(model, overhead, 4, 400.0) == pytest.approx(_model(TRUE).decode_stage_s(4, 400.0), rel=1e-6)


def test_engine_padding_mirrors_the_engine_buckets() -> None:
    from jaxserve.runtime.engines.contract import bucket as engine_bucket
    from placement.padding import bucket

    for n in range(1, 300):
        assert bucket(n) == engine_bucket(n) and bucket(n, 16) == engine_bucket(n, 16)
    pad = EnginePadding()
    # 5 rows of context 270: rows -> 8; blocks ceil(271/16) = 17 -> table of 32 blocks = 512 positions per row.
    assert pad.decode(5, 5 * 270.0) == (8, 8 * 512.0)
    assert pad.decode(1, 20.0) == (2, 2 * 32.0)  # one row runs as two; blocks ceil(21/16) = 2, already a power of 2
    # 3 prompts of 100 -> 4 rows of 128 tokens.
    assert pad.prefill(300.0, 3 * 100.0**2, 3) == (512.0, 4 * 128.0**2, 4)
    base = _model(TRUE)
    padded = PaddedModel(base, pad)
    assert padded.decode_stage_s(5, 1350.0) == base.decode_stage_s(8, 4096.0)
    assert padded.prefill_stage_s(300.0, 30000.0, 3) == base.prefill_stage_s(512.0, 65536.0, 4)
    # A mixed step: one 100-token chunk (-> 128) with those 5 decodes riding along, which the engine runs as a
    # decode sub-batch of its own (8 rows of 512 positions), not padded to the chunk's length.
    assert padded.chunk_stage_s(100.0, 100.0**2, 1, 5, 1350.0) == base.chunk_stage_s(128.0, 128.0**2, 1, 8, 4096.0)
    assert padded.chunk_stage_s(100.0, 100.0**2, 1, 0, 0.0) == base.chunk_stage_s(128.0, 128.0**2, 1, 0, 0.0)


def test_padded_fit_recovers_coefficients_of_a_padded_engine() -> None:
    pad = EnginePadding()
    engine = PaddedModel(_model(TRUE), pad)  # an engine that computes padded shapes
    pre = [
        PrefillSample((n,) * b, engine.prefill_stage_s(float(b * n), float(b * n * n), b)) for b, n in PREFILL_SHAPES
    ]
    dec = [DecodeSample(b, b * c, engine.decode_stage_s(b, float(b * c))) for b, c in DECODE_SHAPES]
    plain = profile_entry(CFG, 1, "disagg", pre, dec)
    padded = profile_entry(CFG, 1, "disagg", pre, dec, padding=pad)
    assert padded["C1"] == pytest.approx(TRUE.C1, rel=1e-6) and padded["C5"] == pytest.approx(TRUE.C5, rel=1e-6)
    assert padded["fit"]["decode"]["max_rel_error"] < 1e-9
    assert plain["fit"]["decode"]["max_rel_error"] > 0.05  # the unpadded formula cannot describe it


def test_chunked_decode_attention_is_charged_the_chunks_it_reads() -> None:
    """The CPU engine's decode attention (`models.paged_attention`, impl "xla") reads the table in chunks of
    CHUNK_BYTES over the batch up to the chunk holding the last position before the new token; a padded
    table's empty columns cost nothing. opt-mini: one column of K is 16 · 256 · 4 = 16 KiB per row."""
    pad = EnginePadding(attention_chunk_bytes=256 * 1024, kv_column_bytes=16 * 256 * 4)
    # 10 rows (16 padded) of context 300: 256 KiB / (16 · 16 KiB) = 1 column a chunk, ceil(300/16) = 19 chunks
    # (the table is 32 columns wide): 16 rows x 19 · 16 positions.
    assert pad.decode(10, 3000.0) == (16, 16 * 19 * 16.0)
    # 5 rows (8) of context 600: 2 columns a chunk, ceil(600/32) = 19 chunks = 38 columns; the same work.
    assert pad.decode(5, 3000.0) == (8, 8 * 38 * 16.0)
    # 4 rows of context 64: 4 columns a chunk, one chunk (64 positions precede the new token) of an 8-wide table.
    assert pad.decode(4, 256.0) == (4, 4 * 4 * 16.0)
    # 2 rows of context 16: 8 columns a chunk, capped at the 2-column table.
    assert pad.decode(2, 32.0) == (2, 2 * 2 * 16.0)
    # Without a chunk size (the one-gather form, and profiles written before the field) the whole table.
    assert EnginePadding().decode(10, 3000.0) == (16, 16 * 32 * 16.0)
