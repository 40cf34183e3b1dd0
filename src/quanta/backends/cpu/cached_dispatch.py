"""Load the CPU kernels from numba's disk cache without first loading numba's whole compiler (saves ~0.1 s of
cold start) and without keeping their LLVM IR in memory (~30 MB of SmolLM2's peak RSS), and keep two builds
of one kernel apart in that cache (``renamed``).

Before it looks at the disk cache, numba's ``Cache.load_overload`` calls ``target_context.refresh()``, which
imports and installs every typing and lowering registry (linalg, random, typed containers, ...): ~0.09 s, the
largest single item of a cached cold start. A cached kernel is machine code; loading it only needs the NRT (the
allocator its ``np.empty`` calls). A cache miss still compiles as usual, and numba's compiler refreshes the
context itself then. Applied to quanta's own dispatchers only, so other numba users in the process keep numba's
behaviour.

A kernel loaded from the cache also parses the LLVM bitcode stored beside its machine code and keeps that module
for as long as the process lives, only so that a later compilation calling it could inline it: megabytes of IR per
GEMV kernel. The loader frees that module as soon as it is loaded and keeps the bitcode, parsed again only if a
compilation ever links the kernel (SmolLM2's peak RSS 284 -> 257 MB; freeing costs 40-55 ms of the cold start).
"""

from __future__ import annotations

import contextlib
import ctypes
import types
from collections.abc import Iterator
from typing import Any

from llvmlite import binding as llvm
from numba.core import codegen
from numba.core.caching import FunctionCache
from numba.core.registry import CPUDispatcher
from numba.core.runtime import rtsys

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim  # glibc: freed pages back to the system
except (OSError, AttributeError):
    _malloc_trim = None


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
    parsed: list[bytes] = []
    with self._guard_against_spurious_io_errors(), _recording_bitcode(parsed):
        compiled = self._load_overload(sig, target_context)
    if compiled is not None and len(parsed) == 1 and getattr(compiled.library, "_shared_module", None) is not None:
        _parse_when_linked(compiled.library, parsed[0])
    return compiled


@contextlib.contextmanager
def _recording_bitcode(parsed: list[bytes]) -> Iterator[None]:
    """Record the bitcode numba parses meanwhile (a cached library's module for linking; loads run under numba's
    compiler lock, as every compilation does)."""
    parse = llvm.parse_bitcode

    def recording(bitcode: bytes, *args: Any) -> Any:
        parsed.append(bitcode)
        return parse(bitcode, *args)

    codegen.ll.parse_bitcode = recording
    try:
        yield
    finally:
        codegen.ll.parse_bitcode = parse


def _parse_when_linked(library: Any, bitcode: bytes) -> None:
    """Free a loaded library's module for linking (``_shared_module``: megabytes of IR), keeping its ``bitcode``
    to parse again if numba ever links the library into another (``_get_module_for_linking``)."""
    library._shared_module = None
    library._get_module_for_linking = lambda: llvm.parse_bitcode(bitcode)
    if _malloc_trim is not None:
        _malloc_trim(0)  # the module's pages back to the system, not kept in malloc's free lists


def load_without_refresh(*modules: types.ModuleType) -> None:
    """Make the cached dispatchers defined in ``modules`` load from disk without the registry refresh."""
    if not all(hasattr(FunctionCache, a) for a in ("_load_overload", "_guard_against_spurious_io_errors")) or \
            not hasattr(codegen.CPUCodeLibrary, "_get_module_for_linking"):
        return  # another numba: keep its loading as it is
    for module in modules:
        for value in vars(module).values():
            for dispatcher in value if isinstance(value, tuple) else (value,):
                cache = getattr(dispatcher, "_cache", None)
                if isinstance(dispatcher, CPUDispatcher) and isinstance(cache, FunctionCache):
                    cache.load_overload = types.MethodType(_load_overload, cache)
