"""Workloads: fitted length distributions, arrival processes, JSONL traces."""

from __future__ import annotations

import numpy as np
import pytest

from placement.workload import (
    Workload,
    arrival_times,
    clipped_lognormal_mean,
    generate,
    get_length_distribution,
    load_workload,
)


@pytest.mark.parametrize(
    ("name", "mean_in", "mean_out"),
    [("sharegpt", 755.5, 200.3), ("humaneval", 171.3, 98.2), ("longbench", 1738.3, 90.7)],
)
def test_length_means_match_published_statistics(name: str, mean_in: float, mean_out: float) -> None:
    inputs, outputs = get_length_distribution(name).sample(np.random.default_rng(0), 100_000)
    assert inputs.mean() == pytest.approx(mean_in, rel=0.01)
    assert outputs.mean() == pytest.approx(mean_out, rel=0.01)
    assert np.all(inputs + outputs <= 2048) and inputs.min() >= 1 and outputs.min() >= 1


def test_sharegpt_is_right_skewed_and_humaneval_narrow() -> None:
    rng = np.random.default_rng(1)
    share_in, _ = get_length_distribution("sharegpt").sample(rng, 50_000)
    human_in, _ = get_length_distribution("humaneval").sample(rng, 50_000)
    assert np.median(share_in) < 0.8 * share_in.mean()
    assert human_in.std() / human_in.mean() < 0.5 < share_in.std() / share_in.mean()


def test_clipped_lognormal_mean_against_sampling() -> None:
    rng = np.random.default_rng(2)
    x = np.clip(rng.lognormal(6.0, 1.0, 1_000_000), 4, 2047)
    assert clipped_lognormal_mean(6.0, 1.0, 4, 2047) == pytest.approx(x.mean(), rel=0.002)


def test_fixed_and_bad_names() -> None:
    w = generate("fixed:512:64", 2.0, 10, np.random.default_rng(0))
    assert set(w.input_lens) == {512} and set(w.output_lens) == {64}
    for bad in ("fixed:512", "fixed:a:1", "fixed:2048:1", "nosuch"):
        with pytest.raises(ValueError):
            get_length_distribution(bad)


def test_poisson_and_gamma_arrivals() -> None:
    rng = np.random.default_rng(3)
    t = arrival_times(rng, 4.0, 200_000)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.25, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.02)
    bursty = np.diff(arrival_times(rng, 4.0, 200_000, cv=2.0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.02)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.03)


def test_same_seed_same_workload_and_rate_rescaling() -> None:
    a = generate("sharegpt", 3.0, 100, np.random.default_rng(7))
    b = generate("sharegpt", 3.0, 100, np.random.default_rng(7))
    np.testing.assert_array_equal(a.arrival_at, b.arrival_at)
    np.testing.assert_array_equal(a.input_lens, b.input_lens)
    faster = a.with_rate(6.0)
    np.testing.assert_allclose(faster.arrival_at, a.arrival_at / 2)
    np.testing.assert_array_equal(faster.output_lens, a.output_lens)


def test_jsonl_round_trip(tmp_path) -> None:
    w = generate("humaneval", 5.0, 50, np.random.default_rng(0))
    path = tmp_path / "trace.jsonl"
    w.to_jsonl(path)
    back = Workload.from_jsonl(path)
    np.testing.assert_allclose(back.arrival_at, w.arrival_at, atol=1e-6)
    np.testing.assert_array_equal(back.input_lens, w.input_lens)
    np.testing.assert_array_equal(back.output_lens, w.output_lens)
    again = load_workload(str(path), 10.0, 0, np.random.default_rng(0))
    assert again.rate == 10.0 and len(again) == 50
    (tmp_path / "bad.jsonl").write_text('{"arrival_at": 0.0}\n')
    with pytest.raises(ValueError, match="bad trace line"):
        Workload.from_jsonl(tmp_path / "bad.jsonl")
