"""The KV connector contract: moving a prefilled sequence's KV from a prefill instance to a decode instance.

One small interface, several connectors side by side in this folder (`in_process.py`, `ray.py`, `timed.py`).
A transfer is bound to one decode engine (its target: `TransferFactory(engine)`). The decode instance's loop
calls `transfer.start(seq)` for a sequence it has admitted, then `handle.poll()` (non-blocking) at each step
boundary until the state is DONE or FAILED (`handle.wait()` blocks); `handle.insert(num_tokens, pages,
block_table)` then writes the pulled KV into the target's pool. Every handle reports `num_bytes` and `seconds`
(start until the arrays were seen ready). A FAILED handle costs only its own request: the decode instance
retries, recomputes or fails that request (`PullFailureConfig`, the one policy every connector reads), never
itself.

What every connector shares lives here: `move_kv` (regroup the layers at the decode stages' boundaries, then
one `jax.device_put` per piece onto the decode side's sharding: slices stay on the source's devices, pieces
landing on one decode stage are concatenated there; different tp degrees need nothing extra, `device_put`
reshards the head axis), and the integrity checks.

Integrity: before a pulled KV is written into the pool, `check_pulled_kv` compares what arrived with
what the pool and the request need (stages, layers, heads, head size, dtype, at least the request's
positions); an opt-in checksum (`ControllerConfig.kv_checksum`, off by default) also compares a fingerprint
of the contents taken on the prefill side at `start` (`kv_fingerprint`) with one of what arrived. Either
mismatch raises `KVIntegrityError` before the pool is touched, and the decode instance recomputes that request
(prefills it again), never decodes from a wrong KV. The checksum's cost: one extra read of the KV on each side
(a position-weighted sum over its bits, on device) and a small host sync at insert.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

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

PullFailurePolicy = Literal["recompute", "fail"]


@dataclasses.dataclass(frozen=True)
class PullFailureConfig:
    """What happens when a KV pull fails (`ControllerConfig.pull_failure`): the decode instance's policy, and the
    Ray decode actors' (which retry and recompute on their side first, with the same numbers)."""

    num_retries: int = 1  # pull attempts after the first (while the prefill side still holds the KV)
    on_failure: PullFailurePolicy = "recompute"  # then: prefill it again (a live prefill instance), or fail it

    def __post_init__(self) -> None:
        if self.num_retries < 0:
            raise ValueError(f"num_retries must be >= 0, got {self.num_retries}")
        if self.on_failure not in ("recompute", "fail"):
            raise ValueError(f"on_failure must be 'recompute' or 'fail', got {self.on_failure!r}")


class KVTransferError(EngineDeadError):
    """One request's KV could not be pulled (decode policy "fail"); the instances are fine.

    A subclass of `EngineDeadError` so that every front maps it to "unavailable, retry".
    """


class KVIntegrityError(ValueError):
    """A pulled KV is not what the request needs (shape, dtype, length or checksum): that request is recomputed."""


def check_pulled_kv(kv: SequenceKV, num_tokens: int, pages: KVPages, request_id: str) -> None:
    """Raise KVIntegrityError unless `kv` fits `pages` (stages, layers, heads, head size, dtype) and holds at least
    `num_tokens` positions."""
    if len(kv) != len(pages):
        raise KVIntegrityError(
            f"the KV of {request_id!r} arrived with {len(kv)} pipeline stages, the pool has {len(pages)}"
        )
    for s, (stage, pool) in enumerate(zip(kv, pages, strict=True)):
        heads_axis = 2 if pool.block_layout == "heads" else 3
        layers, heads, head_dim = pool.k.shape[0], pool.k.shape[heads_axis], pool.k.shape[4]
        for part, a in (("k", stage.k), ("v", stage.v)):
            where = f"the KV of {request_id!r} (stage {s}, {part})"
            if a.ndim != 4 or (a.shape[0], a.shape[2], a.shape[3]) != (layers, heads, head_dim):
                raise KVIntegrityError(
                    f"{where} arrived with shape {tuple(a.shape)}; the pool wants [{layers}, T, {heads}, {head_dim}]"
                )
            if a.shape[1] < num_tokens:
                raise KVIntegrityError(f"{where} arrived truncated: {a.shape[1]} positions of {num_tokens}")
            if a.dtype != pool.k.dtype:
                raise KVIntegrityError(f"{where} arrived as {a.dtype}; the pool holds {pool.k.dtype}")


def kv_fingerprint(kv: SequenceKV) -> jax.Array:
    """A uint32 fingerprint of `kv`'s contents: Σ bits x (index + 1) over every array, wrapping (on device, async)."""
    total = jnp.zeros((), jnp.uint32)
    for stage in kv:
        for a in (stage.k, stage.v):
            width = a.dtype.itemsize * 8
            bits = jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{width}")).reshape(-1).astype(jnp.uint32)
            weights = jnp.arange(1, bits.shape[0] + 1, dtype=jnp.uint32)
            total = total + jnp.sum(bits * weights, dtype=jnp.uint32)
    return total


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


def move_kv(kv: SequenceKV, target: KVLayout) -> SequenceKV:
    """Dispatch `device_put`s of `kv` (host or device arrays, any placement) onto `target`'s stages and shardings
    (non-blocking)."""
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
