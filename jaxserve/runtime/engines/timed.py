"""An engine that computes nothing and takes, on every step, exactly the latency model's time for its shape.

`TimedEngine` implements the engine methods the runtime calls (`kv_layout`, `prefill`, `init_pages`, `insert`,
`decode_step`) like `FakeEngine` and `ModelEngine`, but each call sleeps for what its step-cost contract
(`jaxserve.core.step_cost.StepCost`) charges that step's real shape — on a server, the simulator's own step
formulas (`placement.step_time.ModelStepCost`, bound by `jaxserve.tools.timed_engine.timed_engine_factory`):

* `prefill(items)`: the prefill batch of those prompt lengths through the whole pipe; `prefill_async(items)`
  (`async_prefill`) schedules it on per-stage timelines, so with pp > 1 batches overlap in the pipe:
  the next batch enters stage 0 once stage 0 has finished this one (host work and kernels), as in the
  simulator;
* `decode_step(batch)`: a decode round of the batch's rows over their contexts, or, with prompt rows
  (colocated), the mixed step of those chunks with the decodes riding along;
* `decode_steps(batch, n)` (multi-step decoding, `multi_step_decode`): the sum of the decode rounds the
  rows run — step k over the rows still going, each one position further — in one sleep;
* `insert(kv, n)`: the KV transfer of `n` tokens of the modelled model at the profile's device link, as the
  simulator charges a pull between two instances on one node — on the decode device, at the join, when the
  pull came through a transfer that does not model the link (`InProcessTransfer`, Ray). The timed connector
  (`kv_connectors/timed.py`, `TimedTransfer`) charges it where the simulator does instead: on the link, from
  the pull's start, overlapping decode steps.

The sleep is a deadline from the call's start, so the Python around the (empty) computation is hidden; a
sleeping device does not compete for the host's cores, as an accelerator would not. A decode / mixed step
that follows one which left rows running starts at that step's end even when the host comes late, by up to
that step's length: the instance had work when the device freed (those rows, or a prompt a colocated
instance runs first), and the modelled host prepares a step while the device runs the one before
(asynchronous dispatch), as the simulator assumes. This host's lateness is not the
modelled system's: on this shared 2-core machine a 50 ms sleep wakes 2 ms late at the median, 9 ms at
P90 and 17 ms at worst under load (load average 11), and a lateness of a tenth of a step, paid every step,
was TPOT's error (docs/simulator-fidelity.md). A prefill batch starts at
its stage 0's last end or its last prompt's arrival (`PrefillItem.arrived_at`), whichever is later, however late
the host calls: with a queue, the late wake-ups between batches otherwise pushed every batch after them. Other
calls (new work, a device idle in between) are backdated by `host_slack_s` at most. Tokens are random
(a seeded hash of the request's seed and token index, never below `MIN_TOKEN`, so never an OPT stop token).
KV arrays hold one element per layer, tp shard and token (tiny), laid out per stage on the instance's real
meshes like the model's, so the runtime's real transfer regroups layers between different pipeline splits.

`serve --engine timed --profile P --model opt-13b` runs the whole real server on it.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.request import finish_reason
from jaxserve.core.step_cost import LinkCost, StepCost
from jaxserve.runtime.engines.contract import (
    Engine,
    EngineCapabilities,
    KVLayout,
    KVPages,
    PrefilledSequence,
    PrefillItem,
    PrefillResult,
    SequenceKV,
    StageKV,
    StagePages,
    StepBatch,
    bucket,
)
from jaxserve.runtime.engines.stage_grid import StageGrid
from models.config import ModelConfig

MIN_TOKEN = 4  # OPT's special tokens are 0..3
NO_LINK_COST = LinkCost()  # a pull that takes no time


def random_token(seed: int, index: int, vocab_size: int) -> int:
    """The timed engine's token number `index` of a request with sampling seed `seed`."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return MIN_TOKEN + int.from_bytes(digest, "little") % (vocab_size - MIN_TOKEN)


class TimedEngine(Engine):
    """Sleeps `cost`'s step time (`link`'s for a pull); `clock`/`sleep` are injectable for hand-computed tests."""

    capabilities = EngineCapabilities(
        prefill=True, decode=True, async_prefill=True, dense_insert=True, multi_step_decode=True
    )

    def __init__(
        self,
        config: ModelConfig,
        devices: Sequence[jax.Device],
        cost: StepCost,
        *,
        tp: int = 1,
        pp: int = 1,
        link: LinkCost = NO_LINK_COST,
        host_slack_s: float = 0.005,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        grid = StageGrid.of(devices, config.num_layers, tp, pp)
        if cost.pp != pp:
            raise ValueError(f"a step cost of pp={cost.pp} for an engine of pp={pp}")
        self._config = config
        self._devices = tuple(devices)
        self.tp, self.pp = tp, pp
        self.cost, self.link = cost, link
        self._clock, self._sleep = clock, sleep
        self.host_slack_s = host_slack_s
        self._device_free_at: float | None = None
        self._last_step_s = 0.0  # the length of the decode / mixed step that ends at `_device_free_at`
        self._rows_left = False  # whether that step left rows running (work waiting when the device freed)
        self._stage_free_at = [-math.inf] * pp  # prefill: when each stage finishes its last batch
        self._grid = grid
        self.meshes, self._stage_layers = grid.meshes, grid.stage_layers
        self.charged_s: list[tuple[str, float]] = []  # (kind, seconds) of every call, for tests

    @property
    def model_config(self) -> ModelConfig:
        return self._config

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    def kv_layout(self) -> KVLayout:
        return self._grid.kv_layout()

    def _wait(self, kind: str, started: float, seconds: float, continues: bool = False) -> None:
        """Sleep until the step's end. Back-to-back steps run back to back on the device: a call that comes
        within `host_slack_s` of the previous step's end starts at that end (the host prepared it while the
        device ran the previous step — asynchronous dispatch, as a fast real system has); a step that
        `continues` (the previous one left rows running), within that step's length (the host had the whole
        step to prepare it)."""
        self.charged_s.append((kind, seconds))
        allowance = max(self.host_slack_s, self._last_step_s if continues else 0.0)
        if self._device_free_at is not None and started - self._device_free_at <= allowance:
            started = max(self._device_free_at, started - allowance)
        end = started + seconds
        self._device_free_at = end
        left = end - self._clock()
        if left > 0:
            self._sleep(left)

    def _step(self, kind: str, started: float, seconds: float, rows_left: bool) -> None:
        """`_wait` for a decode / mixed step, which continues the previous one when that left rows running;
        `rows_left`: whether this one does (a prompt chunk, or a row its token does not finish)."""
        self._wait(kind, started, seconds, self._rows_left)
        self._last_step_s, self._rows_left = seconds, rows_left

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillResult:
        return self.prefill_async(items).result()

    def prefill_async(self, items: Sequence[PrefillItem]) -> TimedPrefill:
        """`async_prefill`: schedule the batch on the stages' timelines and return at once.

        Stage 0 runs the step's host work and its kernels, stage s > 0 starts when the batch has crossed the
        send from stage s − 1 and stage s has finished the batch before: alone a batch takes `cost.prefill_s`,
        and the next one enters stage 0 as soon as it frees (the simulator's prefill pipe). A batch starts when
        stage 0 freed or its last prompt arrived, whichever is later (never after the call, and at most the
        batch's own stage-0 time before it); one whose items do not say when they arrived, within `host_slack_s`
        of stage 0's last end, at that end (as `_wait`)."""
        started = self._clock()
        layout = self.kv_layout()
        out = []
        for item in items:
            n = len(item.token_ids)
            kv = tuple(
                StageKV(
                    k=jax.device_put(np.zeros((layers, bucket(n, 16), self.tp, 1), np.float32), sh),
                    v=jax.device_put(np.zeros((layers, bucket(n, 16), self.tp, 1), np.float32), sh),
                )
                for layers, sh in zip(layout.stage_layers, layout.shardings, strict=True)
            )
            first = random_token(item.seed, 0, self._config.vocab_size)
            out.append(PrefilledSequence(item.request_id, first, n, kv))
        lengths = [len(i.token_ids) for i in items]
        self.charged_s.append(("prefill", self.cost.prefill_s(lengths)))
        pipe = self.cost.prefill_pipe(lengths)
        stage, send, host = pipe.stage_s, pipe.send_s, pipe.host_s
        free = self._stage_free_at
        arrivals = [i.arrived_at for i in items]
        if items and None not in arrivals:
            # The batch could have entered stage 0 once its last prompt had arrived and stage 0 was free: the
            # host's wake-up after that (late under load, paid once per request) is not the modelled system's.
            # By at most one stage-0 time: an arrival long past (a request moved off a lost instance keeps its
            # first arrival; one held at admission) is not a wake-up, and must not rewrite the timeline.
            ready = max(free[0], max(a for a in arrivals if a is not None))
            started = max(min(started, ready), started - stage - host)
        elif started - free[0] <= self.host_slack_s:
            started = max(free[0], started - self.host_slack_s)
        t = started
        for s in range(self.pp):
            free[s] = max(t, free[s]) + stage + (host if s == 0 else 0.0)
            t = free[s] + send
        return TimedPrefill(PrefillResult(tuple(out)), free[0], free[-1], self._clock, self._sleep)

    def init_pages(self, num_blocks: int, block_size: int) -> KVPages:
        pages = []
        for s, layers in enumerate(self._stage_layers):
            sharding = self._grid.page_sharding(s)
            shape = (layers, num_blocks, block_size, self.tp, 1)
            zeros = jax.jit(lambda shape=shape: jnp.zeros(shape, jnp.float32), out_shardings=sharding)()
            pages.append(StagePages(k=zeros, v=zeros))
        return tuple(pages)

    def transfer_s(self, num_tokens: int) -> float:
        """The link time of a pull of `num_tokens` positions into this engine (the simulator's charge)."""
        return self.link.transfer_s(num_tokens)

    def insert(self, kv: SequenceKV, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        """A pull whose link time nobody charged yet: it takes the decode device for that time, at the join."""
        self._wait("transfer", self._clock(), self.transfer_s(num_tokens))
        return pages

    def decode_step(self, batch: StepBatch, pages: KVPages) -> tuple[list[int], KVPages]:
        started = self._clock()
        chunks, priors, decode_batch, decode_ctx = [], [], 0, 0
        for row in batch.rows:
            if row.is_prompt:
                chunks.append(len(row.token_ids))
                priors.append(row.start_position)
            else:
                decode_batch += 1
                decode_ctx += row.start_position + 1  # the new token attends over its cache and itself
        tokens = [random_token(row.seed, row.sample_index, self._config.vocab_size) for row in batch.rows]
        seconds = self.cost.mixed_s(chunks, priors, decode_batch, float(decode_ctx))
        eos = self._config.eos_token_ids
        rows_left = any(
            row.is_prompt or finish_reason(row.sampling, token, row.sample_index + 1, eos) is None
            for row, token in zip(batch.rows, tokens, strict=True)
        )
        self._step("mixed" if chunks else "decode", started, seconds, rows_left)
        return tokens, pages

    def decode_steps(self, batch: StepBatch, pages: KVPages, num_steps: int) -> tuple[list[list[int]], KVPages]:
        started = self._clock()
        eos = self._config.eos_token_ids
        out: list[list[int]] = [[] for _ in batch.rows]
        live = list(range(len(batch.rows)))
        seconds = 0.0
        for k in range(num_steps):
            if not live:
                break
            ctx = sum(batch.rows[i].start_position + k + 1 for i in live)
            seconds += self.cost.decode_s(len(live), float(ctx))
            for i in live:
                out[i].append(random_token(batch.rows[i].seed, batch.rows[i].sample_index + k, self._config.vocab_size))
            rows = batch.rows
            live = [
                i
                for i in live
                if finish_reason(rows[i].sampling, out[i][-1], rows[i].sample_index + len(out[i]), eos) is None
            ]
        self._step("decode", started, seconds, bool(live))
        return out, pages


class TimedPrefill:
    """A `TimedEngine` prefill batch in the pipe (`PrefillHandle`): each wait sleeps until its deadline."""

    def __init__(
        self,
        value: PrefillResult,
        first_stage_end: float,
        end: float,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self._value, self.first_stage_end, self.end = value, first_stage_end, end
        self._clock, self._sleep = clock, sleep

    def _until(self, deadline: float) -> None:
        left = deadline - self._clock()
        if left > 0:
            self._sleep(left)

    def wait_first_stage(self) -> None:
        self._until(self.first_stage_end)

    def result(self) -> PrefillResult:
        self._until(self.end)
        return self._value
