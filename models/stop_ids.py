"""Every token id a checkpoint declares as an end of generation, wherever it declares it.

`config.json`'s `eos_token_id` is only one of the places. Instruct models put the ids that end a
reply in `generation_config.json` (Llama 3 Instruct: `[128001, 128008, 128009]`, the last being
`<|eot_id|>`, the end of a turn), which is what transformers' `generate` stops on; a tokenizer
names its own `eos_token` (`tokenizer_config.json`); a GGUF file has `eos`, `eot` (end of turn) and
`eom` (end of message) ids. A model that stopped only on `config.json`'s EOS would run past the end
of every chat turn to `max_tokens`. `with_checkpoint_stop_ids` adds the others to a Llama-style
config's `eos_token_ids` (the runtime's stop set; `ignore_eos` ignores all of them), config.json's
first, so `eos_token_id` stays what it was.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from models.config import LlamaConfig, ModelConfig

GGUF_STOP_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")  # tokenizer.ggml.<key>


def _ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` entry: an int, a list of ints, or absent; anything else declares nothing."""
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):  # absent or unreadable: it declares nothing (the loaders report real damage)
        return {}
    return raw if isinstance(raw, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken entry
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def tokenizer_eos_id(directory: Path) -> int | None:
    """The id of `tokenizer_config.json`'s `eos_token` in `tokenizer.json` (added tokens, then the vocabulary)."""
    text = _token_content(_read_json(directory / "tokenizer_config.json").get("eos_token"))
    if text is None:
        return None
    tokenizer = _read_json(directory / "tokenizer.json")
    for token in tokenizer.get("added_tokens") or ():
        if isinstance(token, dict) and token.get("content") == text and isinstance(token.get("id"), int):
            return int(token["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
        return int(vocab[text])
    return None


def hf_stop_ids(directory: str | Path) -> tuple[int, ...]:
    """The stop ids a Hugging Face directory declares besides config.json: generation config, then tokenizer."""
    directory = Path(directory)
    declared = _ids(_read_json(directory / "generation_config.json").get("eos_token_id"))
    tok = tokenizer_eos_id(directory)
    return declared + (() if tok is None else (tok,))


def merged(cfg: ModelConfig, extra: Iterable[int]) -> ModelConfig:
    """`cfg` with `extra` added to its stop ids (Llama-style configs; ids outside the vocabulary are dropped)."""
    if not isinstance(cfg, LlamaConfig):
        return cfg  # OPT: one EOS, which its checkpoints also keep in config.json
    ids = tuple(dict.fromkeys((*cfg.eos_token_ids, *(i for i in extra if 0 <= i < cfg.vocab_size))))
    return cfg if ids == cfg.eos_token_ids else dataclasses.replace(cfg, eos_token_ids=ids)


def with_checkpoint_stop_ids(cfg: ModelConfig, directory: str | Path) -> ModelConfig:
    """`cfg` (from `directory`'s config.json) with every other stop id the directory declares."""
    return merged(cfg, hf_stop_ids(directory))
