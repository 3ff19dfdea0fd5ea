"""The chat template: messages -> one prompt text (both APIs; documented in docs/serving.md).

The tokenizers jaxserve loads (`tokenizer.json`) carry no chat template, so every model
gets this simple one: each message is `### {Role}:\\n{content}\\n\\n` (developer messages
count as system messages), and the prompt ends with `### Assistant:\\n`, where the model
continues. Pure Python: the client library imports it too.
"""

from __future__ import annotations

from collections.abc import Iterable

ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
GENERATION_PROMPT = "### Assistant:\n"


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """`(role, content)` pairs as one prompt; raises ValueError on an unknown role."""
    parts = []
    for role, content in messages:
        if role not in ROLES:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(ROLES)}")
        parts.append(f"### {ROLES[role]}:\n{content}\n\n")
    return "".join(parts) + GENERATION_PROMPT
