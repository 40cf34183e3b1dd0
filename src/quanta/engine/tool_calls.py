"""OpenAI tool calls: the grammar a call is generated under, the prompt for templates without tools, and the
parse of generated text back into ``tool_calls``.

A call is written the way the model's chat template teaches it (``ToolCallFormat``): Qwen2.5 / Hermes wrap
``{"name": ..., "arguments": {...}}`` in ``<tool_call>`` tags (one or more calls); Llama-3.x answers with the
bare ``{"name": ..., "parameters": {...}}``; any other model gets the bare ``{"name": ..., "arguments": {...}}``
and, when its template ignores ``tools``, a system message that describes the tools and that format. The
grammar forces the call's JSON shape and each function's parameter schema; with ``tool_choice="auto"`` free text
is allowed and a call is enforced from the moment the model starts one.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from quanta.engine.constraint import Grammar
from quanta.tokenizer import Tokenizer
from quanta.tokenizer.vocab import TokenAttr

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_LLAMA_TOOL_PROMPT = re.compile(r'parameters\\?": dictionary of argument name')  # the quote may be escaped
_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes a tool call: the call's JSON keys and the tags around each call."""

    name: str
    arguments_key: str  # "arguments" or "parameters"
    open_tag: str = ""  # "<tool_call>": calls are tagged, several may follow each other
    close_tag: str = ""

    @property
    def tagged(self) -> bool:
        return bool(self.open_tag)


HERMES = ToolCallFormat("hermes", "arguments", "<tool_call>", "</tool_call>")  # Qwen2.5, Hermes, SmolLM3
LLAMA3_JSON = ToolCallFormat("llama3_json", "parameters")  # Llama 3.1 / 3.2 / 3.3 JSON tool calling
GENERIC_JSON = ToolCallFormat("json", "arguments")


@dataclass(frozen=True)
class Function:
    """One tool of a request, checked: its name, description and JSON schema of the arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def as_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


def tool_call_format(chat_template: str) -> ToolCallFormat:
    """The format a chat template teaches: tagged calls where it mentions ``<tool_call>``, Llama's JSON where it
    asks for ``"parameters": dictionary of argument name ...`` (Llama 3.1 to 4), else the generic JSON call."""
    if "<tool_call>" in chat_template:
        return HERMES
    if _LLAMA_TOOL_PROMPT.search(chat_template):
        return LLAMA3_JSON
    return GENERIC_JSON


def template_takes_tools(chat_template: str) -> bool:
    """Whether the Jinja template reads the ``tools`` variable (Qwen2.5's and Llama-3.x's do)."""
    try:
        ast = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def parse_tools(tools: Any) -> list[Function]:
    """OpenAI's ``tools`` list checked (``ValueError`` saying what is wrong) into ``Function`` entries."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ValueError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    functions: list[Function] = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                              Mapping):
            raise ValueError(f'tools[{k}] must be {{"type": "function", "function": {{...}}}}')
        spec = tool["function"]
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"tools[{k}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if any(f.name == name for f in functions):
            raise ValueError(f"tools[{k}]: the function name {name!r} is used twice")
        parameters = spec.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, Mapping):
            raise ValueError(f"tools[{k}].function.parameters must be a JSON schema object")
        try:
            Grammar.json_schema(parameters)
        except ValueError as e:
            raise ValueError(f"tools[{k}] ({name}): parameters: {e}") from None
        description = spec.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"tools[{k}].function.description must be a string")
        functions.append(Function(name, description, parameters))
    return functions


def chosen_functions(functions: Sequence[Function], tool_choice: Any) -> tuple[list[Function], bool]:
    """The functions a call may name under ``tool_choice`` and whether a call is required: "auto" (the default
    with tools) → all, optional; "required" → all, required; a named function → that one, required; "none" (the
    default without tools) → none."""
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return [], False
    if tool_choice in ("auto", "required"):
        if not functions:
            raise ValueError(f'tool_choice "{tool_choice}" needs tools')
        return list(functions), tool_choice == "required"
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
        chosen = [f for f in functions if f.name == name]
        if not chosen:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        return chosen, True
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                     '{"name": ...}}')


def tool_call_grammar(functions: Sequence[Function], tool_choice: Any, fmt: ToolCallFormat, *,
                      parallel: bool = True, tokenizer: Tokenizer | None = None) -> Grammar | None:
    """The grammar of the reply: one call (or, in a tagged format with ``parallel``, several) of the chosen
    functions with arguments that follow their schema; with "auto" also free text, and a call is enforced once
    the model starts one. None under "none". ``tokenizer``: a tag that is a control token there is matched as
    that token."""
    chosen, required = chosen_functions(functions, tool_choice)
    if not chosen:
        return None
    names = " | ".join(f"fn_{k}" for k in range(len(chosen)))
    rules = [f'call_body: "{{\\"name\\": " ({names}) "}}"']
    for k, function in enumerate(chosen):
        head = json.dumps(f"{json.dumps(function.name)}, {json.dumps(fmt.arguments_key)}: ")
        rules.append(f"fn_{k}: {head} @args_{k}")
    if fmt.tagged:
        open_tag, close_tag = _tag(fmt.open_tag, tokenizer), _tag(fmt.close_tag, tokenizer)
        rules.append(f'call_rest: "\\n" call_body "\\n" {close_tag}')
        rules.append(f"call: {open_tag} call_rest")
        more = ' ("\\n" call)*' if parallel else ""
        if required:
            rules.insert(0, f"start: call{more}")
        else:
            trigger = f'call_head[lazy]: TEXT {open_tag}' if open_tag.startswith('"') else None
            start = f"start: TEXT | call_head call_rest{more}" if trigger else f"start: TEXT | TEXT call{more}"
            rules[:0] = [start] + ([trigger] if trigger else []) + ["TEXT: /(.|\\n)*/"]
    elif required:
        rules.insert(0, "start: call_body")
    else:
        rules[:0] = ["start: call_body | TEXT", "TEXT: /([^{](.|\\n)*)?/"]  # text that does not open a call
    schemas = {f"args_{k}": f.parameters for k, f in enumerate(chosen)}
    return Grammar.lark("\n".join(rules) + "\n", json_schemas=schemas)


def _tag(text: str, tokenizer: Tokenizer | None) -> str:
    """A tag in Lark: the special token of that text where the vocabulary has one, else the literal string."""
    if tokenizer is not None:
        token_id = tokenizer.vocab.token_to_id.get(text)
        if token_id is not None and tokenizer.vocab.attrs[token_id] & int(TokenAttr.CONTROL):
            return text
    return json.dumps(text)


def parse_tool_calls(text: str, fmt: ToolCallFormat,
                     functions: Sequence[Function]) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's text content (None when empty) and its OpenAI ``tool_calls`` entries (``id``, ``type``,
    ``function``: ``name`` and ``arguments`` as a JSON string). Text that is not a well-formed call of a known
    function stays content."""
    known = {f.name for f in functions}
    if fmt.tagged:
        calls, starts = [], []
        pattern = re.compile(re.escape(fmt.open_tag) + r"\s*(.*?)\s*(?:" + re.escape(fmt.close_tag) + r"|\Z)",
                             re.DOTALL)
        for match in pattern.finditer(text):
            call = _call(match.group(1), fmt, known)
            if call is not None:
                calls.append(call)
                starts.append(match.start())
        content = text[:starts[0]] if starts else text
    else:
        stripped = text.strip().removeprefix("<|python_tag|>")
        call = _call(stripped, fmt, known) if stripped.startswith("{") else None
        calls, content = ([call], "") if call is not None else ([], text)
    return (content.strip() or None), calls


def _call(body: str, fmt: ToolCallFormat, known: set[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    arguments = value.get(fmt.arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def tools_system_prompt(functions: Sequence[Function], fmt: ToolCallFormat) -> str:
    """A system-message text that describes the tools and how to call them, for templates that ignore ``tools``."""
    listing = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    call = f'{{"name": <function-name>, "{fmt.arguments_key}": <args-json-object>}}'
    if fmt.tagged:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                f"{fmt.open_tag}{fmt.close_tag} XML tags:\n{fmt.open_tag}\n{call}\n{fmt.close_tag}")
    return ("You have access to the following functions:\n\n"
            f"{listing}\n\nTo call a function, reply with only a JSON object of the form {call}, and nothing else.")


def prepare_chat(messages: Sequence[Mapping[str, Any]], functions: Sequence[Function], chat_template: str,
                 fmt: ToolCallFormat) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument to render a tool-using chat with: the template's own tool support
    where it has it (content as strings, arguments as objects, as HF templates expect), else the tools described
    in the system message, earlier calls written in ``fmt`` and ``tool`` results as user turns."""
    if template_takes_tools(chat_template):
        return [_for_template(m) for m in messages], ([f.as_tool() for f in functions] or None)
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [_render_call(c, fmt) for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({**message, "content": content})
    if functions:
        prompt = tools_system_prompt(functions, fmt)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _render_call(call: Mapping[str, Any], fmt: ToolCallFormat) -> str:
    function = call.get("function") or {}
    body = json.dumps({"name": function.get("name"), fmt.arguments_key: _arguments_object(function)},
                      ensure_ascii=False)
    return f"{fmt.open_tag}\n{body}\n{fmt.close_tag}" if fmt.tagged else body


def _arguments_object(function: Mapping[str, Any]) -> Any:
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _for_template(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as HF templates expect it: content a string, a call's arguments an object."""
    out = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c.get("function", {}),
                                                "arguments": _arguments_object(c.get("function", {}))}}
                             for c in message["tool_calls"]]
    return out
