"""Request bodies → engine settings: OpenAI's chat and completions fields, validated strictly (wrong types,
out-of-range values, unknown roles, prompts that cannot fit: each a 400 naming the field), then turned into a
``Plan``: the prompt ids, ``SamplingParams`` and ``StopConditions`` of each choice.

Omitted sampling fields take the engine's defaults (those of `quanta run`). Unknown fields are ignored, as most
OpenAI-compatible servers do. Output constraints (``response_format``, ``grammar``) and tool calls (``tools``,
``tool_choice``, ``tool`` messages) become a grammar per choice (structured.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quanta.engine import SamplingParams, StopConditions
from quanta.engine.constraint import Grammar
from quanta.errors import ContextOverflowError, QuantaError
from quanta.server.errors import invalid, not_supported
from quanta.server.structured import ToolPlan, output_grammar, tool_chat

MAX_N = 16
MAX_STOPS = 16
MAX_LOGPROBS = 20
MAX_SEED = 2**63


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _GenerationBody(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM's and llama.cpp's spellings)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None
    grammar: str | None = None
    user: str | None = None


class ChatBody(_GenerationBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None


class CompletionBody(_GenerationBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class TokenizeBody(_Body):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeBody(_Body):
    tokens: list[int]


BodyT = TypeVar("BodyT", bound=_Body)


@dataclass(frozen=True)
class Choice:
    """One sequence to generate; ``leader``: the choice whose prefill it waits for (its prompt's blocks are then
    in the prefix cache), None for the first choice of each prompt."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: StopConditions
    leader: int | None = None
    grammar: Grammar | None = None  # the output must follow it (each choice gets its own Constraint)


@dataclass(frozen=True)
class Plan:
    """What a generation request asks of the engine, and how its answer is written."""

    choices: list[Choice]
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token, None: no logprobs
    echo: list[str]  # completions' echo: each prompt's text (empty: no echo)
    tools: ToolPlan | None = None  # the reply may call these functions: its text is parsed into tool_calls

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt (n choices share theirs)."""
        return sum(len(c.prompt_ids) for c in self.choices if c.leader is None)


# ---- parsing ---------------------------------------------------------------------------------------------------
def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body; 400 for invalid UTF-8, invalid JSON, NaN/Infinity or too deep nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise invalid("the request body nests JSON too deeply") from None
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None


def parse_body(model: type[BodyT], data: Any) -> BodyT:
    """``data`` validated as ``model``; the first problem as a 400 naming its field."""
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        field = errors[0]["loc"][:1]  # the first field at fault; of its errors, the most specific (deepest)
        ours = [(_param(data, err), err) for err in errors if err["loc"][:1] == field]
        param = max((p for p, _ in ours), key=len)
        same = [err for p, err in ours if p == param]
        if same[0]["type"] == "missing":
            raise invalid(f"missing required parameter: '{param}'", param) from None
        messages = dict.fromkeys(err["msg"] for err in same)
        raise invalid(f"invalid value for '{param}': {' or '.join(list(messages)[:3])}", param or None) from None
    except RecursionError:
        raise invalid("the request nests values too deeply") from None


def _param(data: Any, error: Any) -> str:
    """The field path of a validation error (``messages[0].role``), without pydantic's union-member labels."""
    path, node = "", data
    for part in error["loc"]:
        if isinstance(part, int) and isinstance(node, list) and part < len(node):
            path, node = f"{path}[{part}]", node[part]
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            path, node = (f"{path}.{part}" if path else part), node[part]
    if error["type"] == "missing" and error["loc"]:
        path = f"{path}.{error['loc'][-1]}" if path else str(error["loc"][-1])
    return path


# ---- engine settings -------------------------------------------------------------------------------------------
def sampling(body: _GenerationBody, logprobs: int | None, n_vocab: int) -> SamplingParams:
    values: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
                         ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                         ("repeat_penalty", "repetition_penalty"), ("seed", "seed")):
        value = getattr(body, theirs)
        if value is not None:
            values[ours] = value
    if body.top_k is not None:
        values["top_k"] = max(body.top_k, 0)
    if body.logit_bias:
        values["logit_bias"] = _logit_bias(body.logit_bias, n_vocab)
    try:
        return SamplingParams(**values, logprobs=logprobs)
    except ValueError as e:
        raise invalid(str(e)) from None


def _logit_bias(bias: dict[str, float], n_vocab: int) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= n_vocab:
            raise invalid(f"logit_bias keys must be token ids in [0, {n_vocab}), got {key!r}", "logit_bias")
        if not -100 <= value <= 100:
            raise invalid(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        out[int(key)] = float(value)
    return out


def stop_conditions(body: _GenerationBody, max_tokens: int | None, n_ctx: int) -> StopConditions:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise invalid(f"at most {MAX_STOPS} stop sequences, got {len(stops)}", "stop")
    return StopConditions(max_tokens=min(max_tokens or n_ctx, n_ctx), stop=tuple(s for s in stops if s),
                          ignore_eos=body.ignore_eos)


def _choices(prompts: list[list[int]], n: int, params: SamplingParams, stop: StopConditions,
             grammar: Grammar | None) -> list[Choice]:
    out = []
    for ids in prompts:
        lead = len(out)
        for i in range(n):
            p = params if i == 0 or params.seed is None else replace(params, seed=(params.seed + i) % MAX_SEED)
            out.append(Choice(ids, p, stop, None if i == 0 else lead, grammar))
    return out


def _stream_flags(body: _GenerationBody) -> bool:
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    return bool(body.stream_options and body.stream_options.include_usage)


def check_fits(n_tokens: int, n_ctx: int, param: str) -> None:
    if n_tokens == 0:
        raise invalid("the prompt is empty (no tokens)", param)
    if n_tokens >= n_ctx:
        raise invalid(f"This model's maximum context length is {n_ctx} tokens. However, your {param} resulted in "
                      f"{n_tokens} tokens (at least one more is needed for the answer). Please reduce the length "
                      f"of the {param}.", param, "context_length_exceeded")


def chat_plan(body: ChatBody, tokenizer: Any, n_ctx: int, n_vocab: int) -> Plan:
    """The plan of a chat completion: the messages rendered by the model's chat template."""
    grammar = output_grammar(body.response_format, body.grammar)
    include_usage = _stream_flags(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    if body.functions:
        raise not_supported("functions (the deprecated form of tools)", "functions")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = [_template_message(m, i) for i, m in enumerate(body.messages)]
    tools, tools_arg = None, None
    if body.tools or body.tool_choice not in (None, "none") or any(
            m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages, tools_arg, tools, tool_grammar = tool_chat(messages, body.tools, body.tool_choice,
                                                             body.parallel_tool_calls, tokenizer.chat_template,
                                                             tokenizer)
        if tool_grammar is not None and grammar is not None:
            raise invalid("tool calls and response_format or grammar cannot be combined", "response_format")
        grammar = grammar or tool_grammar
    ids = _tokenized(lambda: tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools_arg,
                                                   max_tokens=n_ctx),
                     "messages", "the messages cannot be rendered by the model's chat template")
    check_fits(len(ids), n_ctx, "messages")
    stop = stop_conditions(body, body.max_completion_tokens or body.max_tokens, n_ctx)
    params = sampling(body, logprobs, n_vocab)
    return Plan(_choices([ids], body.n, params, stop, grammar), body.stream, include_usage, logprobs, [], tools)


def _template_message(m: Message, i: int) -> dict[str, Any]:
    if m.role == "function":
        raise not_supported("'function' messages (the deprecated form of 'tool')", f"messages[{i}].role")
    if m.tool_calls and m.role != "assistant":
        raise invalid("only assistant messages have tool_calls", f"messages[{i}].tool_calls")
    if m.content is None:
        if m.role != "assistant":
            raise invalid(f"a {m.role} message needs content", f"messages[{i}].content")
        text = ""
    elif isinstance(m.content, str):
        text = m.content
    else:
        text = "".join(_text_part(part, i, j) for j, part in enumerate(m.content))
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
    if m.tool_calls:
        out["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        out.update(tool_call_id=m.tool_call_id or "", name=m.name or "")
    return out


def _tool_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier call of the conversation, checked: {"id", "type": "function", "function": {"name", "arguments"}}."""
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid('a tool call needs "type": "function" and "function": {"name": ..., "arguments": ...}', where)
    if not isinstance(fn.get("arguments", "{}"), str):
        raise invalid("a tool call's arguments are a JSON string", f"{where}.function.arguments")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}}


def _text_part(part: dict[str, Any], i: int, j: int) -> str:
    where = f"messages[{i}].content[{j}]"
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise invalid("a text part needs a string 'text'", f"{where}.text")
        return part["text"]
    if kind in ("image_url", "input_audio", "file", "image"):
        raise not_supported(f"{kind} content", f"{where}.type")
    raise invalid(f"unknown content part type {kind!r}", f"{where}.type")


def completion_plan(body: CompletionBody, tokenizer: Any, n_ctx: int, n_vocab: int) -> Plan:
    """The plan of a (legacy) completion: each prompt string or token list as it is, n choices for each."""
    grammar = output_grammar(body.response_format, body.grammar)
    include_usage = _stream_flags(body)
    if body.suffix:
        raise not_supported("suffix", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise not_supported("best_of other than n", "best_of")
    if body.echo and body.logprobs is not None:
        raise not_supported("echo with logprobs", "echo")
    prompts = _prompt_list(body.prompt)
    if not prompts:
        raise invalid("the prompt list is empty", "prompt")
    if len(prompts) * body.n > MAX_N:
        raise invalid(f"at most {MAX_N} choices in all (prompts x n), got {len(prompts) * body.n}", "prompt")
    ids = [_prompt_ids(p, tokenizer, n_ctx, n_vocab) for p in prompts]
    echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else []
    stop = stop_conditions(body, body.max_tokens, n_ctx)
    params = sampling(body, body.logprobs, n_vocab)
    return Plan(_choices(ids, body.n, params, stop, grammar), body.stream, include_usage, body.logprobs, echo)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _tokenized(encode: Callable[[], list[int]], field: str, failure: str) -> list[int]:
    """``encode()``'s ids; a text too long for the context, or one the tokenizer refuses, is the client's 400."""
    try:
        return encode()
    except ContextOverflowError as e:
        raise invalid(str(e), field, "context_length_exceeded") from None
    except QuantaError as e:
        raise invalid(f"{failure}: {e}", field) from None


def _prompt_ids(prompt: str | list[int], tokenizer: Any, n_ctx: int, n_vocab: int) -> list[int]:
    if isinstance(prompt, str):
        ids = _tokenized(lambda: tokenizer.encode(prompt, add_special=True, parse_special=True, max_tokens=n_ctx),
                         "prompt", "the prompt cannot be tokenized")
    else:
        ids = check_token_ids(prompt, n_vocab, "prompt")
    check_fits(len(ids), n_ctx, "prompt")
    return ids


def check_token_ids(ids: list[int], n_vocab: int, param: str) -> list[int]:
    bad = [i for i in ids if not 0 <= i < n_vocab]
    if bad:
        raise invalid(f"token ids must be in [0, {n_vocab}), got {bad[0]}", param)
    return ids


__all__ = ["ChatBody", "Choice", "CompletionBody", "DetokenizeBody", "Plan", "TokenizeBody",
           "chat_plan", "completion_plan", "parse_body", "parse_json"]
