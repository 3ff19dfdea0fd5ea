"""Goodput: the highest arrival rate at which a deployment still meets its SLO attainment target.

`max_rate` starts from half of a throughput bound of the deployment (`GoodputSearch.throughput_bound`,
never exceeded), halves until a rate passes, and then bisects (geometrically) until the bracket is
within `rel_tol`. Every probe simulates the *same* requests (one base workload drawn
at rate 1 from the caller's seed and time-scaled with `Workload.with_rate`), so attainment is a
deterministic function of the rate and the search is reproducible. Each probe stops as soon as its
verdict is certain (see `placement/slo.py`). Per-device goodput divides by the deployment's devices.
`slo_scale` finds the tightest multiple of both SLOs that a deployment still meets at a given rate
(the paper's "SLO scale" axis).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxserve.core.plan import DeploymentPlan
from placement.hardware import ClusterSpec
from placement.latency import DeploymentKind, LatencyProvider, StageLatency, StepOverhead, kv_capacity_tokens
from placement.simulator import SimOptions, simulate
from placement.slo import SloSpec
from placement.step_time import decode_step_s, mixed_step_s, prefill_step_s
from placement.workload import Workload, generate, get_length_distribution

MIN_RATE = 1e-3  # rps; below this a deployment is reported as having no goodput


def base_workload(lengths: str, num_requests: int, seed: int, cv: float = 1.0, max_positions: int = 2048) -> Workload:
    """The requests every probe replays: lengths from `lengths`, arrivals drawn at rate 1."""
    rng = np.random.default_rng(seed)
    return generate(get_length_distribution(lengths, max_positions), 1.0, num_requests, rng, cv)


@dataclasses.dataclass(frozen=True)
class GoodputSearch:
    """Everything a goodput probe needs except the rate (picklable: it crosses process boundaries)."""

    plan: DeploymentPlan
    latency: LatencyProvider
    cluster: ClusterSpec
    workload: Workload
    slo: SloSpec
    options: SimOptions = dataclasses.field(default_factory=SimOptions)

    def meets(self, rate: float) -> bool:
        """Whether the deployment meets the attainment target at `rate`."""
        result = simulate(self.plan, self.latency, self.cluster, self.workload.with_rate(rate), self.slo, self.options)
        assert result.verdict is not None
        return result.verdict

    def zero_load_attainment(self) -> float:
        """Attainment if every request ran alone on an idle deployment (an upper bound on any rate's).

        Each prompt is prefilled alone on the fastest prefill-capable instance and each request decodes
        alone (batch 1) on the fastest decode-capable one, each step charged as the simulator charges it
        (`placement/step_time.py`: the kernels and the profile's step overhead); transfers and queues are
        taken as free.
        """
        from placement.slo import attainment

        w, opts = self.workload, self.options
        engine: DeploymentKind = "colocated" if self.plan.kind == "colocated" else "disagg"
        ttft = np.full(len(w), np.inf)
        tpot = np.full(len(w), np.inf)
        for inst in self.plan.instances:
            model = self.latency.instance(engine, inst.tp, inst.pp, quantization=inst.quantization)
            overhead = self.latency.step_overhead(engine, inst.tp, inst.quantization)
            if inst.role == "prefill":
                ttft = np.minimum(ttft, [prefill_step_s(model, overhead, [int(n)]) for n in w.input_lens])
            elif inst.role == "colocated":  # a prompt step of the whole prompt, no decodes riding along
                ttft = np.minimum(ttft, [mixed_step_s(model, overhead, [int(n)], [0], 0, 0.0) for n in w.input_lens])
            if inst.role in ("decode", "colocated"):
                ctx = w.input_lens + w.output_lens / 2
                tpot = np.minimum(tpot, [decode_step_s(model, overhead, 1, float(c)) for c in ctx])
        if opts.mode == "decode" or not np.isfinite(ttft).any():
            ttft = np.zeros(len(w))
        if opts.mode == "prefill" or not np.isfinite(tpot).any():
            tpot = np.zeros(len(w))
        tpot = np.where(w.output_lens > 1, tpot, 0.0)
        return attainment(ttft, tpot, self.slo)

    def throughput_bound(self) -> float:
        """An upper bound on the request rate the deployment can sustain at all, from the latency model.

        Prefill: back-to-back batches of mean-length prompts (about L_m tokens each, or as many as the
        engine's token cap takes, whichever is cheaper per prompt) through the first stage, which also
        does the step's host work (the profile's step overhead). Decode: the best tokens per second over
        batch sizes that memory and `max_decode_batch` allow, each round charged with its step overhead.
        Colocated: each request costs its prompt step's share plus its share of decode rounds at that
        batch. Every step is charged what the simulator charges it (`placement/step_time.py`). A finite
        trace can pass at any rate once the rate is high enough that it arrives as one burst, so
        `max_rate` never searches above this bound.
        """
        w, opts, cluster, cfg = self.workload, self.options, self.cluster, self.latency.cfg
        mean_in = float(w.input_lens.mean())
        mean_out = max(float(w.output_lens.mean()), 1.0)
        engine: DeploymentKind = "colocated" if self.plan.kind == "colocated" else "disagg"
        prefill_rate = decode_rate = coloc_rate = 0.0
        for inst in self.plan.instances:
            model = self.latency.instance(engine, inst.tp, inst.pp, quantization=inst.quantization)
            overhead = self.latency.step_overhead(engine, inst.tp, inst.quantization)
            budget = max(1, round(self.latency.prefill_token_budget(engine, inst.tp) / mean_in))
            cap = opts.token_cap(self.latency.profile_token_cap(engine, inst.tp))
            capped = max(1, int(cap // mean_in))  # the simulator's token cap per prefill step
            prefill_s = min(prefill_stage0_s(model, overhead, b, mean_in) for b in (budget, capped))
            blocks = (
                kv_capacity_tokens(cfg, cluster.device, inst.tp, inst.pp, inst.quantization) / opts.limits.block_size
            )
            per_request_blocks = math.ceil((mean_in + mean_out) / opts.limits.block_size)
            decode_cap = opts.decode_batch_cap(self.latency.profile_decode_batch(engine))
            max_batch = max(1, min(decode_cap, int(blocks // per_request_blocks)))
            # Best decode throughput over batch sizes (a larger batch is not always faster per token).
            sizes = (
                {int(b) for b in np.geomspace(1, max_batch, 24)} | {max_batch} | {b for b in (94, 95) if b <= max_batch}
            )
            decode_s = min(
                decode_step_s(model, overhead, b, b * (mean_in + mean_out / 2)) * max(mean_out - 1, 1) / b
                for b in sizes
            )
            if inst.role == "prefill":
                prefill_rate += 1 / prefill_s
            elif inst.role == "decode":
                decode_rate += 1 / decode_s
            else:  # a colocated prompt step holds the whole pipe
                coloc_rate += 1 / (
                    min(coloc_prompt_s(model, overhead, b, mean_in) for b in (budget, capped)) + decode_s
                )
        if self.plan.kind == "colocated":
            return coloc_rate
        if opts.mode == "prefill":
            return prefill_rate
        if opts.mode == "decode":
            return decode_rate
        return min(prefill_rate, decode_rate)


def prefill_stage0_s(model: StageLatency, overhead: StepOverhead, batch: int, length: float) -> float:
    """Per prompt, how long a prefill batch of `batch` prompts of `length` tokens holds the first stage:
    its kernels there and the step's host work (what the simulator's prefill pipe charges stage 0)."""
    t = batch * length
    return (model.prefill_stage_s(t, batch * length**2, batch) + overhead.step_s(t, model.pp, True)) / batch


def coloc_prompt_s(model: StageLatency, overhead: StepOverhead, batch: int, length: float) -> float:
    """Per prompt, a colocated prompt step of `batch` prompts of `length` tokens (no decodes riding along)."""
    n = max(1, round(length))
    return mixed_step_s(model, overhead, [n] * batch, [0] * batch, 0, 0.0) / batch


def max_rate(search: GoodputSearch, rel_tol: float = 0.02, max_probes: int = 40, hint: float | None = None) -> float:
    """The largest rate (within `rel_tol`) meeting the target; 0.0 when even MIN_RATE fails.

    `hint`, a rate the answer is expected near (the same deployment's goodput on another sample of the
    workload), starts the search there: it steps by 1 + 2·rel_tol until the target flips, then bisects
    once, so an answer within 2·rel_tol of the hint takes three probes (four within 4·rel_tol) instead of
    seven. Without it the bracket starts at half the throughput bound.
    """
    bound = search.throughput_bound()
    if bound < MIN_RATE or search.zero_load_attainment() < search.slo.attainment:
        return 0.0
    floor = max(MIN_RATE, bound / 256)  # below 0.4 % of its capacity a deployment is not worth reporting
    probes = 1
    if hint is not None and floor <= hint < bound:
        step = 1 + 2 * rel_tol
        if search.meets(hint):
            lo, hi = hint, min(hint * step, bound)
            while True:
                probes += 1
                if not search.meets(hi):
                    break
                if hi >= bound:
                    return bound
                lo, hi = hi, min(hi * step, bound)
                if probes >= max_probes:
                    return lo
        else:
            lo, hi = hint / step, hint
            while True:
                probes += 1
                if lo < floor or probes >= max_probes:
                    return 0.0
                if search.meets(lo):
                    break
                hi, lo = lo, lo / step
    else:
        guess = bound / 2
        if search.meets(guess):
            lo, hi = guess, bound
            if search.meets(bound):
                return bound
            probes += 1
        else:
            lo, hi = guess / 2, guess
            while not search.meets(lo):
                hi, lo = lo, lo / 2
                probes += 1
                if lo < floor or probes >= max_probes:
                    return 0.0
    while hi - lo > rel_tol * lo and probes < max_probes:
        mid = math.sqrt(lo * hi)
        if search.meets(mid):
            lo = mid
        else:
            hi = mid
        probes += 1
    return lo


def goodput(search: GoodputSearch, rel_tol: float = 0.02) -> tuple[float, float]:
    """(goodput in rps, goodput per device)."""
    rate = max_rate(search, rel_tol)
    return rate, rate / search.plan.num_devices


def slo_scale(search: GoodputSearch, rate: float, lo: float = 0.05, hi: float = 20.0, rel_tol: float = 0.02) -> float:
    """The smallest factor s (within rel_tol) such that SLOs × s are met at `rate`; inf if not even at `hi`."""

    def ok(scale: float) -> bool:
        return dataclasses.replace(search, slo=search.slo.scaled(scale)).meets(rate)

    if not ok(hi):
        return math.inf
    if ok(lo):
        return lo
    while hi - lo > rel_tol * lo:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
