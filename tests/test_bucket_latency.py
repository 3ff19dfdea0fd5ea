"""Bucket costs (`placement/bucket_latency.py`): a bucketed engine charged what each of its buckets measured.

The engine here is a table written in the test — a step's non-attention cost per padded bucket, concave in
the rows as XLA:CPU's small GEMMs are — plus attention lines and host overhead; no latency model of ours
produced its step times. The fit must recover it, the planner's provider must then charge it at shapes it
never saw, and the Appendix form fitted on the same samples must not be able to.
"""

from __future__ import annotations

import itertools
import math

import pytest

from models.config import get_config
from placement.bucket_latency import BucketCosts
from placement.hardware import get_device
from placement.latency import LatencyProvider, Profile, ProfileError, StepOverhead
from placement.padding import EnginePadding
from placement.profile_fit import DecodeSample, PrefillSample, profile_entry
from placement.step_time import decode_step_s, mixed_step_s, prefill_step_s

CFG = get_config("opt-mini")
PAD = EnginePadding(attention_exact=True)  # the CPU kernel's padding: attention reads the filled positions only
# a whole step's GEMMs + LM head + kernel constant per bucket, seconds (shaped like opt-mini on one core)
PREFILL_COST = {16: 8e-3, 32: 9e-3, 64: 11e-3, 128: 17e-3, 256: 30e-3, 512: 55e-3, 1024: 120e-3}
DECODE_COST = {2: 4.2e-3, 4: 5.6e-3, 8: 6.5e-3, 16: 8.0e-3, 32: 10.1e-3, 64: 10.5e-3}
C2, C5 = 3.0e-10, 6.0e-10
HOST = StepOverhead(fixed_s=1.0e-3, per_ctx_token_s=2.0e-7, prefill_s=0.5e-3)
WIDTH = CFG.num_layers * 3 * CFG.hidden_size  # L·3h at tp 1


def _bucket(n: int, minimum: int) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


def _prefill_truth(lengths: tuple[int, ...]) -> float:
    rows = _bucket(len(lengths), 1)
    per = _bucket(math.ceil(math.sqrt(sum(n * n for n in lengths) / len(lengths))), 16)
    kernel = PREFILL_COST[rows * per] + C2 * WIDTH * rows * per * per / 16
    return kernel + HOST.step_s(float(sum(lengths)), 1, True)


def _decode_truth(batch: int, ctx_sum: int) -> float:
    return DECODE_COST[_bucket(batch, 2)] + C5 * WIDTH * ctx_sum + HOST.step_s(float(ctx_sum), 1, False)


GRID_PREFILL = [(b, n) for b in (1, 2, 4) for n in (16, 32, 64, 128, 256, 512) if b * n <= 1024] + [(7, 16), (1, 24)]
GRID_DECODE = [(b, c) for b in (1, 2, 3, 4, 8, 12, 16, 32, 64) for c in (16, 64, 160, 320)]


def _profile() -> tuple[dict, Profile]:  # type: ignore[type-arg]
    pre = [PrefillSample((n,) * b, _prefill_truth((n,) * b)) for b, n in GRID_PREFILL]
    dec = [DecodeSample(b, b * c, _decode_truth(b, b * c)) for b, c in GRID_DECODE]
    entry = profile_entry(CFG, 1, "disagg", pre, dec, padding=PAD)
    return entry, Profile.from_dict({"name": "buckets", "entries": [entry]})


def test_the_fit_recovers_the_buckets_and_the_planner_charges_them_off_the_grid() -> None:
    entry, profile = _profile()
    costs = entry["bucket_costs"]
    # A per-step constant cannot be told from a bucket's, nor (the kernel attention reads exactly the context)
    # a cost per context token from C5: the fit may split those as it likes; what a bucket costs more than the
    # next smaller one, and every prediction, it must get right.
    decode = [s for _, s in costs["decode"]]
    truth = [DECODE_COST[n] for n, _ in costs["decode"]]
    assert [n for n, _ in costs["decode"]] == sorted(DECODE_COST)
    steps = [b - a for a, b in itertools.pairwise(decode)]
    assert steps == pytest.approx([b - a for a, b in itertools.pairwise(truth)])
    assert costs["C2"] == pytest.approx(C2, rel=1e-6)
    # The host's cost per context token is the Appendix fit's (the bucket fit keeps its step overhead); that
    # misspecified fit gets it a little wrong, and within a prefill bucket the actual tokens vary: 1e-4.
    assert entry["fit"]["decode"]["max_rel_error"] < 1e-9 and entry["fit"]["prefill"]["max_rel_error"] < 1e-3
    # the Appendix form on the same samples: a line in the rows cannot follow a concave cost
    assert entry["fit_appendix"]["decode"]["mean_rel_error"] > 0.05

    provider = LatencyProvider(CFG, get_device("cpu"), profile)
    model, overhead = provider.instance("disagg", 1, 1), provider.step_overhead("disagg", 1)
    for lengths in [(48,), (100,), (30, 20, 17), (150, 150, 150), (50,) * 5, (200, 9)]:
        assert prefill_step_s(model, overhead, lengths) == pytest.approx(_prefill_truth(lengths), rel=1e-3), lengths
    for batch, ctx in [(3, 40), (6, 100), (12, 30), (24, 100), (10, 300), (5, 600), (40, 50), (48, 64)]:
        got = decode_step_s(model, overhead, batch, float(batch * ctx))
        assert got == pytest.approx(_decode_truth(batch, batch * ctx), rel=1e-9), (batch, ctx)


def test_a_mixed_step_is_its_prompt_bucket_plus_its_decode_bucket() -> None:
    """The engine runs a colocated step as two sub-batches; the model charges each its own bucket. (How a
    step's constant splits between host and buckets is not in the pure steps a profile times, so this is
    the rule on hand-written costs, not a fit.)"""
    costs = BucketCosts(tuple(PREFILL_COST.items()), tuple(DECODE_COST.items()), C2, C5)
    profile = Profile.from_dict(
        {
            "entries": [
                {
                    "engine": "colocated", "model": "opt-mini", "tp": 1,
                    "C1": 0.0, "C2": 0.0, "C3": 0.0, "C4": 0.0, "C5": 0.0,
                    "step_overhead": [HOST.fixed_s, HOST.per_ctx_token_s, HOST.prefill_s],
                    "engine_padding": {"attention_exact": True},
                    "bucket_costs": costs.to_dict(),
                }
            ]
        }
    )  # fmt: skip
    provider = LatencyProvider(CFG, get_device("cpu"), profile)
    model, overhead = provider.instance("colocated", 1, 1), provider.step_overhead("colocated", 1)
    # a 100-token chunk (128 tokens) with 5 decodes over 1350 context tokens riding along (8 rows)
    kernel = PREFILL_COST[128] + C2 * WIDTH * 128 * 128 / 16 + DECODE_COST[8] + C5 * WIDTH * 1350
    want = kernel + HOST.step_s(1350.0 + 100.0, 1, True)
    assert mixed_step_s(model, overhead, [100], [0], 5, 1350.0) == pytest.approx(want, rel=1e-12)
    assert mixed_step_s(model, overhead, [], [], 5, 1350.0) == pytest.approx(_decode_truth(5, 1350), rel=1e-12)


def test_between_below_and_beyond_the_measured_buckets() -> None:
    costs = BucketCosts(((16, 8.0), (64, 14.0), (128, 20.0)), ((2, 4.0),), 0.0, 0.0)
    assert costs.prefill_s(64) == 14.0
    assert costs.prefill_s(32) == pytest.approx(10.0)  # linear between 16 and 64
    assert costs.prefill_s(4) == 8.0  # below the smallest: the smallest's cost
    assert costs.prefill_s(256) == pytest.approx(32.0)  # beyond: the last segment continued
    assert costs.decode_s(8) == pytest.approx(16.0)  # one point: proportional
    flat = BucketCosts(((16, 8.0), (32, 8.0)), ((2, 4.0), (4, 4.0)), 0.0, 0.0)
    assert flat.prefill_s(1024) == 8.0 and flat.decode_s(64) == 4.0  # never below the largest measured


def test_noisy_buckets_are_made_non_decreasing() -> None:
    """One bucket measured faster than the one below it (a noisy core): the fit pools the two, so no bigger
    bucket is charged less than a smaller one."""
    pre = [PrefillSample((n,) * b, _prefill_truth((n,) * b)) for b, n in GRID_PREFILL]
    dec = [
        DecodeSample(b, b * c, _decode_truth(b, b * c) * (0.8 if b in (3, 4) else 1.0))  # bucket 4 runs fast
        for b, c in GRID_DECODE
    ]
    entry = profile_entry(CFG, 1, "disagg", pre, dec, padding=PAD)
    table = [s for _, s in entry["bucket_costs"]["decode"]]
    assert all(a <= b for a, b in itertools.pairwise(table)), table
    assert table[0] == pytest.approx(table[1])  # buckets 2 and 4 pooled


@pytest.mark.parametrize(
    "bad",
    [
        {"prefill": [], "decode": [[2, 1e-3]], "C2": 0.0, "C5": 0.0},
        {"prefill": [[16, -1.0]], "decode": [[2, 1e-3]], "C2": 0.0, "C5": 0.0},
        {"prefill": [[16, 1e-3], [16, 2e-3]], "decode": [[2, 1e-3]], "C2": 0.0, "C5": 0.0},
        {"prefill": [[16, 1e-3]], "decode": [[2, 1e-3]], "C2": -1.0, "C5": 0.0},
        {"prefill": [[16, 1e-3]], "decode": [[2, 1e-3]]},
    ],
)
def test_a_malformed_bucket_table_is_a_profile_error(bad: dict) -> None:  # type: ignore[type-arg]
    entry, _ = _profile()
    with pytest.raises(ProfileError, match="entry 0"):
        Profile.from_dict({"entries": [{**entry, "bucket_costs": bad}]})
