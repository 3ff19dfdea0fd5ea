"""A checkpoint's tokenizer and chat template: `tokenizer.json`, GPT-2 style vocab + merges, or a GGUF file's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models import gguf

if TYPE_CHECKING:
    import tokenizers


def load_tokenizer(directory: str | Path) -> tokenizers.Tokenizer | None:
    """`tokenizer.json`, GPT-2 style `vocab.json` + `merges.txt` (with OPT's `</s>` BOS), or the tokenizer a
    GGUF file (or a directory holding one) describes; None if none of these."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    directory = Path(directory)
    gguf_path = gguf.find_gguf(directory) if directory.exists() else None
    if gguf_path is not None:
        return gguf.gguf_tokenizer(gguf.open_gguf(gguf_path))
    if (directory / "tokenizer.json").exists():
        return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if not (vocab.exists() and merges.exists()):
        return None
    tok = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in ("<s>", "<pad>", "</s>", "<unk>") if tok.token_to_id(t) is not None]
    tok.add_special_tokens(specials)  # already in the vocab: keeps their ids, marks them special
    bos = tok.token_to_id("</s>")
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", bos)])
    return tok


@dataclasses.dataclass(frozen=True)
class CheckpointChatTemplate:
    """A checkpoint's own chat template (Jinja source, as `transformers`' `apply_chat_template` renders it).

    `special_tokens` are the texts of the vocabulary's special tokens: chat content may not spell them
    (`jaxserve.serving.chat_template` refuses such content).
    """

    template: str
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: tuple[str, ...] = ()


def _token_content(value: Any) -> str | None:
    """A `tokenizer_config.json` token entry: a string, or an AddedToken dict with a `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(source: str | Path) -> CheckpointChatTemplate | None:
    """The chat template a checkpoint carries, or None.

    GGUF: `tokenizer.chat_template` (with its BOS/EOS and control tokens). Hugging Face directory:
    `chat_template` of `tokenizer_config.json` (a string, or the entry named "default" of a list), or
    `chat_template.jinja`; bos/eos tokens from `tokenizer_config.json`, special tokens from it and
    `tokenizer.json`'s added tokens.
    """
    path = Path(source)
    if not path.exists():
        return None
    gguf_path = gguf.find_gguf(path)
    if gguf_path is not None:
        f = gguf.open_gguf(gguf_path)
        template = f.get("tokenizer.chat_template")
        if not template:
            return None
        return CheckpointChatTemplate(
            str(template),
            gguf.token_text(f, "bos_token_id"),
            gguf.token_text(f, "eos_token_id"),
            tuple(gguf.special_token_texts(f)),
        )
    if not path.is_dir():
        return None
    config_path = path / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
    raw = config.get("chat_template")
    if isinstance(raw, list):
        raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
    if not raw and (path / "chat_template.jinja").exists():
        raw = (path / "chat_template.jinja").read_text()
    if not isinstance(raw, str) or not raw:
        return None
    specials: list[str] = []
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, dict) and entry.get("special") and entry.get("content"):
            specials.append(str(entry["content"]))
    if (path / "tokenizer.json").exists():
        added = json.loads((path / "tokenizer.json").read_text()).get("added_tokens") or []
        specials.extend(str(t["content"]) for t in added if t.get("special") and t.get("content"))
    return CheckpointChatTemplate(
        raw,
        _token_content(config.get("bos_token")),
        _token_content(config.get("eos_token")),
        tuple(dict.fromkeys(specials)),
    )
