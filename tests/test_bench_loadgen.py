"""The bench against scripted servers on loopback whose token times are known by construction.

A real `grpc.aio` server (the jaxserve service schema) and a raw HTTP/SSE server stream each request's
tokens on a schedule computed from the request itself: the first token `FIRST_S + PER_PROMPT_TOKEN_S
× prompt length` after the call arrives, then one chunk every `GAP_S`, the third chunk carrying two
tokens. Each server also writes down, on the wall clock, when each call reached it and when it handed
each chunk to the transport. The bench's TTFT/TPOT/ITL/E2E must come out as that timeline says — a
chunk can only arrive after it was handed over, and at most loopback slack later — its token counts
exactly, and its SLO attainment must count exactly the requests its own numbers put inside the SLO.
Checking against what the server did rather than against the nominal script keeps the check exact
when the machine runs the script late (a busy CI core woke one scripted sleep 30 ms late).

What gates CI is causal and exact: no chunk before its hand-over, no request before its schedule, exact token
counts and SLO accounting. How *little* later a chunk arrives (the loopback slack, `SLACK_S`) is the machine's
hour — a CI run saw a loopback TTFT over it — so that bound is the `timing` variant, run by hand
(`pytest -m timing tests/test_bench_loadgen.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import math
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.tools.bench import loadgen
from jaxserve.tools.bench.records import RequestRecord, attainment, summarize, tightest_slo_scale
from jaxserve.tools.bench.sweep import sweep_rates
from placement.slo import SloSpec
from placement.workload import Workload

FIRST_S = 0.08
PER_PROMPT_TOKEN_S = 0.002
GAP_S = 0.03
SLACK_S = 0.025  # loopback + event-loop scheduling on a busy 2-core machine (`timing` variant only)
CAUSAL = math.inf  # the gated variant: arrivals after hand-overs, at any lateness
SLACKS = [pytest.param(CAUSAL, id="causal"), pytest.param(SLACK_S, id="loopback-slack", marks=pytest.mark.timing)]


def chunks_for(max_tokens: int) -> list[int]:
    """Tokens per chunk: all single tokens except the third chunk, which carries two."""
    sizes: list[int] = []
    left = max_tokens
    while left:
        n = 2 if len(sizes) == 2 and left >= 2 else 1
        sizes.append(n)
        left -= n
    return sizes


def scripted_ttft(input_len: int) -> float:
    """The TTFT the script writes for a prompt (a busy machine only adds to it)."""
    return FIRST_S + PER_PROMPT_TOKEN_S * input_len


CLOCK_EPS_S = 0.002  # the bench's start on the wall clock against its perf_counter origin, and clock slew


@dataclasses.dataclass
class Served:
    """What a scripted server did with one call, on the wall clock (`time.time()`)."""

    arrived: float
    handed_over: list[float] = dataclasses.field(default_factory=list)  # one per chunk, before it is sent


# Per request shape (input length, max tokens); the workload's shapes are distinct.
Timeline = dict[tuple[int, int], Served]


class ScriptedServicer(pb_grpc.JaxServeServicer):
    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.timeline: Timeline = {}

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        served = Served(time.time())
        self.requests.append(request)
        self.timeline[len(request.prompt_token_ids), int(request.max_tokens)] = served
        sizes = chunks_for(int(request.max_tokens))
        await asyncio.sleep(scripted_ttft(len(request.prompt_token_ids)))
        sent = 0
        for k, n in enumerate(sizes):
            if k:
                await asyncio.sleep(GAP_S)
            last = k == len(sizes) - 1
            served.handed_over.append(time.time())
            yield pb.GenerateResponse(
                request_id="r",
                token_ids=list(range(sent + 10, sent + 10 + n)),
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=sent + n)
                if last
                else None,
            )
            sent += n

    async def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ModelInfo(name="scripted", vocab_size=100, max_position_embeddings=256)

    async def GetDeployment(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no deployment here")


async def _sse_handler(timeline: Timeline, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    served = Served(time.time())
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    body = json.loads(await reader.readexactly(length))
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0.0
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    await writer.drain()
    timeline[len(body["prompt"]), int(body["max_tokens"])] = served
    await asyncio.sleep(scripted_ttft(len(body["prompt"])))
    sizes = chunks_for(body["max_tokens"])
    for k, n in enumerate(sizes):
        if k:
            await asyncio.sleep(GAP_S)
        choice = {"index": 0, "text": "x" * n, "token_ids": list(range(n)), "finish_reason": None}
        if k == len(sizes) - 1:
            choice["finish_reason"] = "length"
        served.handed_over.append(time.time())
        writer.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        await writer.drain()
    writer.write(b"data: [DONE]\n\n")
    await writer.drain()
    writer.close()


def _workload() -> Workload:
    # Open loop: each request takes ≥ 0.2 s, yet they leave 0.04 s apart.
    return Workload(
        arrival_at=np.array([1.0, 1.04, 1.08, 1.12, 1.16, 1.20]),
        input_lens=np.array([10, 40, 10, 60, 25, 5]),
        output_lens=np.array([6, 4, 1, 5, 8, 3]),
        rate=25.0,
    )


async def _grpc_run(max_concurrency: int | None) -> tuple[loadgen.BenchRun, ScriptedServicer]:
    servicer = ScriptedServicer()
    server = grpc.aio.server()
    pb_grpc.add_JaxServeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        target = loadgen.Target(f"127.0.0.1:{port}")
        info = await loadgen.probe_server(target)
        assert info.vocab_size == 100 and info.max_positions == 256 and info.deployment is None
        run = await loadgen.run_workload(
            _workload(), target, vocab_size=info.vocab_size or 0, seed=3, max_concurrency=max_concurrency
        )
    finally:
        await server.stop(None)
    return run, servicer


async def _http_run() -> tuple[loadgen.BenchRun, Timeline]:
    timeline: Timeline = {}
    server = await asyncio.start_server(functools.partial(_sse_handler, timeline), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        run = await loadgen.run_workload(
            _workload(), loadgen.Target(f"127.0.0.1:{port}", http=True), vocab_size=100, seed=3
        )
        return run, timeline
    finally:
        server.close()
        await server.wait_closed()


@contextlib.contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """No cyclic-GC pass during a timed run: in a long test session one can stall the loop for tens of ms."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _check_against_server(run: loadgen.BenchRun, w: Workload, timeline: Timeline, slack_s: float) -> None:
    """Each record against what its server did: chunks after their hand-over, within `slack_s` of it."""
    assert len(timeline) == len(run.records) == len(w)
    for rec, n_in, n_out in zip(run.records, w.input_lens, w.output_lens, strict=True):
        n_chunks = len(chunks_for(int(n_out)))
        served = timeline[int(n_in), int(n_out)]
        assert rec.ok, rec.error
        assert rec.num_output_tokens == n_out
        assert rec.chunk_tokens == chunks_for(int(n_out))
        assert len(rec.itl_s) == n_chunks - 1 and len(served.handed_over) == n_chunks
        # The script ran no faster than written (sleeps do not wake early).
        assert served.handed_over[0] - served.arrived >= scripted_ttft(int(n_in)) - CLOCK_EPS_S
        assert all(b - a >= GAP_S - CLOCK_EPS_S for a, b in itertools.pairwise(served.handed_over))
        # Bench times on the wall clock: the call left before the server saw it, each chunk arrived after
        # the server handed it over and no later than the slack.
        sent = run.started_at_unix + rec.sent_at
        assert sent <= served.arrived + CLOCK_EPS_S
        for handed, at in zip(served.handed_over, rec.chunk_at, strict=True):
            assert handed - CLOCK_EPS_S <= run.started_at_unix + at <= handed + slack_s
        # So the bench's numbers are the server's, measured from the send.
        first, last = served.handed_over[0] - sent, served.handed_over[-1] - sent
        assert first - CLOCK_EPS_S <= rec.ttft_s <= first + slack_s
        assert last - CLOCK_EPS_S <= rec.e2e_s <= last + slack_s
        for gap, (a, b) in zip(rec.itl_s, itertools.pairwise(served.handed_over), strict=True):
            assert gap == pytest.approx(b - a, abs=slack_s)
        if n_out > 1:
            assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / (n_out - 1))
            tpot = (served.handed_over[-1] - served.handed_over[0]) / (n_out - 1)
            assert rec.tpot_s == pytest.approx(tpot, abs=slack_s)
        else:
            assert rec.tpot_s == 0.0


@pytest.mark.parametrize("slack_s", SLACKS)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bench_numbers_match_scripted_token_times(protocol: str, slack_s: float) -> None:
    w = _workload()
    with _no_gc_pauses():
        if protocol == "grpc":
            run, servicer = asyncio.run(_grpc_run(None))
            timeline = servicer.timeline
        else:
            run, timeline = asyncio.run(_http_run())
    if protocol == "grpc":
        # What the server was asked: the workload's lengths, greedy, ignore_eos, ids in the vocabulary.
        by_len = sorted((len(r.prompt_token_ids), r.max_tokens) for r in servicer.requests)
        assert by_len == sorted(zip(w.input_lens.tolist(), w.output_lens.tolist(), strict=True))
        assert all(r.ignore_eos and r.temperature == 0.0 for r in servicer.requests)
        assert all(4 <= t < 100 for r in servicer.requests for t in r.prompt_token_ids)
    records = run.records
    _check_against_server(run, w, timeline, slack_s)
    # Open loop: requests left on schedule although each takes longer than the gap between them.
    for rec in records:
        assert rec.scheduled_at - CLOCK_EPS_S <= rec.sent_at <= rec.scheduled_at + slack_s
    assert records[1].sent_at < records[0].finished_at

    # SLOs chosen from the script: TTFT <= 0.15 s excludes the prompts of 40 and 60 tokens
    # (0.16 s, 0.20 s); TPOT <= 0.029 s excludes the one with no two-token chunk among >1 tokens
    # (output 3: chunks 1,1,1 → 0.03 s; the others average below 0.03 thanks to the 2-token chunk).
    slo = SloSpec(ttft_s=0.15, tpot_s=0.0295)
    ttft_exp = [scripted_ttft(int(i)) for i in w.input_lens]
    tpot_exp = [0.0 if o == 1 else GAP_S * (len(chunks_for(int(o))) - 1) / (o - 1) for o in w.output_lens.tolist()]
    good = [t <= 0.15 and p <= 0.0295 for t, p in zip(ttft_exp, tpot_exp, strict=True)]
    assert good == [True, False, True, False, True, False]
    # Attainment counts the requests the bench measured inside the SLO — on time, the script's three; a
    # late machine may move one whose margin is under the slack, and the count must follow the records.
    measured = [r.ttft_s <= slo.ttft_s and r.tpot_s <= slo.tpot_s for r in records]
    assert attainment(records, slo) == pytest.approx(sum(measured) / 6)
    # Lateness only adds to a TTFT: the prompts the script puts over the TTFT SLO stay out whatever the machine.
    assert not any(m for m, t in zip(measured, ttft_exp, strict=True) if t > slo.ttft_s)
    summary = summarize(records, slo)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == int(w.output_lens.sum())
    assert summary["request_goodput"] == pytest.approx(sum(measured) / summary["duration_s"])
    first_handed = [
        timeline[r.input_len, r.output_len].handed_over[0] - run.started_at_unix - r.sent_at for r in records
    ]
    assert first_handed[0] >= ttft_exp[0] - CLOCK_EPS_S
    assert summary["ttft_s"]["median"] == pytest.approx(float(np.median([r.ttft_s for r in records])))
    assert float(np.median(first_handed)) - CLOCK_EPS_S <= summary["ttft_s"]["median"]
    assert summary["ttft_s"]["median"] <= float(np.median(first_handed)) + slack_s


@pytest.mark.parametrize("slack_s", SLACKS)
def test_max_concurrency_holds_requests_back(slack_s: float) -> None:
    with _no_gc_pauses():
        run, servicer = asyncio.run(_grpc_run(1))
    recs = sorted(run.records, key=lambda r: r.sent_at)
    for a, b in itertools.pairwise(recs):
        assert b.sent_at >= a.finished_at - 1e-3
    # The clock of a held-back request starts when it is sent, so its TTFT is the server's from then on.
    run.records.sort(key=lambda r: r.index)
    _check_against_server(run, _workload(), servicer.timeline, slack_s)


def test_failed_requests_are_misses() -> None:
    ok = RequestRecord(0, 8, 3, 0.0, sent_at=0.0, chunk_at=[0.1, 0.2, 0.3], chunk_tokens=[1, 1, 1], finished_at=0.3)
    bad = RequestRecord(1, 8, 3, 0.0, sent_at=0.0, error="RESOURCE_EXHAUSTED: overloaded")
    slo = SloSpec(1.0, 1.0)
    assert attainment([ok, bad], slo) == 0.5
    assert math.isnan(bad.ttft_s) and bad.itl_s == []
    assert summarize([ok, bad], slo)["failed"] == 1
    assert RequestRecord.from_dict(json.loads(json.dumps(ok.to_dict()))) == ok


def test_tightest_slo_scale_is_exact() -> None:
    # Per-request scales max(TTFT/1, TPOT/0.1): 0.5, 2.0, 1.0, 3.0 -> 75 % needs 3 requests -> 2.0.
    recs = []
    for i, (ttft, tpot) in enumerate([(0.5, 0.02), (0.4, 0.2), (1.0, 0.05), (3.0, 0.01)]):
        recs.append(
            RequestRecord(
                i, 4, 2, 0.0, sent_at=0.0, chunk_at=[ttft, ttft + tpot], chunk_tokens=[1, 1], finished_at=ttft + tpot
            )
        )
    slo = SloSpec(1.0, 0.1, attainment=0.75)
    scale = tightest_slo_scale(recs, slo)
    assert scale == pytest.approx(2.0)
    assert attainment(recs, slo.scaled(scale)) >= 0.75 > attainment(recs, slo.scaled(scale * 0.999))


def test_sweep_rates_brackets_and_bisects() -> None:
    calls: list[float] = []

    def measure(rate: float) -> float:  # a server whose attainment falls off past 3.3 rps
        calls.append(rate)
        return 1.0 if rate <= 3.3 else 0.5

    result = sweep_rates(measure, 1.0, 0.9, rel_tol=0.05, max_probes=20)
    assert 3.3 / 1.05 <= result.goodput <= 3.3 < result.upper <= result.goodput * 1.05
    assert calls[:3] == [1.0, 2.0, 4.0]
    down = sweep_rates(measure, 10.0, 0.9, rel_tol=0.05, max_probes=20)
    assert [p.rate for p in down.probes][:3] == [10.0, 5.0, 2.5]
    assert down.goodput == pytest.approx(result.goodput, rel=0.06)
    none = sweep_rates(lambda r: 0.0, 1.0, 0.9, max_probes=4)
    assert none.goodput == 0.0 and len(none.probes) == 4
