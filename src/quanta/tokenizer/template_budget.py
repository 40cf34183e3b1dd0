"""What a chat-template render may cost, and how big a value is: the bounds the sandbox checks before it acts.

A template is untrusted input, so a render has a budget: wall-clock time, template steps (calls, loop iterations,
attribute lookups), characters written by output expressions, and the size of every value it builds. The size of
a value is its *weight*: characters of its strings, digits of its integers and items of its containers, each
shared part counted every time it appears (``str``, ``tojson`` and comparisons expand the sharing). Weights of
containers that cannot change during a render are memoised by the render's budget, so a list of a list of ... of
one big string costs one step per level, not a walk of the expansion.

The budget of the running render lives in a ``ContextVar``: the checks are reached from code Jinja generates,
which has no handle on our render, and a context variable is per thread (and per asyncio task), so concurrent
renders never share one.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Any, Iterator

from jinja2.utils import Namespace

from quanta.tokenizer.errors import ChatTemplateError

MAX_VALUE = 1 << 22  # weight of any value a template builds
MAX_OUTPUT = 1 << 22  # characters of the rendered prompt
MAX_EMITTED = 4 * MAX_OUTPUT  # characters of all output expressions, those captured by macros and set blocks included
MAX_STEPS = 1 << 22  # calls, filters, loop iterations and lookups of one render
MAX_COUNT = 100_000  # widths, counts, indents, batch sizes
MAX_INT_BITS = 1 << 16  # integers a template computes (a squaring loop would otherwise run for minutes)
MAX_SLOW_INPUT = 1 << 16  # characters given to filters written in Python (wordwrap, urlize, striptags, ...)
REPR_FACTOR = 10  # str() of a container: at most 10 characters per unit of weight ('\U000e0001' → 10 characters)
_TIME_CHECK_EVERY = 16  # steps between two reads of the clock
_BIG = 1 << 16  # a value at least this big reads the clock when it is checked

_SCALARS = (bool, float, complex, type(None))
_FROZEN_CONTAINERS = (list, tuple, dict, set, frozenset)  # immutable inside the sandbox
_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def refused(what: str) -> ChatTemplateError:
    return ChatTemplateError(f"chat template refused: {what}")


class RenderBudget:
    """The running render's limits and counters, and the memo of container weights."""

    def __init__(self, seconds: float, max_output: int = MAX_OUTPUT):
        self.seconds, self.max_output = seconds, max_output
        self.deadline = time.monotonic() + seconds
        self.steps = self.emitted = 0
        self.weights: dict[int, tuple[Any, int]] = {}  # id -> (the container, kept alive: its id stays its; weight)

    def step(self) -> None:
        self.steps += 1
        if self.steps % _TIME_CHECK_EVERY == 0:
            if self.steps > MAX_STEPS:
                raise refused(f"the template ran more than {MAX_STEPS:,} steps")
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise refused(f"rendering took longer than {self.seconds:g} s")

    def emit(self, chars: int) -> None:
        self.emitted += chars
        if self.emitted > MAX_EMITTED:
            raise refused(f"its output expressions wrote more than {MAX_EMITTED:,} characters")


_active: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("quanta_render_budget", default=None)


@contextlib.contextmanager
def render_budget(seconds: float, max_output: int = MAX_OUTPUT) -> Iterator[RenderBudget]:
    """Make a fresh budget the current one for the duration of a render."""
    budget = RenderBudget(seconds, max_output)
    token = _active.set(budget)
    try:
        yield budget
    finally:
        _active.reset(token)


def step() -> None:
    """Count one template step against the current render's budget (no-op outside a render: compile time)."""
    budget = _active.get()
    if budget is not None:
        budget.step()


def emit(chars: int) -> None:
    budget = _active.get()
    if budget is not None:
        budget.emit(chars)


def weight(value: Any) -> int:
    """Characters + digits + items of ``value``, expanded; stops counting somewhere past ``MAX_VALUE``."""
    budget = _active.get()
    memo = budget.weights if budget is not None else {}
    return _Weigher(memo, budget).weigh(value, MAX_VALUE)[0]


class _Weigher:
    def __init__(self, memo: dict[int, tuple[Any, int]], budget: RenderBudget | None):
        self.memo, self.budget, self.visits = memo, budget, 0
        self.open_namespaces: set[int] = set()

    def weigh(self, value: Any, limit: int) -> tuple[int, bool]:
        """(weight, frozen): frozen weights cannot change and may be memoised."""
        if isinstance(value, (str, bytes, bytearray)):
            return len(value), True
        if isinstance(value, int):
            return value.bit_length() // 3 + 1, True  # at least its number of decimal digits
        if isinstance(value, _SCALARS):
            return 1, True
        key = id(value)
        if key in self.memo:
            return self.memo[key][1], True
        self.visits += 1
        if self.budget is not None and self.visits % 4096 == 0:
            self.budget.check_time()
        if isinstance(value, Namespace):  # the one mutable container: `{% set ns.x = ... %}`
            if key in self.open_namespaces:
                raise refused("a namespace contains itself")
            self.open_namespaces.add(key)
            try:
                attrs = object.__getattribute__(value, "_Namespace__attrs")
                return self._weigh_items(len(attrs), (*attrs.keys(), *attrs.values()), limit)[0], False
            finally:
                self.open_namespaces.discard(key)
        if isinstance(value, dict):
            items: Any = (*value.keys(), *value.values())
        elif isinstance(value, (*_FROZEN_CONTAINERS, *_VIEWS)):
            items = value
        else:
            return 0, False  # generators, undefined values, macros, loops: small reprs, never memoised
        total, frozen = self._weigh_items(len(value), items, limit)
        if frozen and isinstance(value, _FROZEN_CONTAINERS):
            self.memo[key] = (value, total)
        return total, frozen

    def _weigh_items(self, total: int, items: Any, limit: int) -> tuple[int, bool]:
        frozen = True
        for i, item in enumerate(items):
            if total > limit:
                return total, False  # a partial count: not memoised
            if i % 4096 == 4095 and self.budget is not None:
                self.budget.check_time()
            w, item_frozen = self.weigh(item, limit - total)
            total += w
            frozen = frozen and item_frozen
        return total, frozen


def check_size(size: int, what: str) -> None:
    if size > MAX_VALUE:
        raise refused(f"{what} would build a value over {MAX_VALUE:,} characters and items")
    if size > _BIG:  # big values take time to build: the clock is read more often than every few steps
        budget = _active.get()
        if budget is not None:
            budget.check_time()


def bounded(value: Any, what: str = "a call") -> Any:
    """``value`` once its weight is known to be within ``MAX_VALUE`` (for results no estimate bounded before)."""
    check_size(weight(value), what)
    return value


def text_size(value: Any) -> int:
    """An upper bound on ``len(str(value))``."""
    if isinstance(value, str):
        return len(value)
    return REPR_FACTOR * weight(value) + 32


def check_count(value: Any, what: str) -> None:
    if isinstance(value, int) and abs(value) > MAX_COUNT:
        raise refused(f"{what} {value} exceeds {MAX_COUNT:,}")
