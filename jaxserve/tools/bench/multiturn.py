"""Closed-loop multi-turn load: each conversation sends its next turn `think_s` after the last answer.

The trace is a `placement.conversations.SharedPrefixWorkload` (conversations over shared system
prompts). First turns leave at their arrival times; turn t+1 of a conversation leaves `think_s`
seconds after turn t's last token, and its prompt is turn t's prompt + the tokens the server
actually generated + the turn's new user tokens (`new_tokens`). Every turn asks for exactly its
trace output length (greedy, ignore EOS), so prompt lengths, and which blocks a prefix cache can
hit, are the trace's whatever the model says: the simulator (`placement/prefix_sim.py`) can be
given the very same trace.

`run_conversations` is transport-agnostic: `send(record, prompt, t0)` runs one request, fills the
record and returns the generated token ids. `grpc_sender` talks to a jaxserve server (and reads
`usage.cached_tokens` and the KV bytes the server moved); `controller_sender` drives an embedded
`Controller` in this process (what `scripts/bench_prefix_cache.py` uses).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from jaxserve.tools.bench.records import RequestRecord
from placement.conversations import SharedPrefixWorkload

Send = Callable[[RequestRecord, list[int], float], Awaitable[list[int]]]


def conversation_records(trace: SharedPrefixWorkload) -> list[RequestRecord]:
    """One record per turn, in trace order; later turns' `scheduled_at` is set when they leave."""
    offset = float(trace.workload.arrival_at[0]) if len(trace) else 0.0
    return [
        RequestRecord(
            i,
            int(trace.workload.input_lens[i]),
            int(trace.workload.output_lens[i]),
            float(trace.workload.arrival_at[i]) - offset if i < trace.num_first else math.nan,
            conversation=int(trace.conversation[i]),
            turn=int(trace.turn[i]),
        )
        for i in range(len(trace))
    ]


async def run_conversations(
    trace: SharedPrefixWorkload, send: Send, progress: Callable[[int, int], None] | None = None
) -> list[RequestRecord]:
    """Replay `trace` closed loop through `send`; returns every turn's record (trace order)."""
    records = conversation_records(trace)
    done = 0
    t0 = time.perf_counter()

    async def conversation(i: int) -> None:
        nonlocal done
        prompt = [int(x) for x in trace.prompts[i]]
        delay = records[i].scheduled_at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        while True:
            rec = records[i]
            rec.sent_at = time.perf_counter() - t0
            output = await send(rec, prompt, t0)
            done += 1
            if progress is not None:
                progress(done, len(records))
            j = int(trace.next_turn[i])
            if j < 0 or not rec.ok:
                return
            await asyncio.sleep(float(trace.think_s[j]))
            prompt = prompt + output + [int(x) for x in trace.new_tokens(j)]
            records[j].scheduled_at = time.perf_counter() - t0
            i = j

    await asyncio.gather(*(conversation(i) for i in range(trace.num_first)))
    return records


def grpc_sender(client: object) -> Send:
    """Turns sent over a jaxserve `AsyncClient` stream."""

    async def send(rec: RequestRecord, prompt: list[int], t0: float) -> list[int]:
        from jaxserve.client import AsyncClient, ClientError

        assert isinstance(client, AsyncClient)
        out: list[int] = []
        try:
            async for chunk in client.stream(
                prompt_ids=prompt, max_tokens=rec.output_len, temperature=0.0, ignore_eos=True
            ):
                at = time.perf_counter() - t0
                out.extend(chunk.token_ids)
                rec.record_chunk(at, len(chunk.token_ids))
                if chunk.finished:
                    rec.record_end(at, chunk.finish_reason, chunk.timings)
                    rec.cached_tokens = chunk.num_cached_tokens
                    if chunk.timings is not None:
                        rec.kv_transfer_bytes = chunk.timings.kv_transfer_bytes
        except ClientError as e:
            rec.error = str(e)
        if math.isnan(rec.finished_at) and rec.error is None:
            rec.error = "stream ended without a final chunk"
        return out

    return send


def controller_sender(controller: object) -> Send:
    """Turns submitted to an embedded `Controller` (same process; its timings are read directly)."""
    from jaxserve.core.request import GenerateRequest, SamplingParams
    from jaxserve.runtime.controller import Controller

    assert isinstance(controller, Controller)

    async def send(rec: RequestRecord, prompt: list[int], t0: float) -> list[int]:
        sampling = SamplingParams(max_tokens=rec.output_len, ignore_eos=True)
        out: list[int] = []
        try:
            async for chunk in controller.submit(
                GenerateRequest(f"turn-{rec.index}", tuple(prompt), sampling)
            ).async_chunks():
                at = time.perf_counter() - t0
                out.extend(chunk.token_ids)
                rec.record_chunk(at, len(chunk.token_ids))
                if chunk.finished:
                    rec.record_end(at, chunk.finish_reason, chunk.timings)
                    if chunk.timings is not None:
                        rec.cached_tokens = chunk.timings.cached_prompt_tokens
                        rec.kv_transfer_bytes = chunk.timings.kv_transfer_bytes
        except Exception as e:  # a failed request is a record with an error, not a crashed run
            rec.error = f"{type(e).__name__}: {e}"
        return out

    return send
