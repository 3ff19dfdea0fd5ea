"""`tool_choice: "auto"`: which tool-call format a checkpoint's chat template teaches, and the model's output parsed
into OpenAI's `tool_calls`, whole or streamed.

A template that renders `tools` teaches its model one way to write calls; `detect_format` reads the template's
source for it:

* **Hermes / Qwen** (`<tool_call>` in the template): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call (parallel calls: several blocks);
* **Mistral** (`[TOOL_CALLS]`): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (parallel: the array),
  or the newer spelling `[TOOL_CALLS]name[ARGS]{...}` (parallel: one after another);
* **Llama 3 JSON** (the template tells the model to answer `{"name": function name, "parameters": ...}`, or
  has `<|python_tag|>`): the reply *is* a call, `{"name": ..., "parameters": {...}}`, several joined by `;`.

Text before the first marker is the reply's `content`; after it, every top-level JSON object is one call (what
lies between them, `</tool_call>`, `,`, `;`, `]`, is punctuation). `ToolCallStream` scans the text as it
arrives and yields OpenAI's stream deltas: content until a marker appears (a partial marker is held back), then
per call one delta with its id and name, then its arguments in pieces as the model writes them. The whole-reply
parser (`parse_reply`) is the same scanner fed once, so a streamed reply's pieces join to the unstreamed one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import uuid
from typing import Any

CONTENT = "content"


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """A template's tool-call format: the texts that open the calls (any of them), whether a reply that *starts*
    with a JSON object is a call (Llama 3's bare JSON), and the text that separates a call's name from its
    arguments object where the name is written bare before it (Mistral's newer `name[ARGS]{...}`)."""

    name: str  # "hermes", "mistral", "llama3_json"
    markers: tuple[str, ...]
    bare_json: bool = False
    args_marker: str | None = None

    @property
    def texts(self) -> tuple[str, ...]:
        """Every text of the format's syntax (the detokenizer keeps those that are special tokens)."""
        return (*self.markers, *(() if self.args_marker is None else (self.args_marker,)))


HERMES = ToolFormat("hermes", ("<tool_call>",))
MISTRAL = ToolFormat("mistral", ("[TOOL_CALLS]",), args_marker="[ARGS]")
LLAMA3_JSON = ToolFormat("llama3_json", ("<|python_tag|>",), bare_json=True)
FORMATS = (HERMES, MISTRAL, LLAMA3_JSON)

# Llama 3.1's template asks for `{"name": function name, "parameters": dictionary of argument name and its value}`.
_LLAMA3_HINT = re.compile(r'"name"\s*:\s*function name|"parameters"\s*:\s*dictionary|<\|python_tag\|>')


@functools.lru_cache(maxsize=16)
def detect_format(template_source: str | None) -> ToolFormat | None:
    """The tool-call format `template_source` teaches (None: it renders no tools, or in no format parsed here)."""
    if not template_source or not re.search(r"\btools\b", template_source):
        return None
    if "<tool_call>" in template_source:
        return HERMES
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if _LLAMA3_HINT.search(template_source):
        return LLAMA3_JSON
    return None


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class _Call:
    """One call being read: the object's text so far and what of it went out."""

    index: int
    text: str = ""
    name: str | None = None  # once read (the name is the object's first key, or came before `[ARGS]`)
    args_at: int | None = None  # where the arguments' value starts in `text`
    bare_args: bool = False  # the object *is* the arguments (`name[ARGS]{...}`)
    args_sent: int = 0  # characters of the arguments value sent
    args_done: bool = False  # the value closed: what follows it in the object is not the arguments'
    id: str = dataclasses.field(default_factory=_new_id)


_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(,\s*"(?:arguments|parameters)"\s*:\s*(?=\S))?')


class ToolCallStream:
    """Reads one reply in `fmt` as it arrives; `push` and `finish` return OpenAI's delta pieces.

    Each piece is `("content", text)` or a `tool_calls` entry dict as OpenAI streams it: `{"index", "id",
    "type", "function": {"name", "arguments": ""}}` once per call, then `{"index", "function": {"arguments":
    piece}}`.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._pending = ""  # text not yet decided (a possible marker's start), before the first marker
        self._in_calls = False
        self._started = False  # any non-space text seen (Llama 3's bare JSON must come first)
        self._depth = 0  # JSON nesting inside the calls region
        self._in_string = False
        self._escaped = False
        self._call: _Call | None = None
        self._between = ""  # text between calls, while it may name the next one (`name[ARGS]`)
        self._named: str | None = None  # the name read before `[ARGS]`, for the object that follows
        self.calls: list[dict[str, Any]] = []  # the finished calls, as OpenAI's `tool_calls` entries

    def push(self, text: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if not self._in_calls:
            text = self._before_calls(self._pending + text, out)
            self._pending = "" if self._in_calls else text
            if not self._in_calls:
                return out
        self._scan(text, out)
        return out

    def finish(self) -> list[tuple[str, Any]]:
        """The rest at the end of the reply: held text, and a call the reply broke off in (its name, if it had
        none yet, then what there is of its arguments)."""
        out: list[tuple[str, Any]] = []
        if not self._in_calls and self._pending:
            out.append((CONTENT, self._pending))
            self._pending = ""
        call = self._call
        if call is not None:
            if call.name is None:
                out.append((CONTENT, call.text))
            else:
                start = call.args_at if call.args_at is not None else len(call.text)
                rest = call.text[start + call.args_sent :]
                if rest:
                    out.append(("tool_call", {"index": call.index, "function": {"arguments": rest}}))
            self._call = None
        return out

    # ---- before the first call: content, a marker held back while it may be one -------------------------------
    def _before_calls(self, text: str, out: list[tuple[str, Any]]) -> str:
        if self.fmt.bare_json and not self._started:
            stripped = text.lstrip()
            if not stripped:
                return text
            self._started = True
            if stripped.startswith("{"):
                self._in_calls = True
                return stripped
        found = [(i, m) for m in self.fmt.markers if (i := text.find(m)) >= 0]
        if found:
            at, marker = min(found)
            if text[:at].strip():
                out.append((CONTENT, text[:at]))
            self._in_calls = True
            return text[at + len(marker) :]
        hold = max((k for m in self.fmt.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        if len(text) > hold:
            out.append((CONTENT, text[: len(text) - hold]))
        return text[len(text) - hold :]

    # ---- the calls region: a JSON scanner, one top-level object per call -----------------------------------------
    def _scan(self, text: str, out: list[tuple[str, Any]]) -> None:
        for ch in text:
            call = self._call
            if call is None:
                if ch == "{":
                    self._open_call(out)
                elif self.fmt.args_marker is not None:
                    self._between += ch
                    if self._between.endswith(self.fmt.args_marker):
                        named = self._between[: -len(self.fmt.args_marker)]
                        for marker in self.fmt.markers:
                            named = named.replace(marker, "")
                        self._named, self._between = named.strip(" \n,"), ""
                continue  # punctuation between calls
            call.text += ch
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_call(call, out)
                    continue
            self._progress(call, out)

    def _open_call(self, out: list[tuple[str, Any]]) -> None:
        call = _Call(len(self.calls), "{")
        self._call, self._depth, self._between = call, 1, ""
        if self._named is not None:  # `name[ARGS]{`: the object is the arguments, the name is known
            call.name, call.args_at, call.bare_args, self._named = self._named, 0, True, None
            out.append(("tool_call", self._opening(call)))
            self._progress(call, out)

    def _progress(self, call: _Call, out: list[tuple[str, Any]]) -> None:
        if call.bare_args:  # every character of the object is the arguments'
            out.append(("tool_call", {"index": call.index, "function": {"arguments": call.text[call.args_sent :]}}))
            call.args_sent = len(call.text)
            return
        if call.args_at is None:
            m = _NAME_FIRST.match(call.text)
            if m is None or not m.group(2):
                return  # the name is not whole yet, or is not the first key (then the call goes out whole at its end)
            call.name = json.loads(f'"{m.group(1)}"')
            call.args_at = m.end()
            out.append(("tool_call", self._opening(call)))
        value = call.text[call.args_at :]
        if call.args_done or not value.startswith(("{", "[")):
            return  # a scalar value goes out whole at the call's end
        # Inside the value (depth >= 2) every character is the arguments'; back at depth 1 the value just closed.
        call.args_done = self._depth == 1
        if len(value) > call.args_sent:
            out.append(("tool_call", {"index": call.index, "function": {"arguments": value[call.args_sent :]}}))
            call.args_sent = len(value)

    def _opening(self, call: _Call) -> dict[str, Any]:
        return {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }

    def _end_call(self, call: _Call, out: list[tuple[str, Any]]) -> None:
        self._call = None
        try:
            value = json.loads(call.text)
        except ValueError:
            value = None
        if call.bare_args and call.name is not None:
            if len(call.text) > call.args_sent:
                out.append(("tool_call", {"index": call.index, "function": {"arguments": call.text[call.args_sent :]}}))
            self.calls.append(
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.text}}
            )
            return
        args_key = next((k for k in ("arguments", "parameters") if isinstance(value, dict) and k in value), None)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or args_key is None:
            if call.name is None:  # not a call after all: its text is content
                out.append((CONTENT, call.text))
            return
        arguments = value[args_key]
        if call.args_at is not None:
            # The value's own text (as streamed): from where it starts to where a decoder says it ends.
            end = json.JSONDecoder().raw_decode(call.text, call.args_at)[1]
            args_text = call.text[call.args_at : end]
        else:
            args_text = json.dumps(arguments)
        if call.name is None:
            call.name = value["name"]
            out.append(("tool_call", self._opening(call)))
        if len(args_text) > call.args_sent:
            out.append(("tool_call", {"index": call.index, "function": {"arguments": args_text[call.args_sent :]}}))
        self.calls.append(
            {"id": call.id, "type": "function", "function": {"name": value["name"], "arguments": args_text}}
        )


def parse_reply(fmt: ToolFormat, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply: its content (None if there is none) and its tool calls (OpenAI's `tool_calls` entries)."""
    stream = ToolCallStream(fmt)
    pieces = stream.push(text) + stream.finish()
    content = "".join(p for kind, p in pieces if kind == CONTENT)
    if not stream.calls:
        return text, []
    return (content if content.strip() else None), stream.calls
