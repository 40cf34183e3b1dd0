"""Chat templates: render a GGUF's Jinja ``tokenizer.chat_template`` safely, or a built-in one.

A template inside a GGUF is untrusted input (CVE-2024-34359 was remote code execution through exactly this), so
it runs in a bounded Jinja sandbox (``template_sandbox``): time, steps, output and the size of every value are
capped, and any failure, at compile time or while rendering, is a ``ChatTemplateError``. The variables are those
HF ``transformers`` and llama.cpp pass: ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``tools``, ``raise_exception``, ``strftime_now``.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2

from quanta.tokenizer.errors import ChatTemplateError, RenderTooLongError
from quanta.tokenizer.template_budget import MAX_OUTPUT, check_size, refused, render_budget, step
from quanta.tokenizer.template_estimates import strftime_size
from quanta.tokenizer.template_sandbox import BoundedSandbox, sandboxed_environment

RENDER_SECONDS = 5.0
MAX_INDENT = 1024  # tojson's indent (templates use 2 or 4)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Gemma's turns: "model" for the assistant, the system prompt folded into the first user turn.
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(prefix='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% set ns.prefix = message['content'] + '\\n\\n' %}"
    "{%- else %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + ns.prefix + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- set ns.prefix = '' %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def builtin_template(architecture: str | None, token_to_id: dict[str, int]) -> str:
    """The fallback for a GGUF without a template: Gemma's turns for Gemma models, else ChatML."""
    if (architecture or "").startswith("gemma") or "<start_of_turn>" in token_to_id:
        return GEMMA_TEMPLATE
    return CHATML_TEMPLATE


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """``json.dumps`` as HF transformers calls it, encoded in pieces so that an expansion stops at the size limit."""
    pad = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if pad > MAX_INDENT:
        raise refused(f"a JSON indent of {pad} exceeds {MAX_INDENT}")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    parts, size = [], 0
    for i, part in enumerate(encoder.iterencode(value)):
        size += len(part)
        check_size(size, "tojson")
        parts.append(part)
        if i % 256 == 255:
            step()
    return "".join(parts)


def _raise_exception(message: Any) -> None:
    text = str(message)
    raise ChatTemplateError(f"chat template raised: {text[:500]}{'...' if len(text) > 500 else ''}")


def _strftime_now(fmt: str) -> str:
    check_size(strftime_size(fmt), "strftime_now")
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> BoundedSandbox:
    return sandboxed_environment({"tojson": _tojson},
                                 {"raise_exception": _raise_exception, "strftime_now": _strftime_now})


class ChatTemplate:
    """A compiled chat template; ``render`` returns the prompt text or raises ``ChatTemplateError``."""

    def __init__(self, source: str, time_limit: float = RENDER_SECONDS):
        self.source, self.time_limit = source, time_limit
        try:
            self._template = _environment().compile_checked(source)
        except ChatTemplateError:
            raise
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from None
        except RecursionError:
            raise ChatTemplateError("chat template refused: it is nested too deeply to compile") from None
        except Exception as e:  # noqa: BLE001 - CPython's compiler on generated code: SyntaxError, MemoryError, ...
            raise ChatTemplateError(f"chat template could not be compiled: {type(e).__name__}: {e}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, bos_token: str = "", eos_token: str = "",
               max_chars: int = MAX_OUTPUT, **extra: Any) -> str:
        """The prompt text; a render longer than ``max_chars`` characters is refused as soon as it gets there."""
        variables = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools,
                     "bos_token": bos_token, "eos_token": eos_token, **extra}
        max_chars = min(max_chars, MAX_OUTPUT)
        chunks = None
        try:
            with render_budget(self.time_limit, variables):
                chunks = self._template.generate(**variables)
                out, size = [], 0
                for chunk in chunks:
                    size += len(chunk)
                    if size > max_chars:
                        raise RenderTooLongError(f"chat template refused: its output exceeds {max_chars:,} characters")
                    out.append(chunk)
                return "".join(out)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template refused: unsafe operation ({e})") from None
        except RecursionError:
            raise ChatTemplateError("chat template refused: its recursion is too deep") from None
        except Exception as e:  # noqa: BLE001 - the template is input: whatever it does wrong is the template's error
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_short(e)}") from None
        finally:
            if chunks is not None:
                chunks.close()


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) <= 500 else text[:500] + "..."
