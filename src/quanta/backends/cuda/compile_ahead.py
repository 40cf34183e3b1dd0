"""A forward's Triton kernels compiled side by side before it first runs.

Triton compiles a kernel specialization when it is first launched, so with an empty kernel cache a process's first
forwards compile their ~26 specializations one after another (TinyLlama's first token and the 8 tokens after it:
9.8 and 9.7 s on the H200 machine's host, GPU run 266). :func:`dry_run_compiling` runs the forward dry first:
every launch becomes a warm-up (the kernel is looked up, never launched) and each specialization not compiled yet
is only recorded (Triton's ``jit_cache_hook``); then a thread pool compiles the recorded ones side by side
(Triton's MLIR passes release the GIL, ptxas is a process of its own) and loads each onto the GPU with its
launcher (a small C stub Triton builds with the host compiler), as its first launch would. The real forward finds
them ready. With a warm cache the same threads load the compiled kernels from it.

A dry run launches no kernel, so it writes nothing the real forward reads: its torch operations (buffers, views,
copies of inputs) run on whatever the buffers hold, and the real forward recomputes everything. Collectives of
a tensor-parallel forward run in it too, on every rank alike.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # a Triton before 3.4: no hook to record a launch's specialization with
    knobs = None

THREADS = min(32, os.cpu_count() or 1)


def compiles_ahead() -> bool:
    """Whether this Triton can record a launch's specialization and compile it later (and cores to do so)."""
    return knobs is not None and hasattr(JITFunction, "preload") and THREADS > 1


@contextlib.contextmanager
def _launches_as_warmups() -> Iterator[None]:
    """Every ``kernel[grid](...)`` in the block compiles (or finds) its kernel and returns without launching it."""
    run = JITFunction.run

    def warm_up(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = warm_up
    try:
        yield
    finally:
        JITFunction.run = run


@contextlib.contextmanager
def _recording(wanted: dict[tuple[int, str], tuple[JITFunction, str]]) -> Iterator[None]:
    """Specializations launched in the block and not compiled yet go into ``wanted`` instead of compiling."""
    previous = knobs.runtime.jit_cache_hook

    def record(*, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        wanted.setdefault((id(fn.jit_function), str(key)), (fn.jit_function, compile["specialization_data"]))
        return True  # skip the compile (and the launch)

    knobs.runtime.jit_cache_hook = record
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous


def _compile(fn: JITFunction, specialization: str, device: int) -> None:
    """One specialization compiled (or read from Triton's cache) and loaded onto GPU ``device``; one that Triton
    cannot rebuild from its record is left to compile at its launch."""
    torch.cuda.set_device(device)  # this thread's current device: where Triton compiles for and loads
    try:
        kernel = fn.preload(specialization)
    except Exception:  # noqa: BLE001 - its launch compiles it (and raises a real error there)
        return
    init = getattr(kernel, "_init_handles", None)
    if init is not None:  # an internal of Triton: without it the first launch loads the kernel
        init()


def dry_run_compiling(forward: Callable[[], Any], device: torch.device) -> int:
    """Run ``forward`` dry, then compile and load every kernel specialization it would have compiled, side by
    side (see the module docstring); returns how many, once all of them are ready."""
    wanted: dict[tuple[int, str], tuple[JITFunction, str]] = {}
    with _recording(wanted), _launches_as_warmups():
        forward()
    if not wanted:
        return 0
    index = torch.cuda.current_device() if device.index is None else device.index
    with ThreadPoolExecutor(min(THREADS, len(wanted)), thread_name_prefix="quanta-compile") as pool:
        for done in [pool.submit(_compile, fn, data, index) for fn, data in wanted.values()]:
            done.result()
    return len(wanted)
