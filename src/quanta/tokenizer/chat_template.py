"""Chat templates: render a GGUF's Jinja ``tokenizer.chat_template`` safely, or a built-in one.

A template inside a GGUF is untrusted input (CVE-2024-34359 was remote code execution through exactly this), so
it runs in a bounded Jinja sandbox (``template_sandbox``), its output is capped, and any failure is a
``ChatTemplateError``. The variables are those HF ``transformers`` and llama.cpp pass: ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``, ``raise_exception``, ``strftime_now``.
"""

from __future__ import annotations

import datetime
import functools
import json
import sys
from typing import Any

import jinja2

from quanta.tokenizer.errors import ChatTemplateError
from quanta.tokenizer.template_sandbox import MAX_WEIGHT, BoundedSandbox, Deadline, refused, sandboxed_environment

RENDER_SECONDS = 5.0

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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
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
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, bos_token: str = "", eos_token: str = "",
               **extra: Any) -> str:
        variables = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools,
                     "bos_token": bos_token, "eos_token": eos_token, **extra}
        previous = sys.gettrace()
        sys.settrace(Deadline(self.time_limit))
        try:
            out, size = [], 0
            for chunk in self._template.generate(**variables):
                size += len(chunk)
                if size > MAX_WEIGHT:
                    raise refused(f"its output exceeds {MAX_WEIGHT} characters")
                out.append(chunk)
            return "".join(out)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template refused: unsafe operation ({e})") from None
        except Exception as e:  # the template is input: whatever it does wrong is the template's error
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            sys.settrace(previous)
