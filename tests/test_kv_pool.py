"""Block allocator and the paged write: exact block accounting and positions landing in their slots."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.core.blocks import BlockAllocator, OutOfBlocksError
from jaxserve.runtime.engines.contract import StageKV
from jaxserve.runtime.engines.fake import FakeEngine
from jaxserve.runtime.kv_pool import write_sequence
from models.config import OPTConfig


def test_allocator_hands_out_and_takes_back_blocks() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a = alloc.allocate("a", 3)
    b = alloc.allocate("b", 2)
    assert a == (0, 1, 2) and b == (3, 4)
    assert (alloc.num_free, alloc.num_used) == (3, 5)
    assert alloc.table("a") == a
    with pytest.raises(OutOfBlocksError):
        alloc.allocate("c", 4)
    with pytest.raises(ValueError, match="already"):
        alloc.allocate("a", 1)
    assert alloc.free("a") == 3
    assert alloc.free("a") == 0  # idempotent
    assert alloc.num_free == 6
    c = alloc.allocate("c", 6)
    assert set(c) == {0, 1, 2, 5, 6, 7}
    alloc.free("b")
    alloc.free("c")
    assert alloc.free_blocks == frozenset(range(8))


def test_write_sequence_places_positions_by_block_table() -> None:
    cfg = OPTConfig(name="t", hidden_size=16, ffn_dim=32, num_layers=2, num_heads=2, vocab_size=300)
    engine = FakeEngine(cfg, jax.devices()[:2], tp=2)
    pages = engine.init_pages(num_blocks=6, block_size=4)
    layout = engine.kv_layout()
    t = 16  # padded length; only 7 positions are real
    k = np.arange(2 * t * 2, dtype=np.float32).reshape(2, t, 2, 1) + 1
    kv = (StageKV(k=jax.device_put(k, layout.shardings[0]), v=jax.device_put(-k, layout.shardings[0])),)
    pages = write_sequence(pages, kv, num_tokens=7, block_table=(4, 1))
    got = np.asarray(pages[0].k)  # [L, NB, BS, H, 1]
    for p in range(7):
        np.testing.assert_array_equal(got[:, (4, 1)[p // 4], p % 4], k[:, p])
    written = {(b, s) for b in range(6) for s in range(4) if np.any(got[:, b, s] != 0)}
    assert written == {(4, s) for s in range(4)} | {(1, s) for s in range(3)}
    np.testing.assert_array_equal(np.asarray(pages[0].v), -got)
    # Continue the sequence at position 7 (a decode append).
    one = np.full((2, 1, 2, 1), 99.0, np.float32)
    kv1 = (StageKV(k=jax.device_put(one, layout.shardings[0]), v=jax.device_put(one, layout.shardings[0])),)
    pages = write_sequence(pages, kv1, num_tokens=1, block_table=(4, 1), start=7)
    assert np.all(np.asarray(pages[0].k)[:, 1, 3] == 99.0)
    with pytest.raises(ValueError, match="do not fit"):
        write_sequence(pages, kv, num_tokens=9, block_table=(4, 1))
