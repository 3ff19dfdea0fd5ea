"""Drive DistServe's public simulator (`simdistserve` in LLMServe/DistServe) on cases that
`scripts/compare_simdistserve.py` writes, and find each case's highest rate that meets its SLO.

Runs *outside* jaxserve's venv: the public simulator needs simpy and pandas, which jaxserve does not
depend on. `compare_simdistserve.py` starts it with another interpreter:

    python3 -m venv /tmp/simds-venv && /tmp/simds-venv/bin/pip install simpy numpy pandas tqdm
    /tmp/simds-venv/bin/python scripts/simdistserve_driver.py CHECKOUT cases.json out.json

where CHECKOUT is the directory that holds the `simdistserve` package (a `git archive` of the repository).
Nothing of jaxserve is imported here, and nothing here imports the public simulator at module level, so
`compare_simdistserve.py` can import `bracket_max_rate` (the one rate search both simulators are run under).

A case (JSON): `backend` "vllm" (one colocated instance) or "distserve" (`n_prefill` prefill and `n_decode`
decode instances), `tp_prefill` / `tp_decode`, `model` (its name, e.g. "opt_13b"), `requests`
`[[prompt_len, decode_steps], ...]`, `arrival_s` (absolute arrival times at rate 1, sorted), `ttft_s`,
`tpot_s` (P90 bounds, each metric at 90 %, its `p90` mode), `prefill_cap` (an engine's token cap of a
prefill step), `decode_batch` (the decode batch cap), `hint` (a rate to start the search at).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Callable

REL_TOL = 0.005  # the search stops when a passing and a failing rate are within 0.5 %
STEP = 1.06  # the bracket grows or shrinks by 6 % a probe


def bracket_max_rate(meets: Callable[[float], bool], hint: float, rel_tol: float = REL_TOL) -> float:
    """The highest rate that `meets` (a passing rate with a failing one within `rel_tol` above), searched
    from `hint`: step by `STEP`, a step squared after each probe that does not flip the verdict, then bisect
    geometrically. 0.0: nothing from 1e-3 rps up passes."""
    step = STEP
    if meets(hint):
        lo, hi = hint, hint * step
        while meets(hi):
            step *= step
            lo, hi = hi, hi * step
    else:
        lo, hi = hint / step, hint
        while not meets(lo):
            if lo <= 1e-3:
                return 0.0
            step *= step
            lo, hi = max(lo / step, 1e-3), lo
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def _percentile_ok(values: list[float], bound: float) -> bool:
    return sum(v <= bound for v in values) >= 0.9 * len(values)


def _decode_context_cap(cap: int) -> Callable:
    """`Worker._enter_decodes` as shipped, with its hard-coded 50 000 context tokens per decode round (its "TODO:
    Hack") replaced by `cap`: the one change the driver can make to the public simulator, to measure what that
    constant costs (`decode_context_cap` in a case; absent, the simulator runs as shipped)."""

    def enter_decodes(self, remaining_tok_in_batch: int) -> list:
        budget = cap
        decode_reqs = []
        for _ in range(min(remaining_tok_in_batch, len(self.decode_queue))):
            req = self.decode_queue[0]
            if req.current_context_len + 1 > budget:
                break
            budget -= req.current_context_len + 1
            decode_reqs.append(self.decode_queue.popleft())
        for r in decode_reqs:
            r.do_decode(wid=self.wid)
        return decode_reqs

    return enter_decodes


def _route_prefill_by_tokens() -> None:
    """Send each prompt to the prefill instance with the fewest prompt tokens queued or running (then fewest
    requests, then the first), jaxserve's `choose_prefill_instance`, instead of its fewest requests
    (`Scheduler._find_best_worker_and_queue`): to measure what the routing policies differ by
    (`prefill_routing: "tokens"` in a case; absent, it routes as shipped)."""
    from simdistserve.base.scheduler import Scheduler
    from simdistserve.base.worker import Worker

    enter, leave = Worker._enter_prefill, Worker._exit_prefill

    def enter_prefill(self):  # the tokens of the batch in progress, which the shipped worker does not keep
        batch = enter(self)
        self._tokens_in_progress = sum(r.current_prefill_lens for r in batch)
        return batch

    def exit_prefill(self, items):
        self._tokens_in_progress = 0
        return leave(self, items)

    def schedule_prefill(self, req):
        def load(i: int) -> tuple[int, int, int]:
            worker, queue = self._prefill_heads[i], self._prefill_queues[i]
            tokens = getattr(worker, "_tokens_in_progress", 0) + sum(r.remain_prefill_lens for r in queue)
            return tokens, worker._prefill_ips + len(queue), i

        i = min(range(len(self._prefill_heads)), key=load)
        self._sched_request(req, self._prefill_heads[i], self._prefill_queues[i])

    Worker._enter_prefill, Worker._exit_prefill = enter_prefill, exit_prefill  # type: ignore[method-assign]
    Scheduler.schedule_prefill = schedule_prefill  # type: ignore[method-assign]


def run_case(case: dict, rate: float) -> tuple[list[float], list[float]]:
    """Per-request TTFT and TPOT (seconds) of one run of the public simulator at `rate`."""
    import simpy
    from simdistserve.base.request import Request
    from simdistserve.base.scheduler import put_requests_with_interarrivals
    from simdistserve.base.worker import Worker, WorkerConfig
    from simdistserve.clusters.disagg import DisaggCluster
    from simdistserve.clusters.vllm import VLLMCluster
    from simdistserve.constants import ModelTypes

    if case.get("decode_context_cap") is not None:
        Worker._enter_decodes = _decode_context_cap(case["decode_context_cap"])  # type: ignore[method-assign]
    if case.get("prefill_routing") == "tokens":
        _route_prefill_by_tokens()
    model = ModelTypes.model_str_to_object(case["model"])
    requests = [
        Request(env=None, req_id=i, prefill_length=p, output_lens=o) for i, (p, o) in enumerate(case["requests"])
    ]
    arrivals_ms = [t / rate * 1000.0 for t in case["arrival_s"]]
    inter_ms = [arrivals_ms[0]] + [b - a for a, b in itertools.pairwise(arrivals_ms)]
    env = simpy.Environment()
    config = WorkerConfig(
        model_type=model,
        TP=case["tp_prefill"],
        TP_Prefill=case["tp_prefill"],
        TP_Decode=case["tp_decode"],
        prefill_max_batch_size=10**7,
        # its only use is the decode back-pressure threshold, in context tokens: off, as in its own runs
        decode_max_batch_size=10**7,
        prefill_max_tokens=case["prefill_cap"],
        # what `_enter_decodes` really reads as the decode batch's request cap
        decode_max_tokens=case["decode_batch"],
        enable_chunked_prefill=False,
        engine_type=case["backend"],
    )
    if case["backend"] == "vllm":
        cluster = VLLMCluster(env=env, N_instance=1, PP=1, worker_configs=config)
    else:
        cluster = DisaggCluster(
            env=env,
            N_prefill_instance=case["n_prefill"],
            N_decode_instance=case["n_decode"],
            PP_prefill=1,
            PP_decode=1,
            worker_configs=config,
        )
    cluster.run()
    put_requests_with_interarrivals(env, cluster.scheduler, inter_ms, requests)
    env.run()
    ttft, tpot = [], []
    for r in requests:
        # its own organize_data.calculate_per_request_latency, without pandas: TTFT from `init` to the first
        # `wait_decode`, TPOT the time from there to `exit_system` over the decode steps
        init = min(t for t, e, _ in r.log if e == "init")
        first = min(t for t, e, _ in r.log if e == "wait_decode")
        done = max(t for t, e, _ in r.log if e == "exit_system")
        ttft.append((first - init) / 1000.0)
        tpot.append((done - first) / 1000.0 / r.output_lens if r.output_lens else 0.0)
    return ttft, tpot


def percentiles(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    """P50 / P90 of TTFT and TPOT (seconds), as numpy's default (linear) percentile computes them."""

    def pct(values: list[float], q: float) -> float:
        s = sorted(values)
        pos = (len(s) - 1) * q / 100
        k = math.floor(pos)
        return s[k] + (s[min(k + 1, len(s) - 1)] - s[k]) * (pos - k)

    return {
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p90_s": pct(tpot, 90),
    }


def max_rate(case: dict) -> tuple[float, int]:
    probes = 0

    def meets(rate: float) -> bool:
        nonlocal probes
        probes += 1
        ttft, tpot = run_case(case, rate)
        return _percentile_ok(ttft, case["ttft_s"]) and _percentile_ok(tpot, case["tpot_s"])

    return bracket_max_rate(meets, case["hint"]), probes


def main(argv: list[str]) -> None:
    checkout, cases_path, out_path = argv
    sys.path.insert(0, checkout)
    with open(cases_path) as f:
        cases = json.load(f)
    out = {}
    for name, case in cases.items():
        rate, probes = max_rate(case)
        # the latency percentiles at the rate found (a finer comparison than the rate: it has no 0.5 % steps)
        stats = percentiles(*run_case(case, rate)) if rate > 0 else {}
        out[name] = {"max_rate": rate, "probes": probes, "at_max_rate": stats}
        print(f"{name}: {rate:.4f} rps ({probes} probes)", flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
