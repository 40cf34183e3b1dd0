"""Sizes of what a call would build, computed from its arguments before it runs (``template_budget`` bounds them).

Only the calls whose result can be much larger than their arguments need an estimate: padding and joining
methods of ``str``/``bytes``, printf-style and ``str.format`` fields, and the Jinja filters that indent, wrap,
pad or repeat. Everything else is checked on its result, which is at most a small multiple of its inputs.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from quanta.tokenizer.template_budget import (
    MAX_COUNT, MAX_SLOW_INPUT, check_count, check_size, refused, text_size, weight,
)

_PRINTF_FIELD = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)
_DIGITS = re.compile(r"\d+")
_STRFTIME_WIDTH = re.compile(r"%[-_0^#]*(\d+)")

# Jinja filters written in Python (or around a backtracking regex): their input is capped, not only their output.
SLOW_FILTERS = frozenset({"wordwrap", "urlize", "striptags", "title", "urlencode", "pprint", "xmlattr", "wordcount"})


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) else default


def printf_size(template: str, args: Any) -> int:
    """An upper bound on ``len(template % args)``; refuses computed (``*``) and huge widths or precisions."""
    size = len(template)
    positional = list(args) if isinstance(args, tuple) else [args]
    index = 0
    for name, width, precision, conversion in _PRINTF_FIELD.findall(template):
        if conversion == "%":
            continue
        if "*" in (width, precision):
            raise refused("a %-format with a computed (*) width or precision")
        pad = max(int(width or 0), int(precision or 0))
        if pad > MAX_COUNT:
            raise refused(f"a %-format width or precision of {pad} exceeds {MAX_COUNT:,}")
        if name and isinstance(args, Mapping):
            value = args.get(name)
        else:
            value = positional[index] if index < len(positional) else None
            index += 1
        size += pad + text_size(value)
    return size


def format_field_size(value: Any, spec: str) -> int:
    """An upper bound on ``len(format(value, spec))`` for one ``str.format`` field."""
    pad = max((int(d) for d in _DIGITS.findall(spec)), default=0)
    if pad > MAX_COUNT:
        raise refused(f"a format width or precision of {pad} exceeds {MAX_COUNT:,}")
    return pad + text_size(value)


def strftime_size(fmt: Any) -> int:
    if not isinstance(fmt, str):
        return 0
    for width in _STRFTIME_WIDTH.findall(fmt):
        if int(width) > 100:
            raise refused(f"a strftime width of {width}")
    return len(fmt) + 128 * fmt.count("%")


def join_size(separator: Any, items: Any) -> int:
    if not isinstance(items, (list, tuple)):
        return 0
    return sum(text_size(item) for item in items) + len(str(separator)) * max(len(items) - 1, 0)


def replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not all(isinstance(s, (str, bytes)) for s in (text, old, new)):
        return 0
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def method_size(name: str, owner: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """An upper bound on the result of ``owner.name(*args, **kwargs)`` for the methods that can grow; else 0."""
    if isinstance(owner, int) and not isinstance(owner, bool) and name == "to_bytes":
        return _int(args[0] if args else kwargs.get("length", 1))
    if not isinstance(owner, (str, bytes)):
        return 0
    n = len(owner)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(n, _int(args[0] if args else kwargs.get("width")))
    if name == "expandtabs":
        tab = _int(args[0] if args else kwargs.get("tabsize", 8), 8)
        return n + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0)
    if name == "replace":
        return replace_size(owner, *args[:3], **kwargs)
    if name == "join":
        return join_size(owner, args[0] if args else ())
    if name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        return n * max(longest, 1)
    return 0


def check_filter(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse a filter call whose result would be over the size limit (``args[0]`` is the filtered value)."""
    if not args:
        return
    value, rest = args[0], args[1:]
    if name in SLOW_FILTERS and weight(value) > MAX_SLOW_INPUT:
        raise refused(f"the {name} filter on more than {MAX_SLOW_INPUT:,} characters")
    text = value if isinstance(value, str) else ""

    def arg(i: int, key: str, default: Any) -> Any:
        return rest[i] if len(rest) > i else kwargs.get(key, default)

    if name == "center":
        check_size(max(len(text), _int(arg(0, "width", 80))), "the center filter")
    elif name == "indent":
        width = arg(0, "width", 4)
        pad = width if isinstance(width, int) else len(str(width))
        check_size(len(text) + (text.count("\n") + 1) * max(pad, 0), "the indent filter")
    elif name == "wordwrap":
        width = max(_int(arg(0, "width", 79), 1), 1)
        wrap = arg(2, "wrapstring", None) or "\n"
        lines = len(text) // width + text.count("\n") + 1
        check_size(len(text) + lines * len(str(wrap)), "the wordwrap filter")
    elif name == "format":
        check_size(printf_size(text, kwargs or tuple(rest)), "the format filter")
    elif name == "join":
        check_size(join_size(arg(0, "d", ""), value), "a join")
    elif name == "replace":
        check_size(replace_size(value, arg(0, "old", ""), arg(1, "new", ""), arg(2, "count", None)), "a replacement")
    elif name == "list" and isinstance(value, (str, bytes)):
        check_size(2 * len(value), "the list filter")
    elif name in ("e", "escape", "forceescape") and isinstance(value, str):
        check_size(len(value) + 5 * sum(map(value.count, "&<>'\"")), "escaping")
    elif name in ("batch", "slice"):
        check_count(arg(0, "linecount" if name == "batch" else "slices", 1), f"the {name} size")
    elif name == "sum":
        _check_sum(value, arg(1, "start", 0))


def _check_sum(items: Any, start: Any) -> None:
    """``sum`` of sequences copies the running total at every item: quadratic in the items."""
    if not isinstance(items, (list, tuple)):
        return
    if isinstance(start, (list, tuple, str)) or any(isinstance(i, (list, tuple)) for i in items[:1]):
        check_size(len(items) * (weight(items) + weight(start)) // 4, "a sum of sequences")
