"""Load the CPU kernels from numba's disk cache without first loading numba's whole compiler (saves ~0.1 s of
cold start), and keep two builds of one kernel apart in that cache (``renamed``).

Before it looks at the disk cache, numba's ``Cache.load_overload`` calls ``target_context.refresh()``, which
imports and installs every typing and lowering registry (linalg, random, typed containers, ...): ~0.09 s, the
largest single item of a cached cold start. A cached kernel is machine code; loading it only needs the NRT (the
allocator its ``np.empty`` calls). A cache miss still compiles as usual, and numba's compiler refreshes the
context itself then. Applied to quanta's own dispatchers only, so other numba users in the process keep numba's
behaviour.
"""

from __future__ import annotations

import types
from typing import Any

from numba.core.caching import FunctionCache
from numba.core.registry import CPUDispatcher
from numba.core.runtime import rtsys


def renamed(func: types.FunctionType, name: str) -> types.FunctionType:
    """A copy of ``func`` under another name, to compile it a second way. numba keys its disk cache by a function's
    name and line, not by its compile flags: two builds of one function share an index, and either may load the
    other's code (the parallel build in the serial dispatcher crashed a process)."""
    copy = types.FunctionType(func.__code__.replace(co_name=name, co_qualname=name), func.__globals__, name,
                              func.__defaults__)
    copy.__qualname__ = name
    return copy


def _load_overload(self: FunctionCache, sig: Any, target_context: Any) -> Any:
    rtsys.initialize(target_context)
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)


def load_without_refresh(*modules: types.ModuleType) -> None:
    """Make the cached dispatchers defined in ``modules`` load from disk without the registry refresh."""
    if not all(hasattr(FunctionCache, a) for a in ("_load_overload", "_guard_against_spurious_io_errors")):
        return  # another numba: keep its loading as it is
    for module in modules:
        for value in vars(module).values():
            for dispatcher in value if isinstance(value, tuple) else (value,):
                cache = getattr(dispatcher, "_cache", None)
                if isinstance(dispatcher, CPUDispatcher) and isinstance(cache, FunctionCache):
                    cache.load_overload = types.MethodType(_load_overload, cache)
