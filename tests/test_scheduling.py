"""The shared scheduling policies stepped by hand: exact batches, orders and refusals."""

from __future__ import annotations

import pytest

from jaxserve.core.scheduling import (
    BlockReservation,
    ColocatedRequest,
    DecodeAdmission,
    DecodeLoad,
    PendingDecode,
    PrefillBatch,
    PrefillChunk,
    PrefillLoad,
    WaitingPrompt,
    admit_decodes,
    blocks_for,
    choose_decode_instance,
    choose_prefill_instance,
    colocated_load,
    form_prefill_batch,
    schedule_colocated,
)


def _queue(*lengths: int) -> list[WaitingPrompt]:
    return [WaitingPrompt(f"r{i}", n) for i, n in enumerate(lengths)]


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        blocks_for(4, 0)


def test_prefill_batch_cuts_at_lm_in_fcfs_order() -> None:
    # 100 + 200 + 150 = 450 <= 512; adding 100 would make 550.
    assert form_prefill_batch(_queue(100, 200, 150, 100, 10), max_batch_tokens=512) == PrefillBatch(
        ("r0", "r1", "r2"), 450
    )
    # Exactly L_m fills the batch.
    assert form_prefill_batch(_queue(256, 256, 1), max_batch_tokens=512) == PrefillBatch(("r0", "r1"), 512)
    # FCFS: a short prompt behind one that does not fit is not pulled forward.
    assert form_prefill_batch(_queue(500, 100, 5), max_batch_tokens=512) == PrefillBatch(("r0",), 500)


def test_prefill_prompt_longer_than_lm_runs_alone() -> None:
    assert form_prefill_batch(_queue(900, 10, 10), max_batch_tokens=512) == PrefillBatch(("r0",), 900)
    assert form_prefill_batch(_queue(10, 900), max_batch_tokens=512) == PrefillBatch(("r0",), 10)


def test_prefill_batch_respects_buffer_room() -> None:
    assert form_prefill_batch(_queue(10, 10, 10, 10), max_batch_tokens=512, max_batch_size=2) == PrefillBatch(
        ("r0", "r1"), 20
    )
    assert len(form_prefill_batch(_queue(10, 10), max_batch_tokens=512, max_batch_size=0)) == 0
    assert form_prefill_batch([], max_batch_tokens=512) == PrefillBatch()


def test_shortest_queue_dispatch() -> None:
    loads = [PrefillLoad(300, 2), PrefillLoad(120, 3), PrefillLoad(120, 1), PrefillLoad(500, 0)]
    assert choose_prefill_instance(loads) == 2
    assert choose_prefill_instance([PrefillLoad(0, 0), PrefillLoad(0, 0)]) == 0


def test_least_loaded_decode_choice() -> None:
    loads = [DecodeLoad(4, 1, 100), DecodeLoad(3, 1, 10), DecodeLoad(2, 2, 50)]
    # instances 1 and 2 both hold 4 sequences; 2 has more free blocks.
    assert choose_decode_instance(loads) == 2


def test_decode_admission_refuses_without_blocks_or_room() -> None:
    pending = [PendingDecode("a", 30, 2), PendingDecode("b", 100, 28), PendingDecode("c", 1, 1)]
    # a needs ceil(32/16)=2 blocks, b needs ceil(128/16)=8, c needs 1.
    a, b, c = BlockReservation("a", 2), BlockReservation("b", 8), BlockReservation("c", 1)

    def admit(free: int, running: int) -> DecodeAdmission:
        return admit_decodes(pending, num_free_blocks=free, num_running=running, max_batch_size=8, block_size=16)

    assert admit(11, 0) == DecodeAdmission((a, b, c)) and admit(11, 0).num_blocks == 11
    assert admit(10, 0) == DecodeAdmission((a, b))
    assert admit(9, 0) == DecodeAdmission((a,))
    # FCFS without skipping: c would fit but waits behind b.
    assert admit(4, 0) == DecodeAdmission((a,))
    assert admit(100, 7) == DecodeAdmission((a,))
    assert admit(100, 8) == DecodeAdmission() and len(admit(100, 8)) == 0


def _req(rid: str, prompt: int, new: int, prefilled: int = 0, admitted: bool = False) -> ColocatedRequest:
    return ColocatedRequest(rid, prompt, new, num_prefilled=prefilled, admitted=admitted)


def test_colocated_prefill_priority() -> None:
    running = [_req("d0", 10, 5, prefilled=10, admitted=True), _req("d1", 20, 5, prefilled=20, admitted=True)]
    waiting = [_req("w0", 300, 10), _req("w1", 300, 10)]
    step = schedule_colocated(
        running + waiting, num_free_blocks=1000, block_size=16, max_batch_size=8, max_batch_tokens=512
    )
    # Prefill has priority: w0 runs alone (w1 would pass L_m), no decode this step.
    assert step.admit == (BlockReservation("w0", 20),)  # ceil(310 / 16)
    assert step.prefill == (PrefillChunk("w0", 0, 300),)
    assert step.decode == ()
    # No room for the waiting prompt's KV: decode everything running instead.
    step = schedule_colocated(
        running + waiting, num_free_blocks=5, block_size=16, max_batch_size=8, max_batch_tokens=512
    )
    assert step.admit == () and step.prefill == ()
    assert step.decode == ("d0", "d1")


def test_colocated_chunked_piggybacks_decodes() -> None:
    requests = [
        _req("d0", 10, 5, prefilled=10, admitted=True),
        _req("p0", 300, 10, prefilled=200, admitted=True),
        _req("w0", 400, 10),
        _req("w1", 50, 10),
    ]
    step = schedule_colocated(
        requests, num_free_blocks=1000, block_size=16, max_batch_size=8, max_batch_tokens=512, chunk_size=256
    )
    # Budget 256: 1 decode, the remaining 100 tokens of p0, then 155 tokens of w0.
    assert step.decode == ("d0",)
    assert step.prefill == (PrefillChunk("p0", 200, 100), PrefillChunk("w0", 0, 155))
    assert step.admit == (BlockReservation("w0", 26),)  # ceil(410 / 16)
    assert step.num_tokens == 256


def test_colocated_chunked_admission_needs_blocks() -> None:
    requests = [_req("w0", 400, 100), _req("w1", 10, 10)]
    # w0 needs ceil(500/16)=32 blocks; with 31 nothing is admitted (FCFS, no skipping).
    step = schedule_colocated(
        requests, num_free_blocks=31, block_size=16, max_batch_size=8, max_batch_tokens=512, chunk_size=64
    )
    assert step.is_idle and step.admit == ()


def test_colocated_load_counts_a_partly_prefilled_request_as_running() -> None:
    requests = [
        _req("d0", 10, 5, prefilled=10, admitted=True),  # decoding
        _req("p0", 300, 10, prefilled=200, admitted=True),  # partly prefilled: running, holds its blocks
        _req("w0", 400, 10),
        _req("w1", 50, 10),
    ]
    assert colocated_load(requests) == PrefillLoad(450, 2)
    assert colocated_load(requests[:2]) == PrefillLoad(0, 0)
