"""Numba kernels for the CPU backend's elementwise and row ops (everything but the matmul and attention).

All take float32 C-contiguous arrays viewed as rows (n, d) and write into ``out`` (which may alias the input).
Reductions accumulate in float32 like the references (HF in fp32, llama.cpp's ggml ops) they are tested
against; numba's fastmath is off so results do not depend on vectorisation choices, except in fast mode's RMSNorm
(one compilation, its sum of squares in vector lanes).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from quanta.backends.cpu.cached_dispatch import renamed
from quanta.backends.cpu.kernels.vector_rows import GELU_C, gelu_mul_row, silu_mul_row

_JIT = dict(nogil=True, cache=True)
PARALLEL_MIN_ELEMENTS = 1 << 15  # below this, waking the thread pool costs more than it saves


def _rms_norm_rows(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    n, d = x.shape
    for i in numba.prange(n):
        ss = np.float32(0.0)
        for j in range(d):
            ss += x[i, j] * x[i, j]
        inv = np.float32(1.0 / math.sqrt(ss / d + eps))
        for j in range(d):
            out[i, j] = x[i, j] * inv * w[j]


def _rope_rows(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> None:
    """x: (n, heads, hd) in place; cos/sin: (n_ctx, rot/2). NORM pairs (2i, 2i+1); NEOX pairs (i, i+rot/2)."""
    n, heads, _ = x.shape
    half = cos.shape[1]
    for t in numba.prange(n * heads):
        i, h = t // heads, t % heads
        p = positions[i]
        for j in range(half):
            a, b = (j, j + half) if neox else (2 * j, 2 * j + 1)
            x0, x1 = x[i, h, a], x[i, h, b]
            c, s = cos[p, j], sin[p, j]
            x[i, h, a] = x0 * c - x1 * s
            x[i, h, b] = x0 * s + x1 * c


def _silu_mul_flat(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    for i in numba.prange(gate.size):
        g = gate[i]
        out[i] = g / (np.float32(1.0) + np.exp(-g)) * up[i]


def _gelu_mul_flat(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    for i in numba.prange(gate.size):
        g = gate[i]
        # 0.5 * (1 + tanh(u)) == 1 / (1 + exp(-2u)): one exp instead of a libm tanh call per element (5x faster)
        u = np.float32(2.0 * GELU_C) * (g + np.float32(0.044715) * g * g * g)
        u = min(max(u, np.float32(-80.0)), np.float32(80.0))
        out[i] = g * up[i] / (np.float32(1.0) + np.exp(-u))


def _gated_mul_rows(gate: np.ndarray, up: np.ndarray, out: np.ndarray, gelu: bool) -> None:
    """Fast mode's gated activations, row by row (each row's elements take the same path whatever the batch): the
    exp 16 lanes at a time, within 2 ulp of libm's (numba calls libm once per element: SmolLM2's 8-sequence decode
    spent 1.7 ms of a 33 ms step in silu_mul)."""
    for i in numba.prange(gate.shape[0]):
        if gelu:
            gelu_mul_row(gate[i], up[i], out[i])
        else:
            silu_mul_row(gate[i], up[i], out[i])


def _both(fn):
    """(serial, parallel) compilations of one kernel: prange runs as range in the serial one."""
    return numba.njit(**_JIT)(fn), numba.njit(parallel=True, **_JIT)(renamed(fn, fn.__name__ + "_parallel"))


_RMS, _ROPE, _SILU, _GELU, _GATED = (_both(f) for f in (_rms_norm_rows, _rope_rows, _silu_mul_flat, _gelu_mul_flat,
                                                       _gated_mul_rows))
# fast mode's RMSNorm: the sum of squares reassociated into vector lanes (the exact kernel's serial float32 chain
# is latency-bound: ~1 us a row of 576), each row on its own (the same result whatever the batch)
_RMS_FAST = numba.njit(fastmath={"reassoc", "contract"}, **_JIT)(renamed(_rms_norm_rows, "_rms_norm_rows_fast"))


def rms_norm_rows(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray, exact: bool = True) -> None:
    """RMSNorm of (n, d) rows into ``out``; ``exact=False``: fast mode's vectorised sum of squares, on the calling
    thread at every size (a threaded copy, compiled apart, could vectorise a row another way: a row's result would
    then depend on its batch's size)."""
    if exact:
        _RMS[x.size >= PARALLEL_MIN_ELEMENTS](x, w, eps, out)
    else:
        _RMS_FAST(x, w, eps, out)


def rope_rows(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> None:
    _ROPE[x.size >= PARALLEL_MIN_ELEMENTS](x, positions, cos, sin, neox)


def silu_mul_flat(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    _SILU[gate.size >= PARALLEL_MIN_ELEMENTS](gate, up, out)


def gelu_mul_flat(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    _GELU[gate.size >= PARALLEL_MIN_ELEMENTS](gate, up, out)


def gated_mul_rows(gate: np.ndarray, up: np.ndarray, out: np.ndarray, gelu: bool) -> None:
    """Fast mode's ``silu(gate) * up`` (or ``gelu``'s tanh form) of (n, d) rows into ``out``."""
    _GATED[gate.size >= PARALLEL_MIN_ELEMENTS](gate, up, out, gelu)


@numba.njit(**_JIT)
def add_rows(a: np.ndarray, b: np.ndarray) -> None:
    """a (n, d) += b, where b is (n, d) or (d,) (a bias broadcast over rows)."""
    n, d = a.shape
    if b.ndim == 1:
        for i in range(n):
            for j in range(d):
                a[i, j] += b[j]
    else:
        for i in range(n):
            for j in range(d):
                a[i, j] += b[i, j]
