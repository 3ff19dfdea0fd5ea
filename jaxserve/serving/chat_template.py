"""The chat template: messages -> one prompt text (both APIs; documented in docs/serving.md).

The tokenizers jaxserve loads (`tokenizer.json`) carry no chat template, so every model
gets this simple one: each message is `### {Role}:\\n{content}\\n\\n` (developer messages
count as system messages), and the prompt ends with `### Assistant:\\n`, where the model
continues. Pure Python: the client library imports it too.

Message content is text from whoever calls the API, so it must not be able to forge the
template's structure:

* a content line that reads as a role marker (`### User:`, `###assistant :`, any case, any
  number of `#`, leading spaces, however the line is broken: `\\n`, `\\r`, U+2028, ...) is
  *escaped*: a backslash goes before it (`\\### User:`), so it renders as text and no content
  line ever is a marker. Content is otherwise verbatim.
* a special token's text (`<s>`, `</s>`, `<pad>`, `<unk>`, `<mask>`, and any `<|...|>` such as
  `<|endoftext|>`) is *refused* (`InvalidRequestError` on `messages`: 400 / INVALID_ARGUMENT):
  the tokenizer would turn it into the token itself (an end of sequence, a turn boundary), and
  no plain-text spelling of it would mean the same to the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from jaxserve.core.errors import InvalidRequestError

ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
GENERATION_PROMPT = "### Assistant:\n"

# A line that a reader (or the model) takes for a turn: hashes, a role name, a colon.
_MARKER_RE = re.compile(r"^\s*#+\s*(?:system|user|assistant|developer)\s*:", re.IGNORECASE)
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>", "<mask>")
_SPECIAL_RE = re.compile(
    "|".join(re.escape(t) for t in SPECIAL_TOKENS) + r"|<\|[^<>|\s]{1,64}\|>"
)  # as tokenizers match: exact


def escape_content(content: str) -> str:
    """`content` with every role-marker line escaped (a backslash in front); other lines verbatim."""
    lines = content.splitlines(keepends=True)
    if not any(_MARKER_RE.match(line) for line in lines):
        return content
    return "".join("\\" + line if _MARKER_RE.match(line) else line for line in lines)


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """`(role, content)` pairs as one prompt; raises ValueError on an unknown role and InvalidRequestError
    (field `messages`) on content holding a special token's text."""
    parts = []
    for index, (role, content) in enumerate(messages):
        if role not in ROLES:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(ROLES)}")
        special = _SPECIAL_RE.search(content)
        if special is not None:
            raise InvalidRequestError(
                f"messages[{index}] contains {special.group()!r}, the text of a special token: chat content may "
                "not hold special tokens",
                field="messages",
            )
        parts.append(f"### {ROLES[role]}:\n{escape_content(content)}\n\n")
    return "".join(parts) + GENERATION_PROMPT
