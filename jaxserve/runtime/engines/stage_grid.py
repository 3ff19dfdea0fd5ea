"""The stage grid the hand-computable engines (`fake.py`, `timed.py`) lay their KV on, as the real one does.

One `tp` mesh per pipeline stage over consecutive devices, the layers split over the stages as evenly as
`np.array_split` cuts them, a KV's head axis over `tp`: so the runtime's real transfer regroups layers and
reshards heads between two of them exactly as between two real engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.runtime.engines.contract import KVLayout


@dataclasses.dataclass(frozen=True)
class StageGrid:
    meshes: tuple[Mesh, ...]  # one per pipeline stage, axis "tp"
    stage_layers: tuple[int, ...]

    @classmethod
    def of(cls, devices: Sequence[jax.Device], num_layers: int, tp: int, pp: int) -> StageGrid:
        """ValueError unless there are exactly `tp * pp` devices."""
        if len(devices) != tp * pp:
            raise ValueError(f"tp{tp}pp{pp} needs {tp * pp} devices, got {len(devices)}")
        meshes = tuple(Mesh(np.array(devices[s * tp : (s + 1) * tp]), ("tp",)) for s in range(pp))
        return cls(meshes, tuple(len(a) for a in np.array_split(np.arange(num_layers), pp)))

    def kv_layout(self) -> KVLayout:
        """A dense KV ([L_s, T, H, D] per stage) with its heads split over tp."""
        specs = PartitionSpec(None, None, "tp", None)
        return KVLayout(stage_layers=self.stage_layers, shardings=tuple(NamedSharding(m, specs) for m in self.meshes))

    def page_sharding(self, stage: int) -> NamedSharding:
        """A stage's paged pool ([L_s, blocks, block size, H, D]) with its heads split over tp."""
        return NamedSharding(self.meshes[stage], PartitionSpec(None, None, None, "tp", None))
