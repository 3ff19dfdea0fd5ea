"""KV transfer conformance: every implementation moves prefill KV into the decode layout, timed.

Parametrized over implementations (the Ray backend adds its own to TRANSFERS).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.core.request import SamplingParams
from jaxserve.runtime.engines.contract import PrefillItem, StageKV
from jaxserve.runtime.engines.fake import FakeEngine
from jaxserve.runtime.kv_connectors.base import TransferState, regroup_layers
from jaxserve.runtime.kv_connectors.in_process import InProcessTransfer
from models.config import OPTConfig

CFG = OPTConfig(name="kv-test", hidden_size=32, ffn_dim=64, num_layers=4, num_heads=4, vocab_size=300)
TRANSFERS = {"in_process": InProcessTransfer}


def _prefilled(engine: FakeEngine, prompt: tuple[int, ...]):
    return engine.prefill([PrefillItem("r0", prompt, SamplingParams(), 0)]).sequences[0]


def _full_kv(kv: tuple[StageKV, ...]) -> np.ndarray:
    return np.concatenate([np.asarray(s.k) for s in kv], axis=0)  # [L, T, H, D]


@pytest.mark.parametrize("impl", sorted(TRANSFERS))
@pytest.mark.parametrize(
    ("src", "dst"),
    [((2, 1), (1, 1)), ((1, 2), (2, 1)), ((1, 1), (2, 2)), ((2, 2), (1, 4)), ((1, 1), (1, 1))],
    ids=["tp2->tp1", "pp2->tp2", "tp1->tp2pp2", "tp2pp2->pp4", "tp1->tp1"],
)
def test_transfer_lands_in_decode_layout(impl: str, src: tuple[int, int], dst: tuple[int, int]) -> None:
    devices = jax.devices()
    n_src = src[0] * src[1]
    prefill = FakeEngine(CFG, devices[:n_src], tp=src[0], pp=src[1])
    decode = FakeEngine(CFG, devices[n_src : n_src + dst[0] * dst[1]], tp=dst[0], pp=dst[1])
    seq = _prefilled(prefill, tuple(range(5, 25)))
    layout = decode.kv_layout()

    handle = TRANSFERS[impl](decode).start(seq)
    assert handle.wait() is TransferState.DONE
    assert handle.poll() is TransferState.DONE
    kv = handle.result()

    assert handle.request_id == "r0"
    assert handle.num_bytes == seq.num_bytes == 2 * 4 * seq.kv[0].k.shape[1] * CFG.num_heads * 4
    assert handle.seconds is not None and handle.seconds >= 0
    assert len(kv) == dst[1]
    for stage, (arrs, sharding) in enumerate(zip(kv, layout.shardings, strict=True)):
        for arr in (arrs.k, arrs.v):
            assert arr.sharding.is_equivalent_to(sharding, arr.ndim)
            assert set(arr.sharding.device_set) == set(decode.meshes[stage].devices.flat)
            shard_shapes = {s.data.shape for s in arr.addressable_shards}
            assert shard_shapes == {(layout.stage_layers[stage], arr.shape[1], CFG.num_heads // dst[0], 1)}
    np.testing.assert_array_equal(_full_kv(kv), _full_kv(seq.kv))


def test_regroup_layers_cuts_at_target_boundaries() -> None:
    devices = jax.devices()
    engine = FakeEngine(CFG, devices[:2], tp=1, pp=2)  # stages of 2 + 2 layers
    seq = _prefilled(engine, (7, 8, 9))
    pieces = regroup_layers(seq.kv, (1, 3))
    assert [[p.k.shape[0] for p in stage] for stage in pieces] == [[1], [1, 2]]
    with pytest.raises(ValueError, match="layers"):
        regroup_layers(seq.kv, (1, 1))
