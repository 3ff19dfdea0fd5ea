"""Open-loop load generation: replay a planner `Workload` against a running server.

Each request `i` leaves at `arrival_at[i] − arrival_at[0]` seconds after the start, whether or not
earlier ones have finished (open loop, as in DistServe's and vLLM's benchmarks); `max_concurrency`
optionally caps the requests in flight (a request then waits for a slot, and its clock starts when it
is really sent, as in vLLM). Prompts are random token ids (seeded), and every request asks for
exactly its workload output length: `max_tokens = output_len`, `ignore_eos`, greedy — so the server
does the work the workload describes and the simulator can be given the very same trace.

Two protocols: the jaxserve gRPC `Generate` stream (default; also reports the server's own TTFT/TPOT)
and the OpenAI `/v1/completions` SSE stream (`http=True`; works with any OpenAI-compatible server
that streams, e.g. vLLM).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxserve.tools.bench.records import RequestRecord
from placement.workload import Workload

MIN_TOKEN_ID = 4  # below: OPT's <s>, <pad>, </s>, <unk>


@dataclasses.dataclass(frozen=True)
class Target:
    """Where to send requests."""

    address: str  # HOST:PORT
    http: bool = False
    api_key: str | None = None
    model: str | None = None  # the OpenAI `model` field (HTTP only; None: omitted)
    timeout_s: float | None = None


@dataclasses.dataclass
class BenchRun:
    """One run of one workload against one target."""

    target: str
    deployment: str | None
    rate: float
    records: list[RequestRecord]
    started_at_unix: float


def make_prompts(workload: Workload, vocab_size: int, seed: int) -> list[list[int]]:
    """Random prompt token ids of the workload's input lengths (the same ids for the same seed)."""
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_TOKEN_ID}")
    rng = np.random.default_rng(seed)
    return [rng.integers(MIN_TOKEN_ID, vocab_size, size=int(n)).tolist() for n in workload.input_lens]


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What the bench learns from a jaxserve gRPC server (all None over HTTP)."""

    vocab_size: int | None = None
    max_positions: int | None = None
    deployment: str | None = None
    num_devices: int | None = None


async def probe_server(target: Target) -> ServerInfo:
    """The model's vocabulary and positions and the deployment, from a gRPC server."""
    if target.http:
        return ServerInfo()
    from jaxserve.client import AsyncClient

    async with AsyncClient(target.address, api_key=target.api_key, timeout_s=30.0) as client:
        info = await client.model_info()
        spec: str | None = None
        devices: int | None = None
        try:
            plan = await client.deployment()
            spec, devices = plan.describe(), plan.num_devices
        except Exception:  # a server without GetDeployment
            pass
    return ServerInfo(int(info.vocab_size), int(info.max_position_embeddings), spec, devices)


def probe(target: Target) -> ServerInfo:
    return asyncio.run(probe_server(target))


async def _send_grpc(client: object, rec: RequestRecord, prompt: list[int], t0: float) -> None:
    from jaxserve.client import AsyncClient, ClientError

    assert isinstance(client, AsyncClient)
    try:
        async for chunk in client.stream(
            prompt_ids=prompt, max_tokens=rec.output_len, temperature=0.0, ignore_eos=True
        ):
            at = time.perf_counter() - t0
            rec.record_chunk(at, len(chunk.token_ids))
            if chunk.finished:
                rec.record_end(at, chunk.finish_reason, chunk.timings)
    except ClientError as e:
        rec.error = str(e)
    if math.isnan(rec.finished_at) and rec.error is None:
        rec.error = "stream ended without a final chunk"


async def _send_http(client: object, target: Target, rec: RequestRecord, prompt: list[int], t0: float) -> None:
    import httpx

    assert isinstance(client, httpx.AsyncClient)
    body: dict[str, object] = {
        "prompt": prompt,
        "max_tokens": rec.output_len,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    if target.model:
        body["model"] = target.model
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.finished_at = time.perf_counter() - t0
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.error = str(event["error"].get("message", event["error"]))
                    return
                for choice in event.get("choices") or []:
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                    rec.record_chunk(time.perf_counter() - t0, n)
                    if choice.get("finish_reason") == "abort":
                        rec.error = "aborted by the server"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    if math.isnan(rec.finished_at) and rec.error is None:
        rec.error = "stream ended without [DONE]"


async def run_workload(
    workload: Workload,
    target: Target,
    *,
    vocab_size: int,
    seed: int = 0,
    max_concurrency: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    deployment: str | None = None,
) -> BenchRun:
    """Send every request of `workload` at its arrival time; return when all have finished."""
    prompts = make_prompts(workload, vocab_size, seed)
    offsets = workload.arrival_at - (workload.arrival_at[0] if len(workload) else 0.0)
    records = [
        RequestRecord(i, int(workload.input_lens[i]), int(workload.output_lens[i]), float(offsets[i]))
        for i in range(len(workload))
    ]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done = 0

    if target.http:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        client: object = httpx.AsyncClient(base_url=f"http://{target.address}", timeout=target.timeout_s, limits=limits)
    else:
        from jaxserve.client import AsyncClient

        client = AsyncClient(target.address, api_key=target.api_key, timeout_s=target.timeout_s)

    async def one(rec: RequestRecord) -> None:
        nonlocal done
        if gate is not None:
            await gate.acquire()
        try:
            rec.sent_at = time.perf_counter() - t0
            if target.http:
                await _send_http(client, target, rec, prompts[rec.index], t0)
            else:
                await _send_grpc(client, rec, prompts[rec.index], t0)
        finally:
            if gate is not None:
                gate.release()
            done += 1
            if progress is not None:
                progress(done, len(records))

    started_unix = time.time()
    t0 = time.perf_counter()
    tasks = []
    try:
        for rec in records:
            delay = rec.scheduled_at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(rec)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if target.http:
            await client.aclose()  # type: ignore[attr-defined]
        else:
            await client.close()  # type: ignore[attr-defined]
    return BenchRun(target.address, deployment, workload.rate, records, started_unix)


def run(
    workload: Workload,
    target: Target,
    *,
    info: ServerInfo | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    max_concurrency: int | None = None,
    show_progress: bool = False,
    label: str = "",
) -> BenchRun:
    """Blocking wrapper: probe the server (unless `info` is given) and run the workload."""

    async def main() -> BenchRun:
        known = info if info is not None else await probe_server(target)
        bar = _progress_bar(len(workload), label or target.address) if show_progress else None
        try:
            return await run_workload(
                workload,
                target,
                vocab_size=vocab_size or known.vocab_size or 512,
                seed=seed,
                max_concurrency=max_concurrency,
                progress=bar,
                deployment=known.deployment,
            )
        finally:
            if bar is not None:
                bar.close()

    return asyncio.run(main())


class _Bar:
    def __init__(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, disable=None)

    def __call__(self, done: int, total: int) -> None:
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _progress_bar(total: int, desc: str) -> _Bar:
    return _Bar(total, desc)


def workload_from_records(records: Sequence[RequestRecord], rate: float) -> Workload:
    """The trace the server actually saw: arrivals at the real send times, the requested lengths.

    This is what the simulator is given to compare against the measurement (send times, not the
    scheduled ones, so client lag is not counted against the server).
    """
    order = sorted(records, key=lambda r: (r.sent_at, r.index))
    return Workload(
        np.array([r.sent_at for r in order], dtype=np.float64),
        np.array([r.input_len for r in order], dtype=np.int64),
        np.array([r.output_len for r in order], dtype=np.int64),
        rate,
    )
