"""The chat template: messages -> one prompt text (both APIs; documented in docs/serving.md).

A checkpoint that carries its own chat template (a GGUF file's `tokenizer.chat_template`, a Hugging
Face directory's `tokenizer_config.json`; see `models.checkpoint.load_chat_template`) is rendered
with it as `transformers`' `apply_chat_template` renders it: Jinja in an immutable sandbox, with
`messages`, `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`. A model without
one gets the built-in template: each message is `### {Role}:\\n{content}\\n\\n` (developer messages
count as system messages), and the prompt ends with `### Assistant:\\n`, where the model continues.
Pure Python (Jinja is imported only to render a checkpoint's template): the client library imports it too.

Message content is text from whoever calls the API, so it must not be able to forge the
template's structure:

* a content line that reads as a role marker (`### User:`, `###assistant :`, any case, any
  number of `#`, leading spaces, however the line is broken: `\\n`, `\\r`, U+2028, ...) is
  *escaped*: a backslash goes before it (`\\### User:`), so it renders as text and no content
  line ever is a marker. Content is otherwise verbatim.
* a special token's text (`<s>`, `</s>`, `<pad>`, `<unk>`, `<mask>`, and any `<|...|>` such as
  `<|endoftext|>`) is *refused* (`InvalidRequestError` on `messages`: 400 / INVALID_ARGUMENT):
  the tokenizer would turn it into the token itself (an end of sequence, a turn boundary), and
  no plain-text spelling of it would mean the same to the model. With a checkpoint's template,
  the texts of that vocabulary's special tokens (`JinjaChatTemplate.special_tokens`, its BOS and
  EOS) are refused too: they are the turn markers such templates write (`<|im_start|>`, ...).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

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


class JinjaChatTemplate(Protocol):
    """A checkpoint's chat template (`models.checkpoint.CheckpointChatTemplate` is one)."""

    @property
    def template(self) -> str: ...

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    @property
    def special_tokens(self) -> Sequence[str]: ...


def _refuse_special_text(index: int, content: str, extra: Sequence[str]) -> None:
    special = _SPECIAL_RE.search(content)
    found = special.group() if special is not None else next((t for t in extra if t in content), None)
    if found is not None:
        raise InvalidRequestError(
            f"messages[{index}] contains {found!r}, the text of a special token: chat content may not hold "
            "special tokens",
            field="messages",
        )


def render_chat(messages: Iterable[tuple[str, str]], template: JinjaChatTemplate | None = None) -> str:
    """`(role, content)` pairs as one prompt, ending where the assistant's reply starts.

    With `template` (a checkpoint's own), its Jinja renders them; else the built-in template. Raises
    ValueError on an unknown role and InvalidRequestError (field `messages`) on content holding a
    special token's text, or that the checkpoint's template refuses (`raise_exception`).
    """
    pairs = list(messages)
    extra = () if template is None else _template_specials(template)
    for index, (role, content) in enumerate(pairs):
        if role not in ROLES:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(ROLES)}")
        _refuse_special_text(index, content, extra)
    if template is not None:
        dicts = [{"role": "system" if role == "developer" else role, "content": content} for role, content in pairs]
        return _render_jinja(template, dicts, None)
    return "".join(f"### {ROLES[role]}:\n{escape_content(content)}\n\n" for role, content in pairs) + GENERATION_PROMPT


def render_structured(
    messages: Sequence[dict[str, Any]], template: JinjaChatTemplate, tools: Sequence[dict[str, Any]] | None
) -> str:
    """OpenAI messages as dicts (tool calls, `role: "tool"` results and all) and `tools` through a checkpoint's
    template, as `transformers`' `apply_chat_template(messages, tools=tools)` passes them: for a template that
    renders tools (`jaxserve.serving.tool_parsers.detect_format`). The same refusals as `render_chat`, applied to
    every text the client wrote: contents, and the names and arguments of earlier calls."""
    extra = _template_specials(template)
    for index, message in enumerate(messages):
        texts = [message.get("content") or ""]
        for call in message.get("tool_calls") or ():
            arguments = call["function"]["arguments"]  # a mapping (OpenAI's JSON text, decoded) or text
            texts += [
                call["function"]["name"],
                arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
            ]
        for text in texts:
            _refuse_special_text(index, text, extra)
    return _render_jinja(template, list(messages), tools)


def _template_specials(template: JinjaChatTemplate) -> tuple[str, ...]:
    texts = (*template.special_tokens, template.bos_token or "", template.eos_token or "")
    return tuple(sorted({t for t in texts if t}, key=len, reverse=True))


def _render_jinja(
    template: JinjaChatTemplate, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> str:
    import jinja2

    try:
        return _compile(template.template).render(
            messages=messages,
            tools=None if tools is None else list(tools),
            add_generation_prompt=True,
            bos_token=template.bos_token or "",
            eos_token=template.eos_token or "",
        )
    except jinja2.TemplateError as e:  # the template's own refusal (raise_exception) or a sandbox refusal
        raise InvalidRequestError(f"the model's chat template refused these messages: {e}", field="messages") from e
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as e:
        # The template's code failed on these messages (e.g. `messages[0]` of a shape it did not expect):
        # the client's 400, with the message, never the server's 500.
        raise InvalidRequestError(
            f"the model's chat template failed on these messages: {type(e).__name__}: {e}", field="messages"
        ) from e


def check_template(template: JinjaChatTemplate) -> None:
    """Compile a checkpoint's template once, at start-up; a ValueError naming the problem if it does not parse."""
    _compile(template.template)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """A checkpoint's template compiled once, in a sandbox: template text is untrusted code."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body."""

        tags = {"generation"}  # noqa: RUF012 - jinja declares it a plain set attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"the model's chat template does not parse (line {e.lineno}): {e.message} (the checkpoint's "
            "tokenizer_config.json `chat_template`, chat_template.jinja, or a GGUF's `tokenizer.chat_template`)"
        ) from e
