"""Time breakdowns for `quanta bench`: per op on the CPU, per kernel on the GPU.

CPU (``op_timers``): a backend's op methods are wrapped with host timers for the length of a measurement; matmul
time is split by the weight's quant type (``matmul Q4_1``), and everything the forward does outside the ops (Python
glue, sampling, detokenizing) is reported as "other" by the caller: total minus the ops' sum.

GPU (``kernel_timers``): torch's profiler records the device time of every CUDA kernel, summed by kernel name, while
the backend runs eagerly (a CUDA graph replay hides its kernels' launch gaps, so the breakdown is of an eager run
and sums to more than a replayed step). Host timers would measure launches, not kernels.
"""

from __future__ import annotations

import re
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

OPS = ("matmul", "matmul_split", "embed", "rms_norm", "rope", "rope_qk", "attention", "silu_mul", "gelu_mul", "add",
       "scale", "softcap", "gather_rows", "argmax_rows")


@contextmanager
def op_timers(backend: Any) -> Iterator[dict[str, float]]:
    """Time every op of ``backend`` while the context is open; yields {op label: seconds} (filled on exit)."""
    totals: dict[str, float] = defaultdict(float)
    depth = [0]  # an op built from other ops (rope_qk → rope) is counted once, as the outer op
    originals = {}
    for op in OPS:
        fn = getattr(backend, op, None)
        if fn is None:
            continue
        originals[op] = fn
        setattr(backend, op, _timed(op, fn, totals, depth))
    try:
        yield totals
    finally:
        for op in originals:
            delattr(backend, op)  # the instance attribute shadowed the class method


def _weight_type(w: Any) -> str:
    """The quant type of a weight, or of a fused weight's stacked rows."""
    return getattr(w, "type", None) or getattr(getattr(w, "packed", None), "type", None) or "?"


def _timed(op: str, fn: Callable, totals: dict[str, float], depth: list[int]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        label = f"matmul {_weight_type(args[1])}" if op.startswith("matmul") and len(args) > 1 else op
        depth[0] += 1
        t = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            totals[label] += time.perf_counter() - t
        return result

    return wrapper


@contextmanager
def kernel_timers(backend: Any) -> Iterator[dict[str, float]]:
    """Device seconds of every CUDA kernel launched while the context is open, by kernel name (filled on exit);
    the CUDA backend runs without graphs meanwhile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    totals: dict[str, float] = {}
    graphs, backend.graphs = backend.graphs, False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events")  # one profile, one cycle
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                yield totals
                torch.cuda.synchronize()
            totals.update(kernel_totals(prof.key_averages()))
    finally:
        backend.graphs = graphs


def kernel_totals(events: Iterable[Any]) -> dict[str, float]:
    """Seconds of device time by kernel from profiler averages (``key``, ``device_time_total`` in µs)."""
    totals: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.device_time_total > 0:
            totals[kernel_label(ev.key)] += ev.device_time_total * 1e-6
    return dict(totals)


def kernel_label(name: str) -> str:
    """A kernel's short name: ours (Triton's ``_rms_norm_kernel``) → ``rms_norm``; torch's templated C++ kernels by
    the op inside (``...at::native::bfloat16_copy_kernel_cuda...`` → ``torch bfloat16_copy``)."""
    if name.startswith("_"):
        return name.removeprefix("_").removesuffix("_kernel")
    op = re.search(r"at::native::(\w+?)(?:_kernel)?_cuda", name)
    if op:
        return f"torch {op.group(1)}"
    return name if len(name) <= 40 else name[:37] + "..."
