"""Forced tool calls (`tool_choice` "required" or a named function) in the generic format, for any chat template.

The tools are described in a system message (`tools_system_message`), and the output is constrained to one call's
JSON, `{"name": ..., "arguments": {...}}`, by a grammar built from the function's parameter schema (`call_spec`:
for "required", any of the tools). The output therefore always parses (`parse_call`) and becomes OpenAI's
`tool_calls` with `finish_reason: "tool_calls"`. Follow-ups (an assistant message with `tool_calls`, then
`role: tool` results) render in the same generic words (`followup_text`).

`tool_choice: "auto"` needs the model to choose between text and a call, which only a chat template's own
tool-call format (Hermes/Qwen `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`) lets it do: those are parsed
by `jaxserve.serving.tool_parsers`; a model whose template has none answers "auto" with a 400 saying so
(`AUTO_UNSUPPORTED`).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import Any

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.request import GuidedSpec

AUTO_UNSUPPORTED = (
    'tool_choice "auto" (the default with tools) needs a chat template with a tool-call format (Hermes/Qwen '
    "<tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]), and this model's template has none: use tool_choice "
    '"required" or {"type": "function", "function": {"name": ...}}, or "none"'
)


@dataclasses.dataclass(frozen=True)
class FunctionTool:
    """One tool: a function's name, description and JSON Schema of its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any]


def tools_system_message(tools: Sequence[FunctionTool], forced: str | None) -> str:
    """The system message that describes `tools` and how to call one (`forced`: the one that must be called)."""
    listed = "\n".join(  # compact: the prompt's positions are the model's to spend
        json.dumps(
            {"name": t.name, "description": t.description or "", "parameters": t.parameters}, separators=(",", ":")
        )
        for t in tools
    )
    which = forced if forced is not None else "one of them"
    return f'Functions:\n{listed}\nCall {which}: reply {{"name": ..., "arguments": {{...}}}} only.'


def call_spec(tools: Sequence[FunctionTool], forced: str | None) -> GuidedSpec:
    """The grammar of one call: of `forced`, or (None) of any tool. `InvalidRequestError` for an unknown name."""
    chosen = list(tools)
    if forced is not None:
        chosen = [t for t in tools if t.name == forced]
        if not chosen:
            names = ", ".join(t.name for t in tools)
            raise InvalidRequestError(
                f"tool_choice names the function {forced!r}, which is not among the tools ({names})",
                field="tool_choice",
            )
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return GuidedSpec("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")), strict=True)


def parse_call(text: str) -> dict[str, Any] | None:
    """OpenAI's `tool_calls` entry for a constrained output `text` (None if it is not a whole call: cut by
    max_tokens or a stop string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])},
    }


def followup_text(role: str, content: str, tool_calls: Sequence[tuple[str, str, str]], tool_call_id: str | None) -> str:
    """A history message in the generic format: an assistant's calls as the JSON it was made to write (id, name,
    arguments), a tool result with the call it answers."""
    if role == "tool":
        return f"Result of function call {tool_call_id}:\n{content}"
    calls = []
    for call_id, name, args in tool_calls:
        try:
            arguments = json.loads(args or "{}")
        except ValueError:
            raise InvalidRequestError(f"tool call {call_id!r}: its arguments are not JSON", field="messages") from None
        calls.append(json.dumps({"name": name, "arguments": arguments}))
    return "\n".join([content, *calls]) if content else "\n".join(calls)
