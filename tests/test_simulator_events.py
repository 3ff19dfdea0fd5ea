"""The simulator's coalesced events give, to the bit, the timeline of one event per decode round and one
policy call per colocated step (`Simulator.coalesce`); and the per-batch round function charges what
`decode_step_s` charges."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.core.plan import parse_deployment
from models.config import get_config
from placement.hardware import ClusterSpec, get_device
from placement.latency import LatencyProvider, StepOverhead, load_profile
from placement.padding import EnginePadding, PaddedModel
from placement.simulator import SimOptions, Simulator
from placement.slo import SloSpec
from placement.step_time import decode_round_fn, decode_step_s
from placement.workload import generate

OPT13B = get_config("opt-13b", "float16")
A100 = get_device("a100-80gb")
FOLDED = LatencyProvider(OPT13B, A100, load_profile("a100-80gb-distserve"))  # the artifact's folded form
ROOFLINE = LatencyProvider(OPT13B, A100)  # the appendix form from the device roofline
CLUSTER = ClusterSpec(A100, num_nodes=2, devices_per_node=8)
SLO = SloSpec(ttft_s=0.4, tpot_s=0.06)


class OneEventPerRound(Simulator):
    coalesce = False


def _timeline(r) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.stack(
        [r.prefill_start_at, r.first_token_at, r.transfer_start_at, r.transfer_end_at, r.decode_start_at, r.finish_at]
    )


PLANS = [
    ("disagg:prefill=tp1,decode=tp1", None),
    ("disagg:prefill=2xtp1,decode=tp2", None),
    ("disagg:prefill=tp2,decode=2xtp1pp2", None),
    ("disagg:prefill=tp1,decode=tp1", "decode"),
    ("disagg:prefill=tp1pp2,decode=tp1", "prefill"),
    ("colocated:tp1", None),
    ("colocated:2xtp1", None),
]


@pytest.mark.parametrize("latency", [FOLDED, ROOFLINE], ids=["folded", "appendix"])
@pytest.mark.parametrize(("plan", "mode"), PLANS, ids=[f"{p}-{m or 'joint'}" for p, m in PLANS])
def test_coalesced_events_give_the_same_timeline(latency: LatencyProvider, plan: str, mode: str | None) -> None:
    deployment = parse_deployment(plan)
    options = SimOptions() if mode is None else dataclasses.replace(SimOptions(), mode=mode)
    checked = 0
    for lengths in ("sharegpt", "fixed:512:64"):
        base = generate(lengths, 1.0, 150, np.random.default_rng(7))
        for rate in (1.0, 4.0, 12.0):  # idle, busy, overloaded (long queues, full batches)
            w = base.with_rate(rate)
            for slo in (None, SLO):  # without an SLO every request runs to the end
                fast = Simulator(deployment, latency, CLUSTER, w, slo, options)
                slow = OneEventPerRound(deployment, latency, CLUSTER, w, slo, options)
                a, b = fast.run(), slow.run()
                assert a.verdict == b.verdict
                np.testing.assert_array_equal(_timeline(a), _timeline(b))
                assert a.num_events <= b.num_events
                checked += 1
    assert checked == 12
    # And the work it saves is real where batches run: a full run coalesces many rounds.
    w = generate("fixed:512:64", 4.0, 150, np.random.default_rng(7))
    fast = Simulator(deployment, latency, CLUSTER, w, None, options).run()
    slow = OneEventPerRound(deployment, latency, CLUSTER, w, None, options).run()
    if mode != "prefill":
        assert fast.num_events < 0.75 * slow.num_events


def test_chunked_colocated_is_unchanged() -> None:
    plan = parse_deployment("colocated:tp1,chunk=256")
    w = generate("sharegpt", 6.0, 150, np.random.default_rng(3))
    a = Simulator(plan, FOLDED, CLUSTER, w, SLO).run()
    b = OneEventPerRound(plan, FOLDED, CLUSTER, w, SLO).run()
    assert a.verdict == b.verdict
    np.testing.assert_array_equal(_timeline(a), _timeline(b))


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_round_function_charges_decode_step_s(pp: int) -> None:
    overhead = StepOverhead(fixed_s=1e-3, per_ctx_token_s=2e-7, prefill_s=5e-3)
    models = [FOLDED.instance("disagg", 1, pp), ROOFLINE.instance("disagg", 2, pp)]
    models.append(PaddedModel(models[1], EnginePadding()))  # no per-batch form: the generic fallback
    for model in models:
        for batch in (0, 1, 2, 5, 8, 33):
            fn = decode_round_fn(model, overhead, batch)
            for ctx in (0, 1, 517, 12_345, 250_001):
                assert fn(ctx) == decode_step_s(model, overhead, batch, ctx)  # the same arithmetic: equal floats


def test_prefix_cache_simulator_is_unchanged_by_coalescing() -> None:
    """The prefix-cache simulator keeps its own decode rounds (local prefills ride in them) but its colocated
    instances coalesce steady steps too: with caching on, turns arriving as events, the same timeline."""
    from jaxserve.core.scheduling import PrefixPolicy
    from placement.conversations import ConversationSpec, generate_conversations
    from placement.prefix_sim import PrefixSimulator

    class PerStep(PrefixSimulator):
        coalesce = False

    shared = generate_conversations(ConversationSpec(), 30, np.random.default_rng(0)).at_rate(3.0)
    for spec in ("colocated:tp1", "colocated:2xtp1,chunk=256", "disagg:prefill=tp1,decode=tp1"):
        plan = parse_deployment(spec).assign_devices(8)
        a = PrefixSimulator(plan, FOLDED, CLUSTER, shared, policy=PrefixPolicy()).run()
        b = PerStep(plan, FOLDED, CLUSTER, shared, policy=PrefixPolicy()).run()
        assert a.num_finished == len(shared.workload)
        np.testing.assert_array_equal(_timeline(a), _timeline(b))
