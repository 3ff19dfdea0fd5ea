"""Moving a prefilled sequence's KV from a prefill instance to a decode instance.

One small interface, several implementations (this file: in-process; the Ray
backend adds a cross-process one). A transfer is bound to one decode engine
(its target: `TransferFactory(engine)`). The decode instance's loop calls
`transfer.start(seq)` for a sequence it has admitted, then `handle.poll()`
(non-blocking) at each step boundary until the state is DONE or FAILED
(`handle.wait()` blocks); `handle.insert(num_tokens, pages, block_table)` then
writes the pulled KV into the target's pool. Every handle reports `num_bytes`
and `seconds` (start until the arrays were seen ready). A FAILED handle costs
only its own request: the decode instance retries, recomputes or fails that
request (`PullFailurePolicy`), never itself.

`InProcessTransfer` is one `jax.device_put` per piece onto the decode
instance's `NamedSharding`, device to device. When the two sides' pipeline
splits differ, layers are regrouped first: the prefill stages' layers are read
in order and cut at the decode stages' boundaries (slices stay on the prefill
devices; pieces landing on one decode stage are concatenated there). Different
tp degrees need nothing extra: `device_put` reshards the head axis.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxserve.core.errors import EngineDeadError
from jaxserve.runtime.engines.contract import (
    Engine,
    KVLayout,
    KVPages,
    PrefilledSequence,
    SequenceKV,
    StageKV,
)


class KVTransferError(EngineDeadError):
    """One request's KV could not be pulled (decode policy "fail"); the instances are fine.

    A subclass of `EngineDeadError` so that every front maps it to "unavailable, retry".
    """


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferHandle(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def num_bytes(self) -> int: ...

    @property
    def seconds(self) -> float | None: ...

    def poll(self) -> TransferState: ...

    def wait(self, timeout_s: float | None = None) -> TransferState: ...

    def insert(self, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        """Write the pulled KV (state DONE) into the target engine's pool at `block_table`; the new pool."""
        ...


class KVTransfer(Protocol):
    """Starts pulls of prefilled KV into the decode engine it is bound to (non-blocking)."""

    def start(self, seq: PrefilledSequence) -> TransferHandle: ...


TransferFactory = Callable[[Engine], KVTransfer]  # one transfer per decode instance, bound to its engine


def regroup_layers(kv: SequenceKV, target_stage_layers: tuple[int, ...]) -> list[list[StageKV]]:
    """Cut `kv` (stages in order) into pieces per target stage; pieces stay where they are."""
    total = sum(s.k.shape[0] for s in kv)
    if total != sum(target_stage_layers):
        raise ValueError(f"KV has {total} layers, target layout wants {sum(target_stage_layers)}")
    pieces: list[list[StageKV]] = [[] for _ in target_stage_layers]
    src, src_off = 0, 0
    for t, want in enumerate(target_stage_layers):
        while want > 0:
            stage = kv[src]
            take = min(want, stage.k.shape[0] - src_off)
            if src_off == 0 and take == stage.k.shape[0]:
                pieces[t].append(stage)
            else:
                pieces[t].append(StageKV(k=stage.k[src_off : src_off + take], v=stage.v[src_off : src_off + take]))
            want -= take
            src_off += take
            if src_off == stage.k.shape[0]:
                src, src_off = src + 1, 0
    return pieces


class InProcessHandle:
    """A transfer inside one JAX process: the arrays were dispatched with `device_put` at start."""

    def __init__(self, request_id: str, arrays: SequenceKV, num_bytes: int, started_at: float, target: Engine) -> None:
        self.target = target
        self._request_id = request_id
        self._arrays = arrays
        self._num_bytes = num_bytes
        self._started_at = started_at
        self._seconds: float | None = None
        self._state = TransferState.PENDING

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def seconds(self) -> float | None:
        return self._seconds

    def _mark(self, state: TransferState) -> TransferState:
        if self._state is TransferState.PENDING and state is not TransferState.PENDING:
            self._seconds = time.monotonic() - self._started_at
            self._state = state
        return self._state

    def poll(self) -> TransferState:
        if self._state is not TransferState.PENDING:
            return self._state
        try:
            ready = all(a.is_ready() for s in self._arrays for a in (s.k, s.v))  # type: ignore[attr-defined]
        except Exception:
            return self._mark(TransferState.FAILED)
        return self._mark(TransferState.DONE) if ready else TransferState.PENDING

    def wait(self, timeout_s: float | None = None) -> TransferState:
        # device_put has no timeout; block_until_ready returns when the copy lands (or raises).
        del timeout_s
        if self._state is TransferState.PENDING:
            try:
                jax.block_until_ready(self._arrays)
            except Exception:
                return self._mark(TransferState.FAILED)
            self._mark(TransferState.DONE)
        return self._state

    def result(self) -> SequenceKV:
        if self.poll() is not TransferState.DONE and self.wait() is not TransferState.DONE:
            raise RuntimeError(f"KV transfer of {self._request_id!r} failed")
        return self._arrays

    def insert(self, num_tokens: int, pages: KVPages, block_table: Sequence[int]) -> KVPages:
        return self.target.insert(self.result(), num_tokens, pages, block_table)


class InProcessTransfer:
    """`jax.device_put` of the prefill KV onto the shardings of the decode engine it is bound to."""

    def __init__(self, target: Engine) -> None:
        if not target.capabilities.dense_insert:
            raise TypeError(f"an in-process transfer writes into a local engine; {type(target).__name__} is not one")
        self.target = target
        self.layout = target.kv_layout()

    def start(self, seq: PrefilledSequence) -> InProcessHandle:
        started_at = time.monotonic()
        arrays = move_kv(seq.dense_kv, self.layout)
        return InProcessHandle(seq.request_id, arrays, seq.num_bytes, started_at, self.target)


def move_kv(kv: SequenceKV, target: KVLayout) -> SequenceKV:
    """Dispatch `device_put`s of `kv` onto `target`'s stages and shardings (non-blocking)."""
    out = []
    for pieces, sharding in zip(regroup_layers(kv, target.stage_layers), target.shardings, strict=True):
        moved = [StageKV(k=jax.device_put(p.k, sharding), v=jax.device_put(p.v, sharding)) for p in pieces]
        if len(moved) == 1:
            out.append(moved[0])
        else:  # pieces already sit on this stage's devices; the concatenation runs there
            k = jnp.concatenate([m.k for m in moved], axis=0)  # [L_s, T, H, D]
            v = jnp.concatenate([m.v for m in moved], axis=0)
            out.append(StageKV(k=k, v=v))
    return tuple(out)
