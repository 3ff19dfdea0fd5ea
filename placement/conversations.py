"""Workloads with shared prefixes: multi-turn conversations over shared system prompts, with token ids.

A conversation picks one of `num_system_prompts` system prompts (shared by every conversation that
picks it) and runs `turns` turns. Turn t's prompt is the previous turn's prompt + the previous answer
+ new user text, so the context grows and each turn's prompt starts with everything the previous
turn saw and produced:

    prompt_1 = system + user_1
    prompt_t = prompt_{t-1} + answer_{t-1} + user_t

Token ids are drawn at random (ids >= 2, below `vocab_size`), so two prompts share a block exactly
when they share the prefix up to it, and cache hits are computable by `PrefixCache`. A conversation
ends early when the next prompt plus its answer would not fit in `max_positions`.

Timing is closed-loop, as a real chat client must be (turn t+1's prompt contains turn t's answer):
conversations start as a Poisson process; turn t+1 is sent `think_s` seconds after turn t's last
token (think times drawn once, in seconds, independent of the rate). So only the first turns have
arrival times in advance; the simulator (`placement/prefix_sim.py`) and a load generator schedule
each later turn when the previous one finishes. `at_rate(rate)` rescales only the conversation start
gaps (conversations start at `rate / mean_turns` per second, so requests arrive at about `rate` once
the system is in steady state and keeps up), with the same think times at any rate.

Request order in a `SharedPrefixWorkload`: the first turns, sorted by arrival (indices
`0 .. num_first - 1`), then the later turns ordered by their conversation's start plus its think
times, so a turn always comes after the turns before it in its conversation. The later turns'
`workload.arrival_at` is a placeholder (the last first-turn arrival) that keeps the `Workload`
sorted; lengths are real.

Everything comes from the caller's `np.random.Generator`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from placement.workload import MAX_POSITIONS, ClippedLognormal, Workload

_USER_TOKENS = ClippedLognormal(120.0, 1.0, 4, 1024)
_ANSWER_TOKENS = ClippedLognormal(200.0, 0.8, 2, 1024)


@dataclasses.dataclass(frozen=True)
class ConversationSpec:
    """How conversations look. Defaults: a chat assistant (ShareGPT-like turns, 2–8 turns each)."""

    num_system_prompts: int = 8
    system_prompt_tokens: int = 256
    min_turns: int = 2
    max_turns: int = 8
    user_tokens: ClippedLognormal | int = _USER_TOKENS  # new user text per turn
    answer_tokens: ClippedLognormal | int = _ANSWER_TOKENS
    think_time_s: float = 10.0  # mean of an exponential, from a turn's last token to the next turn
    max_positions: int = MAX_POSITIONS
    vocab_size: int = 50272

    def __post_init__(self) -> None:
        if self.num_system_prompts < 1 or self.system_prompt_tokens < 0:
            raise ValueError("need >= 1 system prompt and a non-negative system prompt length")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(f"need 1 <= min_turns <= max_turns, got {self.min_turns}, {self.max_turns}")
        if self.think_time_s < 0:
            raise ValueError("think_time_s must be >= 0")
        if self.system_prompt_tokens + _low(self.user_tokens) + _low(self.answer_tokens) > self.max_positions:
            raise ValueError("the shortest first turn does not fit in max_positions")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request of a conversation: its prompt, the answer it will get, how long the user thought."""

    conversation: int
    turn: int
    think_s: float  # after the previous turn's last token (0 for a first turn)
    prompt: np.ndarray  # [input_len] int64 token ids
    answer: np.ndarray  # [output_len] int64 token ids


@dataclasses.dataclass(frozen=True)
class SharedPrefixWorkload:
    """Requests (first turns, then later turns; see the module docstring) with their token ids.

    `next_turn[i]`: the index of the request sent `think_s[next_turn[i]]` seconds after request i
    finishes, or -1 for a conversation's last turn.
    """

    workload: Workload
    prompts: tuple[np.ndarray, ...]
    answers: tuple[np.ndarray, ...]
    conversation: np.ndarray  # [N] int64
    turn: np.ndarray  # [N] int64
    think_s: np.ndarray  # [N] float64
    next_turn: np.ndarray  # [N] int64
    num_first: int

    def __len__(self) -> int:
        return len(self.workload)

    def new_tokens(self, i: int) -> np.ndarray:
        """The tokens request i adds to its conversation: system prompt + user text for a first turn,
        the user text for a later one (its prompt minus the previous prompt and answer)."""
        if self.turn[i] == 0:
            return self.prompts[i]
        (prev,) = np.flatnonzero(self.next_turn == i)
        return self.prompts[i][len(self.prompts[prev]) + len(self.answers[prev]) :]

    def to_jsonl(self, path: str | Path) -> None:
        """The trace a closed-loop load generator replays, one request per line, in request order.

        Fields: `conversation`, `turn`, `arrival_at` (seconds; first turns only, else null),
        `think_s` (after the previous turn's last token), `new_token_ids` (`new_tokens`),
        `output_len`. The client builds turn t's prompt as turn t-1's prompt + the tokens the
        server actually generated + `new_token_ids`, and asks for exactly `output_len` tokens
        (ignore EOS), so block hits match the simulator's, whatever tokens the model produces.
        """
        with Path(path).open("w") as fh:
            for i in range(len(self)):
                row = {
                    "conversation": int(self.conversation[i]),
                    "turn": int(self.turn[i]),
                    "arrival_at": round(float(self.workload.arrival_at[i]), 6) if i < self.num_first else None,
                    "think_s": round(float(self.think_s[i]), 6),
                    "new_token_ids": self.new_tokens(i).tolist(),
                    "output_len": int(self.workload.output_lens[i]),
                }
                fh.write(json.dumps(row) + "\n")

    def ideal_hit_tokens(self, block_size: int) -> int:
        """Prompt tokens an unbounded cache could serve, in all (see `ideal_hits`)."""
        return int(self.ideal_hits(block_size).sum())

    def ideal_hits(self, block_size: int) -> np.ndarray:
        """[N] prompt tokens an unbounded cache could serve: full blocks of the longest earlier shared prefix.

        Counted against every earlier request's prompt + answer (but the answer's last token, whose
        KV is never computed), with at least one prompt token left to compute. An upper bound for
        any finite cache and any timing.
        """
        from jaxserve.core.prefix_cache import block_hashes

        seen: set[bytes] = set()
        hits = np.zeros(len(self.prompts), dtype=np.int64)
        for j, (prompt, answer) in enumerate(zip(self.prompts, self.answers, strict=True)):
            n = 0
            for name in block_hashes(prompt, block_size):
                if name not in seen:
                    break
                n += 1
            while n > 0 and len(prompt) - n * block_size < 1:
                n -= 1
            hits[j] = n * block_size
            seen.update(block_hashes(np.concatenate([prompt, answer[:-1]]), block_size))
        return hits


@dataclasses.dataclass(frozen=True)
class ConversationSet:
    """Sampled conversations, replayable at any rate."""

    spec: ConversationSpec
    turns: tuple[Turn, ...]
    start_gaps: np.ndarray  # [C] gaps between conversation starts at 1 conversation/s

    @property
    def num_conversations(self) -> int:
        return len(self.start_gaps)

    @property
    def mean_turns(self) -> float:
        return len(self.turns) / self.num_conversations

    def at_rate(self, rate: float) -> SharedPrefixWorkload:
        """The requests with conversations starting so that requests arrive at `rate` per second on average."""
        if rate <= 0:
            raise ValueError("rate must be positive")
        starts = np.cumsum(self.start_gaps) * (self.mean_turns / rate)
        # Sort key: the conversation's start plus its think times so far (no service time).
        key = np.zeros(len(self.turns))
        for j, t in enumerate(self.turns):
            key[j] = starts[t.conversation] if t.turn == 0 else key[j - 1] + t.think_s
        first = [j for j, t in enumerate(self.turns) if t.turn == 0]
        later = [j for j, t in enumerate(self.turns) if t.turn > 0]
        order = sorted(first, key=lambda j: (key[j], j)) + sorted(later, key=lambda j: (key[j], j))
        chosen = [self.turns[j] for j in order]
        position = {j: i for i, j in enumerate(order)}
        next_turn = np.full(len(order), -1, dtype=np.int64)
        for i, j in enumerate(order):
            if j + 1 < len(self.turns) and self.turns[j + 1].turn > 0:
                next_turn[i] = position[j + 1]
        last_first = float(key[first].max()) if first else 0.0
        arrival = np.asarray([key[j] if i < len(first) else last_first for i, j in enumerate(order)])
        workload = Workload(
            arrival,
            np.asarray([len(t.prompt) for t in chosen], dtype=np.int64),
            np.asarray([len(t.answer) for t in chosen], dtype=np.int64),
            rate,
        )
        return SharedPrefixWorkload(
            workload,
            tuple(t.prompt for t in chosen),
            tuple(t.answer for t in chosen),
            np.asarray([t.conversation for t in chosen], dtype=np.int64),
            np.asarray([t.turn for t in chosen], dtype=np.int64),
            np.asarray([t.think_s for t in chosen], dtype=np.float64),
            next_turn,
            len(first),
        )


def _low(spec: ClippedLognormal | int) -> int:
    return spec if isinstance(spec, int) else spec.low


def _lengths(spec: ClippedLognormal | int, rng: np.random.Generator, n: int) -> np.ndarray:
    return np.full(n, spec, dtype=np.int64) if isinstance(spec, int) else spec.sample(rng, n)


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(2, vocab_size, size=n, dtype=np.int64)


def generate_conversations(spec: ConversationSpec, num_conversations: int, rng: np.random.Generator) -> ConversationSet:
    """Sample `num_conversations` conversations (token ids, lengths, think times, start gaps)."""
    if num_conversations < 1:
        raise ValueError("need at least one conversation")
    systems = [_tokens(rng, spec.system_prompt_tokens, spec.vocab_size) for _ in range(spec.num_system_prompts)]
    turns: list[Turn] = []
    for c in range(num_conversations):
        context = systems[int(rng.integers(spec.num_system_prompts))]
        num_turns = int(rng.integers(spec.min_turns, spec.max_turns + 1))
        user_lens = _lengths(spec.user_tokens, rng, num_turns)
        answer_lens = _lengths(spec.answer_tokens, rng, num_turns)
        thinks = rng.exponential(spec.think_time_s, size=num_turns) if spec.think_time_s > 0 else np.zeros(num_turns)
        for t in range(num_turns):
            prompt = np.concatenate([context, _tokens(rng, int(user_lens[t]), spec.vocab_size)])
            room = spec.max_positions - len(prompt)
            if room < 1:
                break
            answer = _tokens(rng, min(int(answer_lens[t]), room), spec.vocab_size)
            turns.append(Turn(c, t, float(thinks[t]) if t > 0 else 0.0, prompt, answer))
            context = np.concatenate([prompt, answer])
    start_gaps = rng.exponential(1.0, size=num_conversations)
    return ConversationSet(spec, tuple(turns), start_gaps)
