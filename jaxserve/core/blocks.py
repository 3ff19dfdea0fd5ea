"""The KV block allocator: a free list and each sequence's block table, in plain Python (no JAX).

Owned by one instance's worker loop (guarded by that instance's lock); the prefix cache
(`prefix_cache.py`) and the simulator (`placement/prefix_sim.py`) use it too, so it imports
nothing that loads a device runtime. The device pool it indexes is `kv_pool.py`.
"""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """The allocator was asked for more blocks than are free (the admission policy should prevent this)."""


class BlockAllocator:
    """Fixed-size KV blocks: a free list and each sequence's block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def free_blocks(self) -> frozenset[int]:
        return frozenset(self._free)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def allocate(self, seq_id: str, num_blocks: int) -> tuple[int, ...]:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {num_blocks} blocks, {len(self._free)} free")
        table = [self._free.pop() for _ in range(num_blocks)]
        self._tables[seq_id] = table
        return tuple(table)

    def table(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])

    def free(self, seq_id: str) -> int:
        """Return a sequence's blocks to the free list; 0 if it held none."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self._free.extend(reversed(table))
        return len(table)
