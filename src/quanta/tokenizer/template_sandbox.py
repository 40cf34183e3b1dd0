"""The Jinja environment chat templates run in: Jinja's immutable sandbox plus bounds on what a render may cost.

The sandbox already forbids ``_``-attributes, unsafe callables and mutation of the inputs (we make such an access
fail at once instead of rendering as ""). On top of it, every operator, call and filter that could build a huge
string, list or number is checked before it runs (``weight``: characters plus items, nested), integer arguments
(widths, counts) are bounded, and a trace function stops a render that runs past its time budget.
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from quanta.tokenizer.errors import ChatTemplateError

MAX_WEIGHT = 1 << 24  # characters plus items of any value a template builds, and of its output
MAX_INT_ARG = 100_000  # largest integer argument of a call or filter (widths, counts, indents, ranges)
MAX_EXPONENT = 1024

_HUGE_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{6,})|\{[^}]*(\*|\d{6,})")


def refused(what: str) -> ChatTemplateError:
    return ChatTemplateError(f"chat template refused: {what}")


def weight(value: Any, limit: int = MAX_WEIGHT) -> int:
    """Characters of the strings plus items of the containers in ``value``; stops counting past ``limit``."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        total = len(value)
        for item in value:
            if total > limit:
                break
            total += weight(item, limit - total)
        return total
    return 0


def _bounded(value: Any) -> Any:
    if weight(value) > MAX_WEIGHT:
        raise refused(f"it built a value over the size limit ({MAX_WEIGHT} characters and items)")
    return value


def _check_arguments(name: str, owner: Any, args: tuple, kwargs: dict) -> None:
    """Refuse, before running it, a call that would be too costly: huge integers, huge joins or replacements."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARG:
            raise refused(f"integer argument {v} exceeds {MAX_INT_ARG}")
    strings = [a for a in (owner, *args) if isinstance(a, str)]
    if name == "replace" and len(strings) >= 3:
        text, old, new = strings[:3]
        if len(text) + (text.count(old) if old else len(text) + 1) * (len(new) - len(old)) > MAX_WEIGHT:
            raise refused("a replacement would build a value over the size limit")
    if name == "join":
        items = next((a for a in args if isinstance(a, (list, tuple))), ())
        separator = owner if isinstance(owner, str) else next((a for a in args if isinstance(a, str)), "")
        if weight(items) + len(separator) * len(items) > MAX_WEIGHT:
            raise refused("a join would build a value over the size limit")
    if name == "format" and any(_HUGE_FORMAT_WIDTH.search(s) for s in strings):
        raise refused("a format string with a huge or computed width")


class _BoundedConcat(CodeGenerator):
    """Compiles ``a ~ b`` to a checked join (Jinja's own ``str_join`` cannot be intercepted)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedConcat
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "*":
            count = right if isinstance(right, int) else left if isinstance(left, int) else 1
            if (weight(left) + weight(right)) * abs(count) > MAX_WEIGHT:
                raise refused("a multiplication would build a value over the size limit")
            return left * right
        if operator_name == "**":
            if isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
                raise refused(f"exponent {right} exceeds {MAX_EXPONENT}")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() * abs(right) > MAX_WEIGHT:
                raise refused("a power would build a number over the size limit")
            return left ** right
        if operator_name == "+":
            if weight(left) + weight(right) > MAX_WEIGHT:
                raise refused("a concatenation would build a value over the size limit")
            return left + right
        if isinstance(left, str) and _HUGE_FORMAT_WIDTH.search(left):
            raise refused("a %-format with a huge or computed width")
        return _bounded(left % right)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Fail at once (Jinja's default is an undefined value that renders as "")."""
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` reaches templates through this wrapper: refuse huge or computed widths first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _HUGE_FORMAT_WIDTH.search(str(value.__self__)):
            raise refused("a format string with a huge or computed width")
        return wrapped

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_arguments(getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None), args, kwargs)
        return _bounded(super().call(__context, __obj, *args, **kwargs))

    @staticmethod
    def bounded_concat(parts: tuple) -> str:
        if sum(weight(p) for p in parts) > MAX_WEIGHT:
            raise refused("a ~ concatenation would build a value over the size limit")
        return "".join(map(str, parts))


def _bounded_filter(name: str, f: Callable) -> Callable:
    @functools.wraps(f)  # keeps Jinja's pass_context / pass_eval_context marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(name, None, args, kwargs)
        return _bounded(f(*args, **kwargs))

    return wrapper


def sandboxed_environment(filters: dict[str, Callable], globals_: dict[str, Any]) -> BoundedSandbox:
    """A bounded sandbox with HF transformers' settings (trim_blocks, lstrip_blocks, loop controls); only
    ``range``, ``dict``, ``namespace`` and ``globals_`` are visible to templates."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], autoescape=False)
    env.filters.update(filters)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals = {"range": env.globals["range"], "dict": dict, "namespace": env.globals["namespace"], **globals_}
    return env


class Deadline:
    """A trace function on template code that stops the render once its time budget is spent."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.lines = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self.line if frame.f_code.co_filename == "<template>" else None

    def line(self, frame: Any, event: str, arg: Any) -> Any:
        self.lines += 1
        if self.lines & 255 == 0 and time.monotonic() > self.deadline:
            raise refused(f"rendering took longer than {self.seconds:g} s")
        return self.line
