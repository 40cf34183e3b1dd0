"""The Jinja environment chat templates run in: Jinja's immutable sandbox plus a budget on what a render may cost.

The sandbox forbids ``_``-attributes, unsafe callables and mutation of the inputs (we make such an access fail at
once instead of rendering as ""). On top of it, every place where template code can build a value or spend time
is routed through a check against the render's budget (``template_budget``), *before* the value is built:
operators (``+ * ** %`` and ``~``), list/tuple/dict literals, calls, filters, ``str.format`` fields, output
expressions, the joins behind macros and set blocks, and every loop iteration, which also counts a step and
reads the clock. Generators given to a call are drawn into bounded lists first. Templates are compiled with
bounded nesting (CPython refuses 20 nested loops, and deep blocks overflow the compiler's stack).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from string import Formatter
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from markupsafe import EscapeFormatter, Markup

from quanta.tokenizer.template_budget import (
    MAX_INT_BITS, MAX_VALUE, bounded, check_size, emit, refused, rendering, step, text_size, weight,
)
from quanta.tokenizer.template_estimates import check_filter, format_field_size, method_size, printf_size

MAX_SOURCE = 1 << 16  # characters of a template (the largest published ones are ~20k)
MAX_NODES = 1 << 13  # Jinja compiles ~5k nodes a second (real templates have a few thousand)
MAX_NESTING = 40  # nested statements (if, for, macro, ...)
MAX_LOOP_NESTING = 12  # nested for loops (CPython allows 20 nested blocks in one function)
MAX_DEPTH = 100  # nested nodes, expressions included
_JINJA_CALL_KWARGS = ("_loop_vars", "_block_vars")  # what Jinja's generated code passes to every call


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` and list/tuple/dict literals to checked calls (neither goes through the sandbox)."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _bounded_literal(self, visit: Callable, node: nodes.Expr, frame: Any) -> None:
        self.write("environment.bounded_literal(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Any) -> None:
        self._bounded_literal(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Any) -> None:
        self._bounded_literal(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Any) -> None:
        if node.ctx == "store":  # an assignment target, not a value
            super().visit_Tuple(node, frame)
        else:
            self._bounded_literal(super().visit_Tuple, node, frame)


class CheckedIterable:
    """A loop's iterable: each item costs a step (so loops are bounded in time), ``len`` passes through."""

    def __init__(self, iterable: Any):
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable:
            step()
            yield item

    def __len__(self) -> int:
        return len(self.iterable)


def checked_iter(iterable: Any) -> CheckedIterable:
    return CheckedIterable(iterable)


def drawn(value: Any) -> Any:
    """An iterator (a generator from ``map``/``select``/...) drawn into a list, within the size limit."""
    if not isinstance(value, Iterator):
        return value
    items, size = [], 0
    for item in value:
        step()
        size += 1 + weight(item)
        check_size(size, "drawing a generator")
        items.append(item)
    return items


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` with each field's size added up (and checked) before it is formatted."""

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self.size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        step()
        self.size += format_field_size(value, format_spec)
        check_size(self.size, "a str.format")
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


class BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    checked_iter = staticmethod(checked_iter)

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        step()
        if operator_name == "*":
            _check_product(left, right)
            return left * right
        if operator_name == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and left.bit_length() * right > MAX_INT_BITS:
                raise refused(f"a power would build an integer over {MAX_INT_BITS:,} bits")
            return left ** right
        if operator_name == "+":
            if not _is_number(left) or not _is_number(right):
                check_size(weight(left) + weight(right), "a concatenation")
            return left + right
        if isinstance(left, str):
            check_size(printf_size(left, right), "a %-format")
        return left % right

    def getattr(self, obj: Any, attribute: str) -> Any:
        step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        step()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Fail at once (Jinja's default is an undefined value that renders as "")."""
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` and ``format_map`` reach templates through this wrapper, with each field bounded."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) \
                or value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
            return None
        template = value.__self__
        formatter: Formatter = (_BoundedEscapeFormatter(self, escape=template.escape) if isinstance(template, Markup)
                                else _BoundedFormatter(self))
        is_map = value.__name__ == "format_map"

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            return type(template)(formatter.vformat(template, args, kwargs))

        return functools.update_wrapper(bounded_format, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        step()
        if __obj is checked_iter:
            return checked_iter(*args)
        args = tuple(map(drawn, args))
        kwargs = {k: drawn(v) for k, v in kwargs.items()}
        visible = {k: v for k, v in kwargs.items() if k not in _JINJA_CALL_KWARGS}
        size = method_size(getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None), args, visible)
        check_size(size, f"{getattr(__obj, '__name__', 'a call')}()")
        return bounded(super().call(__context, __obj, *args, **kwargs))

    @staticmethod
    def bounded_concat(parts: tuple) -> str:
        step()
        check_size(sum(map(text_size, parts)), "a ~ concatenation")
        return "".join(map(str, parts))

    @staticmethod
    def bounded_literal(value: Any) -> Any:
        step()
        return bounded(value, "a literal")

    @staticmethod
    def concat(parts: Any) -> str:
        """Joins the output captured by macros, call, filter and set blocks (Jinja's ``environment.concat``)."""
        parts = parts if isinstance(parts, list) else list(parts)
        check_size(sum(map(len, parts)), "captured output")
        return "".join(parts)

    def compile_checked(self, source: str) -> jinja2.Template:
        """The template for ``source``, refused when too large or too deeply nested; loops are checked."""
        if not isinstance(source, str):
            raise refused(f"the template is a {type(source).__name__}, not text")
        if len(source) > MAX_SOURCE:
            raise refused(f"the template has {len(source):,} characters (at most {MAX_SOURCE:,})")
        tree = self.parse(source)
        _check_nesting(tree)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("checked_iter"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        return self.from_string(tree)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, complex))


def _check_product(left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise refused(f"a product would build an integer over {MAX_INT_BITS:,} bits")
        return
    count, sequence = (right, left) if isinstance(right, int) else (left, right)
    if isinstance(count, int) and not _is_number(sequence):
        check_size(weight(sequence) * max(count, 0), "a repetition")


_STATEMENTS_NESTING = (nodes.For, nodes.If, nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.With,
                       nodes.Block, nodes.AssignBlock, nodes.Scope, nodes.ScopedEvalContextModifier)


def _check_nesting(tree: nodes.Node) -> None:
    """Refuse templates too big to compile quickly, or nested deeper than CPython's compiler (or Jinja's code
    generator) can take."""
    stack, count = [(tree, 0, 0, 0)], 0
    while stack:
        node, depth, blocks, loops = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise refused(f"it has more than {MAX_NODES:,} syntax nodes")
        if isinstance(node, _STATEMENTS_NESTING):
            blocks += 1
            loops += isinstance(node, nodes.For)
        if depth > MAX_DEPTH or blocks > MAX_NESTING or loops > MAX_LOOP_NESTING:
            what = ("for loops", MAX_LOOP_NESTING) if loops > MAX_LOOP_NESTING else \
                ("blocks", MAX_NESTING) if blocks > MAX_NESTING else ("expressions", MAX_DEPTH)
            raise refused(f"it nests {what[0]} more than {what[1]} deep")
        stack.extend((child, depth + 1, blocks, loops) for child in node.iter_child_nodes())


class GenerationTag(jinja2.ext.Extension):
    """HF transformers' ``{% generation %}...{% endgeneration %}`` marks the assistant's text for training masks;
    rendering only runs its body (in its own scope, as HF's call block does)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _bounded_filter(name: str, f: Callable) -> Callable:
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # the context Jinja passes first

    @functools.wraps(f)  # keeps Jinja's pass_context / pass_eval_context marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not rendering():  # Jinja folds filters of constants at compile time, outside any budget: not here
            raise RuntimeError("filters run only while rendering")
        step()
        args = (*args[:skip], *map(drawn, args[skip:]))
        kwargs = {k: drawn(v) for k, v in kwargs.items()}
        check_filter(name, args[skip:], kwargs)
        return bounded(f(*args, **kwargs), f"the {name} filter")

    return wrapper


def _finalize(value: Any) -> Any:
    """Every ``{{ expression }}``: its text is bounded before ``str`` builds it, and counted."""
    step()
    size = text_size(value)
    check_size(size, "an output expression")
    emit(size if isinstance(value, str) else weight(value))
    return value


def sandboxed_environment(filters: dict[str, Callable], globals_: dict[str, Any]) -> BoundedSandbox:
    """A bounded sandbox with HF transformers' settings (trim_blocks, lstrip_blocks, loop controls, the generation
    tag); only
    ``range``, ``dict``, ``namespace`` and ``globals_`` are visible to templates."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationTag],
                         autoescape=False, finalize=_finalize)
    env.filters.update(filters)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals = {"range": env.globals["range"], "dict": dict, "namespace": env.globals["namespace"], **globals_}
    return env


__all__ = ["BoundedSandbox", "MAX_VALUE", "sandboxed_environment"]
