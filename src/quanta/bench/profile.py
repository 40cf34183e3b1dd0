"""Per-op time breakdown: wrap a backend's op methods with timers for the length of a measurement.

Matmul time is split by the weight's quant type (``matmul Q4_1``), everything the forward does outside the ops
(Python glue, sampling, detokenizing) is reported as "other" by the caller: total minus the ops' sum. On a device
backend each op is synchronised so its time is its own (this slows the measured run; it is a breakdown, not a
speed figure).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

OPS = ("matmul", "matmul_split", "embed", "rms_norm", "rope", "rope_qk", "attention", "silu_mul", "gelu_mul", "add", "scale", "softcap",
       "softmax", "argmax", "last_row")


@contextmanager
def op_timers(backend: Any, sync: Callable[[], None] | None = None) -> Iterator[dict[str, float]]:
    """Time every op of ``backend`` while the context is open; yields {op label: seconds} (filled on exit)."""
    totals: dict[str, float] = defaultdict(float)
    depth = [0]  # an op built from other ops (rope_qk → rope) is counted once, as the outer op
    originals = {}
    for op in OPS:
        fn = getattr(backend, op, None)
        if fn is None:
            continue
        originals[op] = fn
        setattr(backend, op, _timed(op, fn, totals, sync, depth))
    try:
        yield totals
    finally:
        for op in originals:
            delattr(backend, op)  # the instance attribute shadowed the class method


def _weight_type(w: Any) -> str:
    """The quant type of a weight, or of a fused weight's stacked rows."""
    return getattr(w, "type", None) or getattr(getattr(w, "packed", None), "type", None) or "?"


def _timed(op: str, fn: Callable, totals: dict[str, float], sync: Callable[[], None] | None,
           depth: list[int]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        label = f"matmul {_weight_type(args[1])}" if op.startswith("matmul") and len(args) > 1 else op
        depth[0] += 1
        t = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
            if sync is not None:
                sync()
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            totals[label] += time.perf_counter() - t
        return result

    return wrapper
