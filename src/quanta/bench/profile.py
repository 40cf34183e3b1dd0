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

OPS = ("matmul", "embed", "rms_norm", "rope", "attention", "silu_mul", "gelu_mul", "add", "scale", "softcap",
       "softmax", "argmax", "last_row")


@contextmanager
def op_timers(backend: Any, sync: Callable[[], None] | None = None) -> Iterator[dict[str, float]]:
    """Time every op of ``backend`` while the context is open; yields {op label: seconds} (filled on exit)."""
    totals: dict[str, float] = defaultdict(float)
    originals = {}
    for op in OPS:
        fn = getattr(backend, op, None)
        if fn is None:
            continue
        originals[op] = fn
        setattr(backend, op, _timed(op, fn, totals, sync))
    try:
        yield totals
    finally:
        for op in originals:
            delattr(backend, op)  # the instance attribute shadowed the class method


def _timed(op: str, fn: Callable, totals: dict[str, float], sync: Callable[[], None] | None) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        label = op
        if op == "matmul" and len(args) > 1:
            label = f"matmul {getattr(args[1], 'type', '?')}"
        t = time.perf_counter()
        result = fn(*args, **kwargs)
        if sync is not None:
            sync()
        totals[label] += time.perf_counter() - t
        return result

    return wrapper
