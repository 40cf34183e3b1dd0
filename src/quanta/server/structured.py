"""Structured output for the server: ``response_format`` and llama.cpp's ``grammar`` as grammars, and OpenAI's tool
calls (``tools``, ``tool_choice``, ``tool`` messages) through quanta.engine.tool_calls.

A tool-using chat is rendered by the model's own template when it takes ``tools`` (else the tools are described
in the system message), generated under the calls' grammar (free text or a call with "auto"), and its text is
parsed back into ``tool_calls``. Streamed, the text before a call goes out as it comes; from the call's first
character on it is held and sent as one ``tool_calls`` delta when the choice ends (OpenAI's shape: a first delta
with the call's id, type and name, then its arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quanta.engine.constraint import Grammar
from quanta.engine.tool_calls import (Function, ToolCallFormat, chosen_functions, parse_tool_calls, parse_tools,
                                      prepare_chat, tool_call_format, tool_call_grammar)
from quanta.server.errors import invalid


@dataclass(frozen=True)
class ToolPlan:
    """The functions a reply may call and the format the model writes calls in."""

    functions: tuple[Function, ...]
    fmt: ToolCallFormat

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The reply's content (None when empty) and its ``tool_calls``."""
        return parse_tool_calls(text, self.fmt, self.functions)

    def call_start(self, text: str) -> int:
        """Where a call begins in ``text`` (its length when none does yet); a possible start is held back."""
        if self.fmt.tagged:
            at = text.find(self.fmt.open_tag)
            if at >= 0:
                return at
            for n in range(min(len(self.fmt.open_tag) - 1, len(text)), 0, -1):  # a tag still arriving
                if text.endswith(self.fmt.open_tag[:n]):
                    return len(text) - n
            return len(text)
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") or not stripped else len(text)


def output_grammar(response_format: dict[str, Any] | None, grammar: str | None) -> Grammar | None:
    """The grammar ``response_format`` or ``grammar`` (GBNF or Lark) asks for; a 400 for a bad one."""
    if response_format is not None and grammar is not None:
        raise invalid("give response_format or grammar, not both", "grammar")
    try:
        if grammar is not None:
            return Grammar.gbnf(grammar)
        return Grammar.from_response_format(response_format)
    except ValueError as e:
        raise invalid(str(e), "grammar" if grammar is not None else "response_format") from None


def tool_chat(messages: list[dict[str, Any]], tools: list[Any] | None, tool_choice: Any, parallel: bool,
              chat_template: str | None, tokenizer: Any) -> tuple[list[dict[str, Any]], Any, ToolPlan | None,
                                                                   Grammar | None]:
    """The messages and ``tools`` argument to render, the plan for the reply's calls (None: no calls possible)
    and their grammar, for a chat with ``tools`` or with earlier calls and results in its messages."""
    try:
        functions = parse_tools(tools) if tools else []
        chosen, _ = chosen_functions(functions, tool_choice)
    except ValueError as e:
        raise invalid(str(e), "tool_choice" if "tool_choice" in str(e) else "tools") from None
    fmt = tool_call_format(chat_template or "")
    messages, tools_arg = prepare_chat(messages, functions, chat_template or "", fmt)
    if not chosen:
        return messages, tools_arg, None, None
    try:
        grammar = tool_call_grammar(functions, tool_choice, fmt, parallel=parallel, tokenizer=tokenizer)
    except ValueError as e:
        raise invalid(str(e), "tools") from None
    return messages, tools_arg, ToolPlan(tuple(chosen), fmt), grammar


class ToolStream:
    """One streamed choice of a tool-using chat: what of its text may go out now, and its calls at the end."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` already streamed as content

    def push(self, piece: str) -> str:
        """Take a text delta; returns the content that can be streamed now."""
        self.text += piece
        out = self.text[self.sent:self.plan.call_start(self.text)] if self.sent < len(self.text) else ""
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: the content still to stream and the calls (none: the held text was content after all)."""
        content, calls = self.plan.parse(self.text)
        if not calls:
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            return rest, []
        streamed = self.text[:self.sent]
        rest = (content or "")[len(streamed.strip()):] if content and content.startswith(streamed.strip()) else ""
        return rest, calls
