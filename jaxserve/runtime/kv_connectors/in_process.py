"""The in-process KV connector: one `jax.device_put` per piece onto the decode instance's `NamedSharding`.

Both instances live in this JAX process (the embedded controller, `LLM`, `serve` without Ray): the copy is
dispatched at `start` (`base.move_kv`, device to device, regrouping layers when the pipeline splits differ) and
`poll` asks whether the arrays are ready. With `checksum=True` (`ControllerConfig.kv_checksum`) the source's
fingerprint is taken before the copy and compared with what arrived at `insert`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax

from jaxserve.runtime.engines.contract import Engine, KVPages, PrefilledSequence, SequenceKV
from jaxserve.runtime.kv_connectors.base import (
    KVIntegrityError,
    TransferState,
    check_pulled_kv,
    kv_fingerprint,
    move_kv,
)


class InProcessHandle:
    """A transfer inside one JAX process: the arrays were dispatched with `device_put` at start."""

    def __init__(
        self,
        request_id: str,
        arrays: SequenceKV,
        num_bytes: int,
        started_at: float,
        target: Engine,
        fingerprint: jax.Array | None = None,
    ) -> None:
        self.target = target
        self._fingerprint = fingerprint  # the source's `kv_fingerprint` (checksum on)
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
        """Check what arrived (`check_pulled_kv`, and the checksum when on), then write it; KVIntegrityError
        before the pool is touched."""
        arrays = self.result()
        check_pulled_kv(arrays, num_tokens, pages, self._request_id)
        if self._fingerprint is not None and int(kv_fingerprint(arrays)) != int(self._fingerprint):
            raise KVIntegrityError(f"the KV of {self._request_id!r} arrived corrupted (checksum mismatch)")
        return self.target.insert(arrays, num_tokens, pages, block_table)


class InProcessTransfer:
    """`jax.device_put` of the prefill KV onto the shardings of the decode engine it is bound to."""

    def __init__(self, target: Engine, checksum: bool = False) -> None:
        if not target.capabilities.dense_insert:
            raise TypeError(f"an in-process transfer writes into a local engine; {type(target).__name__} is not one")
        self.target = target
        self.layout = target.kv_layout()
        self.checksum = checksum

    def start(self, seq: PrefilledSequence) -> InProcessHandle:
        started_at = time.monotonic()
        fingerprint = kv_fingerprint(seq.dense_kv) if self.checksum else None  # of the source, before it moves
        arrays = self.move(seq.dense_kv)
        return InProcessHandle(seq.request_id, arrays, seq.num_bytes, started_at, self.target, fingerprint)

    def move(self, kv: SequenceKV) -> SequenceKV:
        """The copy itself (`move_kv`; a test overrides it to lose or damage a pull)."""
        return move_kv(kv, self.layout)
