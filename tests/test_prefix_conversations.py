"""Multi-turn conversation workloads: growing context, shared system prompts, rate rescaling, ideal hits."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from placement.conversations import ConversationSpec, SharedPrefixWorkload, generate_conversations

TINY = ConversationSpec(
    num_system_prompts=1,
    system_prompt_tokens=8,
    min_turns=2,
    max_turns=2,
    user_tokens=3,
    answer_tokens=5,
    think_time_s=10.0,
    vocab_size=1000,
)


def test_next_prompt_is_previous_prompt_plus_answer_plus_user_text() -> None:
    convs = generate_conversations(ConversationSpec(), 20, np.random.default_rng(0))
    by_conv: dict[int, list] = {}
    for t in convs.turns:
        by_conv.setdefault(t.conversation, []).append(t)
    for turns in by_conv.values():
        assert turns[0].think_s == 0.0
        for prev, cur in itertools.pairwise(turns):
            head = np.concatenate([prev.prompt, prev.answer])
            assert cur.turn == prev.turn + 1 and cur.think_s > 0
            assert len(cur.prompt) > len(head) and np.array_equal(cur.prompt[: len(head)], head)
        assert all(len(t.prompt) + len(t.answer) <= 2048 for t in turns)
    assert all(t.prompt.min() >= 2 for t in convs.turns)


def test_requests_link_each_turn_to_the_next() -> None:
    w = generate_conversations(ConversationSpec(), 30, np.random.default_rng(4)).at_rate(2.0)
    assert np.all(w.turn[: w.num_first] == 0) and np.all(w.turn[w.num_first :] > 0)
    assert w.num_first == 30
    for i, j in enumerate(w.next_turn):
        if j >= 0:
            assert j > i and w.conversation[j] == w.conversation[i] and w.turn[j] == w.turn[i] + 1
            prev = np.concatenate([w.prompts[i], w.answers[i]])
            assert np.array_equal(w.prompts[j][: len(prev)], prev)
    assert (w.next_turn >= 0).sum() == len(w) - w.num_first  # every later turn has exactly one parent
    assert len(set(w.next_turn[w.next_turn >= 0].tolist())) == len(w) - w.num_first


def test_system_prompts_are_shared_across_conversations() -> None:
    convs = generate_conversations(ConversationSpec(num_system_prompts=2), 30, np.random.default_rng(1))
    heads = {t.prompt[:256].tobytes() for t in convs.turns}
    assert len(heads) == 2


def test_same_seed_same_conversations_and_rate_rescales_only_starts() -> None:
    a = generate_conversations(TINY, 5, np.random.default_rng(7))
    b = generate_conversations(TINY, 5, np.random.default_rng(7))
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a.turns, b.turns, strict=True))
    slow, fast = a.at_rate(0.1), a.at_rate(10.0)
    assert len(slow) == len(fast) == 10 and slow.num_first == fast.num_first == 5
    # Requests arrive at `rate` on average: conversations start at rate / mean_turns (2 turns here).
    first = slow.workload.arrival_at[:5]
    assert np.allclose(first * 0.1 / 2, np.cumsum(a.start_gaps))
    assert np.allclose(fast.workload.arrival_at[:5], first / 100)

    # The same think times per (conversation, turn) at any rate (the order of later turns may differ).
    def thinks(w: SharedPrefixWorkload) -> dict[tuple[int, int], float]:
        return {(int(c), int(t)): float(s) for c, t, s in zip(w.conversation, w.turn, w.think_s, strict=True)}

    assert thinks(slow) == thinks(fast)


def test_ideal_hit_tokens_by_hand() -> None:
    # Block 4. First turns: 8 system + 3 user = 11 tokens; the first request hits nothing, the other
    # first turn hits the 2 system blocks (8). Second turns: 11 + 5 + 3 = 19 tokens; the previous
    # turn's prompt + answer but its last token (15 tokens) gives 3 full blocks: 12 each.
    w = generate_conversations(TINY, 2, np.random.default_rng(3)).at_rate(1.0)
    assert sorted(w.workload.input_lens.tolist()) == [11, 11, 19, 19]
    assert w.ideal_hit_tokens(4) == 0 + 8 + 12 + 12


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        ConversationSpec(min_turns=3, max_turns=2)
    with pytest.raises(ValueError):
        ConversationSpec(system_prompt_tokens=2048)
    with pytest.raises(ValueError):
        generate_conversations(TINY, 0, np.random.default_rng(0))


def test_jsonl_trace_rebuilds_every_prompt(tmp_path: Path) -> None:
    w = generate_conversations(ConversationSpec(), 6, np.random.default_rng(9)).at_rate(3.0)
    path = tmp_path / "conv.jsonl"
    w.to_jsonl(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len(w)
    context: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        prompt = context.get(row["conversation"], []) + row["new_token_ids"]
        assert prompt == w.prompts[i].tolist()
        assert (row["arrival_at"] is None) == (i >= w.num_first)
        # What a client does with the server's answer (here the workload's own answer tokens).
        context[row["conversation"]] = prompt + w.answers[i].tolist()
        assert row["output_len"] == len(w.answers[i])
