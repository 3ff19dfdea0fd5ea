"""The Ray connector's mechanics between processes: leases on the prefill side, two pull mechanisms, a watchdog.

The actors (`ray_backend/actors.py`) use these; the controller side of the connector is `ray.py`.

Prefill side (`LeasedKVBuffer`, used inside the prefill actor): a finished
prefill's KV is held only under a lease (`lease_s`, default a few seconds). The
controller renews the lease while the request waits for a decode instance; a
pull reads the entry without freeing it (`lend`), so a retry after a failed
attempt (the KV was taken, then the copy failed) finds it again. The entry is
freed when the decode side has staged it, when the controller cancels it (the
request ended or moved), or when its lease runs out (`expire`). A KV nobody
renews cannot pin memory.

What a retry covers: every failure of an attempt while the prefill actor
still holds the KV (a copy, host transfer or `jax` pull that failed or timed
out after the take). It cannot bring back a KV whose lease ran out or whose
actor died: then the failure policy applies (recompute on the decode actor,
or fail the request).

Decode side: the decode actor pulls a KV by request id, with one of two
mechanisms (`TransferConfig.mechanism`):

* `object_store`: the prefill actor copies the KV to host numpy arrays and
  returns them from a typed actor method (Ray's object store carries them);
  the decode actor `device_put`s them into its own layout.
* `jax`: `jax.experimental.transfer` servers, one per actor, on explicit
  loopback transport addresses. jax 0.10.2 on CPU returned wrong values when
  the puller asked for a different PartitionSpec, and aborted the process for a
  different device count, so the prefill side stages each stage's arrays on
  ONE device and the decode side pulls into one device of its own, then
  re-shards locally (`base.move_kv`). A pull whose producer never registers the id
  can block past its own timeout: `run_with_watchdog` bounds it.

The retries and the failure policy are the controller's (`PullFailureConfig`, `ControllerConfig.pull_failure`),
handed to every actor at launch.

Integrity (issue 27): what leaves the prefill actor is described by a manifest (each array's shape and
dtype: `ArraySpec`s) and, with the checksum on (`ControllerConfig.kv_checksum`, serve's `--kv-checksum`,
handed to every actor at launch), a fingerprint of its contents (`base.kv_fingerprint`). The decode actor
compares what arrived with both (`check_arrival`), and with what its pool and the request need
(`base.check_pulled_kv`: stages, layers, heads, head size, dtype, positions), before anything is
staged. A KV that fails costs that request a recompute on the decode actor (whatever `on_failure` says:
the KV was there and moved, it is only wrong), never wrong tokens and never the decode actor.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import jax
import numpy as np

from jaxserve.runtime.engines.contract import SequenceKV, StageKV
from jaxserve.runtime.kv_connectors.base import KVIntegrityError, PullFailureConfig, kv_fingerprint

Mechanism = Literal["object_store", "jax"]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """The Ray connector's own knobs (`RayConfig.transfer`); the retries, the failure policy and the checksum are
    the controller's (`ControllerConfig.pull_failure`, `.kv_checksum`)."""

    mechanism: Mechanism = "object_store"
    lease_s: float = 5.0  # a prefilled KV nobody renews is freed after this long
    pull_timeout_s: float = 30.0  # one pull attempt; the watchdog fires after this


@dataclasses.dataclass(frozen=True)
class ActorPulls:
    """What every actor of a deployment reads of pulls: the Ray connector's knobs (`transfer`) and the controller's
    (`failure`, `checksum`: `ControllerConfig.pull_failure` / `.kv_checksum`, one knob each for both backends)."""

    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    failure: PullFailureConfig = dataclasses.field(default_factory=PullFailureConfig)
    checksum: bool = False


class PullError(RuntimeError):
    """A pull that did not deliver the KV (gone, expired, producer dead, timed out)."""


# ---- prefill side: the leased buffer ------------------------------------------------------


@dataclasses.dataclass
class _Lease:
    kv: SequenceKV
    expires_at: float
    lent: bool = False  # pulled at least once (counted once in num_pulled)


class LeasedKVBuffer:
    """Prefilled KV held under leases; thread-safe; time comes in as `now` (monotonic seconds)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Lease] = {}
        self.num_expired = 0
        self.num_pulled = 0
        self.num_cancelled = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, request_id: str, kv: SequenceKV, now: float) -> None:
        with self._lock:
            self._entries[request_id] = _Lease(kv, now + self.lease_s)

    def renew(self, request_ids: Sequence[str], now: float) -> int:
        """Extend the leases of the ids still held; returns how many were."""
        with self._lock:
            held = [self._entries[r] for r in request_ids if r in self._entries]
            for lease in held:
                lease.expires_at = now + self.lease_s
            return len(held)

    def take(self, request_id: str, now: float) -> SequenceKV | None:
        """Remove and return a KV; None if it is gone or its lease ran out."""
        kv = self.lend(request_id, now)
        if kv is not None:
            with self._lock:
                self._entries.pop(request_id, None)
        return kv

    def lend(self, request_id: str, now: float) -> SequenceKV | None:
        """A KV for pulling, left in place (a retried pull finds it again); None if gone or expired."""
        with self._lock:
            lease = self._entries.get(request_id)
            if lease is None:
                return None
            if lease.expires_at < now:
                del self._entries[request_id]
                self.num_expired += 1
                return None
            if not lease.lent:
                lease.lent = True
                self.num_pulled += 1
            return lease.kv

    def cancel(self, request_ids: Sequence[str]) -> int:
        with self._lock:
            n = sum(self._entries.pop(r, None) is not None for r in request_ids)
            self.num_cancelled += n
            return n

    def expire(self, now: float) -> list[str]:
        """Free every entry whose lease ran out; returns their ids."""
        with self._lock:
            gone = [r for r, lease in self._entries.items() if lease.expires_at < now]
            for r in gone:
                del self._entries[r]
            self.num_expired += len(gone)
            return gone


# ---- what a pull carries besides the arrays: a manifest, a fingerprint ---------------------


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    dtype: str


def manifest(kv: SequenceKV) -> tuple[ArraySpec, ...]:
    """Each array's shape and dtype, flat: stage0 k, stage0 v, stage1 k, ..."""
    return tuple(ArraySpec(tuple(int(d) for d in a.shape), str(a.dtype)) for s in kv for a in (s.k, s.v))


def fingerprint_of(kv: SequenceKV) -> int:
    """`kv_fingerprint` as a Python int (it travels in a pull's metadata)."""
    return int(kv_fingerprint(kv))


def check_arrival(
    kv: SequenceKV, specs: Sequence[ArraySpec], fingerprint: int | None, request_id: str, source: str
) -> None:
    """Raise KVIntegrityError unless `kv` is what `source` sent: the arrays its manifest names (number, shapes,
    dtypes) and, when it sent one, the same fingerprint."""
    got = manifest(kv)
    where = f"the KV of {request_id!r} from {source}"
    if len(got) != len(specs):
        raise KVIntegrityError(f"{where} arrived as {len(got)} arrays; {len(specs)} were sent")
    for k, (have, sent) in enumerate(zip(got, specs, strict=True)):
        if have != sent:
            raise KVIntegrityError(
                f"{where} arrived damaged: array {k} is {have.dtype}{list(have.shape)}, "
                f"{sent.dtype}{list(sent.shape)} was sent"
            )
    if fingerprint is not None and fingerprint_of(kv) != fingerprint:
        raise KVIntegrityError(f"{where} arrived corrupted (checksum mismatch)")


def check_positions(kv: SequenceKV, num_tokens: int, request_id: str) -> None:
    """Raise KVIntegrityError unless every array of `kv` ([L, T, H, D]) holds at least `num_tokens` positions."""
    for s, stage in enumerate(kv):
        for part, a in (("k", stage.k), ("v", stage.v)):
            if a.ndim != 4 or a.shape[1] < num_tokens:
                raise KVIntegrityError(
                    f"the KV of {request_id!r} (stage {s}, {part}) arrived truncated: shape {tuple(a.shape)}, "
                    f"{num_tokens} positions needed"
                )


# ---- host arrays (object-store path) ------------------------------------------------------

HostKV = tuple[tuple[np.ndarray, np.ndarray], ...]  # per prefill stage: (k, v), each [L_s, T, H, D]


@dataclasses.dataclass(frozen=True)
class HostShipment:
    """An object-store pull's answer: the KV as host arrays, what was sent (`manifest`) and its fingerprint
    (with the checksum on)."""

    kv: HostKV
    specs: tuple[ArraySpec, ...]
    fingerprint: int | None = None

    @property
    def num_bytes(self) -> int:
        return host_num_bytes(self.kv)


def to_host(kv: SequenceKV) -> HostKV:
    return tuple((np.asarray(s.k), np.asarray(s.v)) for s in kv)


def host_num_bytes(host: HostKV) -> int:
    return sum(int(k.nbytes + v.nbytes) for k, v in host)


def from_host(host: HostKV) -> SequenceKV:
    return tuple(StageKV(k=k, v=v) for k, v in host)  # type: ignore[arg-type]  # numpy in, device_put later


# ---- jax.experimental.transfer path --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JaxTicket:
    """Where and under which id a staged KV waits for a `jax.experimental.transfer` pull."""

    address: str
    uuid: int
    specs: tuple[ArraySpec, ...]  # flat: stage0 k, stage0 v, stage1 k, ... (the pull asks for exactly these)
    fingerprint: int | None = None  # of the KV's contents (the checksum on)

    @property
    def num_bytes(self) -> int:
        return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in self.specs)


def start_transfer_server() -> object:
    """A transfer server on loopback with an explicit loopback transport address."""
    from jax.experimental import transfer

    return transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])


def stage_for_pull(kv: SequenceKV) -> list[jax.Array]:
    """Every array of `kv` gathered onto this process's first device (the layout the puller asks for)."""
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return [jax.device_put(a, single) for s in kv for a in (s.k, s.v)]


def pull_staged(server: object, ticket: JaxTicket, timeout_s: float) -> SequenceKV:
    """Pull a ticket's arrays onto this process's first device (same single-device layout as staged)."""
    import datetime

    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    specs = [jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=single) for s in ticket.specs]
    conn = server.connect(ticket.address)  # type: ignore[attr-defined]
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    flat = conn.pull(ticket.uuid, specs, timeout=deadline)
    jax.block_until_ready(flat)
    return tuple(StageKV(k=flat[i], v=flat[i + 1]) for i in range(0, len(flat), 2))


def run_with_watchdog(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run `fn` in a daemon thread; raise PullError if it has not returned within `timeout_s`.

    The thread is abandoned (not killed) when it overruns: a blocked native pull
    cannot be interrupted, but the caller is free again and can recompute.
    """
    box: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=f"watchdog-{what}", daemon=True).start()
    if not done.wait(timeout_s):
        raise PullError(f"{what}: no answer within {timeout_s:.1f} s (watchdog)")
    if "error" in box:
        err = box["error"]
        assert isinstance(err, BaseException)
        raise PullError(f"{what}: {err!r}") from err
    return box["value"]  # type: ignore[return-value]


def fetch(ref: object, timeout_s: float | None = None) -> object:
    """`ray.get` of one ObjectRef (Ray's own annotations make mypy read it as a list; callers cast)."""
    import ray

    return ray.get(ref, timeout=timeout_s)  # type: ignore[call-overload]
