"""The serving limits: one definition the runtime, the simulator and plan files share (pure Python, no JAX).

`jaxserve serve` (its `ControllerConfig`), `jaxserve simulate`/`plan` (the simulator's `SimOptions`) and a plan
file's `limits` all come from `ServingLimits`, so the simulator plans for the engine that will run:

* `block_size` — paged KV block, tokens.
* `num_kv_blocks` — KV blocks per decode / colocated instance. `None` means "what the device memory holds"
  (`placement.latency.kv_capacity_tokens`): the planner's setting for a modelled accelerator; the server
  needs a number: `--num-kv-blocks`, else a plan file's (`jaxserve plan` records the blocks it planned
  with, the smallest any decode / colocated instance holds), else, with the real engine, the blocks
  `--kv-memory-fraction` of the memory the loaded weights leave holds (`runtime.pool_sizing.kv_blocks_from_memory`; `serve` and `LLM`);
  the default 256 below is what the fake / timed engines and the Ray backend get.
* `max_decode_batch` — running sequences per decode / colocated instance.
* `max_batch_tokens` — the engine's token cap: most prompt tokens one prefill (or prefill-priority colocated)
  step batches. Not the paper's L_m (the bubble-balancing target a profile carries): a profile's engine cap,
  when it has one, replaces this default in the simulator.
* `prefill_buffer_slots` — prefilled sequences a prefill instance holds until a decode instance pulls them.
* `chunk_size` — default chunk of chunked colocated prefill (`None`: prefill priority); a plan's instance
  may set its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    block_size: int = 16
    num_kv_blocks: int | None = 256
    max_decode_batch: int = 32
    max_batch_tokens: int = 512
    prefill_buffer_slots: int = 8
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_decode_batch", "max_batch_tokens", "prefill_buffer_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")

    def require_num_kv_blocks(self) -> int:
        """`num_kv_blocks` for a running instance, which needs a number (None is the planner's "what memory holds")."""
        if self.num_kv_blocks is None:
            raise ValueError("a running instance needs num_kv_blocks (None means 'what memory holds', a planner value)")
        return self.num_kv_blocks

    def to_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> ServingLimits:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown serving limits {sorted(unknown)}; known: {sorted(known)}")
        values: dict[str, int | None] = {}
        for key, value in raw.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"serving limit {key} must be an integer or null, got {value!r}")
            values[key] = value
        return cls(**values)  # type: ignore[arg-type]


DEFAULT_LIMITS = ServingLimits()
