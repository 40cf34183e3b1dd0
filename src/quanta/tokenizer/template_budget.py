"""What a chat-template render may cost, and how big a value is: the bounds the sandbox checks before it acts.

A template is untrusted input, so a render has a budget: wall-clock time, template steps (calls, loop iterations,
attribute lookups), characters written by output expressions, and the size of every value it builds. The size of
a value is its *weight*: characters of its strings, digits of its integers and items of its containers, each
shared part counted every time it appears (``str``, ``tojson`` and comparisons expand the sharing). Weighing walks
a value (stopping past the limit); only the inputs' weights are computed once per render, so that a template
building a list of messages does not walk each message again.

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
MAX_EMITTED = 4 * MAX_OUTPUT  # characters of all output expressions, captured ones (macros, set blocks) included
MAX_STEPS = 1 << 22  # calls, filters, loop iterations and lookups of one render
MAX_COUNT = 100_000  # widths, counts, indents, batch sizes
MAX_INT_BITS = 1 << 16  # integers a template computes (a squaring loop would otherwise run for minutes)
MAX_SLOW_INPUT = 1 << 16  # characters given to filters written in Python (wordwrap, urlize, striptags, ...)
REPR_FACTOR = 10  # str() of a container: at most 10 characters per unit of weight ('\U000e0001' → 10 characters)
_TIME_CHECK_EVERY = 16  # steps between two reads of the clock
_BIG = 1 << 16  # a value at least this big reads the clock when it is checked

_SCALARS = (bool, float, complex, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def refused(what: str) -> ChatTemplateError:
    return ChatTemplateError(f"chat template refused: {what}")


class RenderBudget:
    """The running render's limits and counters, and the weights of its inputs' containers."""

    def __init__(self, seconds: float, inputs: Any = ()):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.steps = self.emitted = 0
        # id -> weight of every container reachable from the inputs, which live as long as the render (so their
        # ids stay theirs); what the template builds is never memoised: that would keep it alive
        self.input_weights: dict[int, int] = {}
        _Weigher(self, record=True).weigh(inputs, float("inf"))  # complete counts only: never cut short

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


_active: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("quanta_budget", default=None)


@contextlib.contextmanager
def render_budget(seconds: float, inputs: Any = ()) -> Iterator[RenderBudget]:
    """Make a fresh budget (for a render of ``inputs``) the current one for the duration of the render."""
    budget = RenderBudget(seconds, inputs)
    token = _active.set(budget)
    try:
        yield budget
    finally:
        _active.reset(token)


def rendering() -> bool:
    return _active.get() is not None


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
    return _Weigher(_active.get()).weigh(value, MAX_VALUE)


class _Weigher:
    """One weighing: the inputs' weights are looked up, everything else is walked (at most ~``MAX_VALUE`` items,
    reading the clock as it goes)."""

    def __init__(self, budget: RenderBudget | None, record: bool = False):
        self.budget, self.record, self.visits = budget, record, 0
        self.memo = budget.input_weights if budget is not None else {}
        self.open_namespaces: set[int] = set()

    def weigh(self, value: Any, limit: float) -> int:
        if isinstance(value, (str, bytes, bytearray)):
            return len(value)
        if isinstance(value, int):
            return value.bit_length() // 3 + 1  # at least its number of decimal digits
        if isinstance(value, _SCALARS):
            return 1
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        self.visits += 1
        if self.visits % 4096 == 0:
            self._check_time()
        if isinstance(value, Namespace):
            if key in self.open_namespaces:
                raise refused("a namespace contains itself")
            self.open_namespaces.add(key)
            try:
                attrs = object.__getattribute__(value, "_Namespace__attrs")
                return self._weigh_items(len(attrs), (*attrs.keys(), *attrs.values()), limit)
            finally:
                self.open_namespaces.discard(key)
        if isinstance(value, dict):
            items: Any = (*value.keys(), *value.values())
        elif isinstance(value, (*_CONTAINERS, *_VIEWS)):
            items = value
        else:
            return 0  # generators, undefined values, macros, loops: small reprs
        total = self._weigh_items(len(value), items, limit)
        if self.record and isinstance(value, _CONTAINERS):
            self.memo[key] = total
        return total

    def _weigh_items(self, total: int, items: Any, limit: float) -> int:
        for i, item in enumerate(items):
            if total > limit:
                return total
            if i % 4096 == 4095:
                self._check_time()
            total += self.weigh(item, limit - total)
        return total

    def _check_time(self) -> None:
        if self.budget is not None and not self.record:
            self.budget.check_time()


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
