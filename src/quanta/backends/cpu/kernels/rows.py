"""The numba kernels over weight rows: dequantize rows (GEMM tiles, embeddings), the per-format row dot products.

A weight is its GGUF bytes viewed as ``raw2d`` (m rows x bytes-per-row, uint8, zero-copy). ``fmt`` is a small
integer code (``FORMAT_CODES``) so one compiled kernel serves every format: the branch on it is taken once per
chunk of rows and selects that format's SIMD intrinsic. The GEMVs split their rows over threads in
``workers.py``. Reference: gguf-py's dequantize (tests).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from quanta.backends.cpu.kernels.dequant_simd import (
    dequant_q4_0_simd, dequant_q4_1_simd, dequant_q4_k_simd, dequant_q5_0_simd, dequant_q5_1_simd,
    dequant_q5_k_simd, dequant_q6_k_simd, dequant_q8_0_simd,
)  # fmt: skip
from quanta.backends.cpu.kernels.kquants import dequant_q2_k, dequant_q3_k
from quanta.backends.cpu.kernels.kquants_dot import rows_dot_q4_k, rows_dot_q5_k, rows_dot_q6_k
from quanta.backends.cpu.kernels.kquants_dot_q8 import rows_dot_q4_k_q8, rows_dot_q5_k_q8, rows_dot_q6_k_q8
from quanta.backends.cpu.kernels.legacy_dot import (
    rows_dot_q4_0, rows_dot_q4_1, rows_dot_q5_0, rows_dot_q5_1, rows_dot_q8_0,
)  # fmt: skip
from quanta.backends.cpu.kernels.legacy_dot_q8 import (
    q8_0_offset, rows_dot_q4_0_q8, rows_dot_q4_1_q8, rows_dot_q5_0_q8, rows_dot_q5_1_q8, rows_dot_q8_0_q8,
)  # fmt: skip
from quanta.backends.cpu.kernels.q8_rows import LEGACY_ROWS_PER_PASS, ROWS_PER_PASS

PASS_BYTES = 16 << 10  # weight bytes per pass when several passes read them (L1 holds them and the activations)

SUPERBLOCK_FORMATS = (7, 8, 9)  # Q4_K, Q5_K, Q6_K: activations with one scale per 256 in the fast GEMV
FORMAT_CODES = {
    "Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4,
    "Q2_K": 5, "Q3_K": 6, "Q4_K": 7, "Q5_K": 8, "Q6_K": 9,
}  # fmt: skip


@njit
def dequant_row(fmt, row, block_size, type_size, out):
    nb = out.shape[0] // block_size
    if fmt == 0:
        dequant_q4_0_simd(row, out, nb)
    elif fmt == 1:
        dequant_q4_1_simd(row, out, nb)
    elif fmt == 2:
        dequant_q5_0_simd(row, out, nb)
    elif fmt == 3:
        dequant_q5_1_simd(row, out, nb)
    elif fmt == 4:
        dequant_q8_0_simd(row, out, nb)
    elif fmt == 7:
        dequant_q4_k_simd(row, out, nb)
    elif fmt == 8:
        dequant_q5_k_simd(row, out, nb)
    elif fmt == 9:
        dequant_q6_k_simd(row, out, nb)
    elif fmt == 5:  # Q2_K, Q3_K: scalar loops
        for i in range(nb):
            dequant_q2_k(row, i * type_size, out, i * block_size)
    else:
        for i in range(nb):
            dequant_q3_k(row, i * type_size, out, i * block_size)


@njit(cache=True, nogil=True)
def dequant_rows(fmt, raw2d, rows, block_size, type_size, out):
    """``out[i] = dequantize(raw2d[rows[i]])``: the rows of a table (embedding). Serial: a prompt's rows take
    ~0.1 ms, and a decode step's one row is not worth an OpenMP region (which waits for every thread)."""
    for i in range(rows.shape[0]):
        dequant_row(fmt, raw2d[rows[i]], block_size, type_size, out[i])


@njit(cache=True, nogil=True)
def dequant_tile(fmt, raw2d, start, block_size, type_size, out):
    """``out[i] = dequantize(raw2d[start + i])`` on the calling thread (GIL released): each sgemm thread
    dequantizes its own tile, see ``qmatmul._gemm``."""
    for i in range(out.shape[0]):
        dequant_row(fmt, raw2d[start + i], block_size, type_size, out[i])


@njit
def rows_dot(fmt, raw2d, r0, r1, x, xsum, out, buf):
    """``out[r] = dot(dequantize(raw2d[r]), x)`` in fp32 for r in [r0, r1): a SIMD intrinsic per format,
    dequantize-then-dot (into ``buf``) for Q2_K/Q3_K."""
    if fmt == 0:
        rows_dot_q4_0(raw2d, r0, r1, x, xsum, out)
    elif fmt == 1:
        rows_dot_q4_1(raw2d, r0, r1, x, xsum, out)
    elif fmt == 2:
        rows_dot_q5_0(raw2d, r0, r1, x, xsum, out)
    elif fmt == 3:
        rows_dot_q5_1(raw2d, r0, r1, x, xsum, out)
    elif fmt == 4:
        rows_dot_q8_0(raw2d, r0, r1, x, xsum, out)
    elif fmt == 7:
        rows_dot_q4_k(raw2d, r0, r1, x, xsum, out)
    elif fmt == 8:
        rows_dot_q5_k(raw2d, r0, r1, x, xsum, out)
    elif fmt == 9:
        rows_dot_q6_k(raw2d, r0, r1, x, xsum, out)
    else:
        type_size = raw2d.shape[1] // (x.shape[0] // 256)
        for r in range(r0, r1):
            dequant_row(fmt, raw2d[r], 256, type_size, buf)
            acc = np.float32(0.0)
            for j in range(buf.shape[0]):
                acc += buf[j] * x[j]
            out[r] = acc


@njit
def dot_offset(isa, fmt):
    """The code offset that format ``fmt``'s row dots on ``isa``'s path take from the integer dots' starting
    values (``activations.gemv_activations``'s ``block_offset``)."""
    if fmt == 0:
        return 8
    if fmt == 2:
        return 16
    if fmt == 4:
        return q8_0_offset(isa)
    return 0


@njit
def rows_dot_q8(isa, fmt, raw2d, r0, r1, xq, xd, xsum, xstart, out):
    """``out[t, r]`` for every activation row t and weight row r in [r0, r1), in the instruction set chosen by the
    type of ``isa`` (``isa.token``): each pass over the weights serves up to ``LEGACY_ROWS_PER_PASS`` activation
    rows of the legacy formats, ``ROWS_PER_PASS`` of the K-quants, every row computed exactly as alone
    (``q8_rows.py``). The passes of more rows than that take the weights
    ``PASS_BYTES`` at a time, so that the second pass finds them in L1. Activations from
    ``activations.gemv_activations``, for the K-quants (``SUPERBLOCK_FORMATS``) ``superblock_activations``."""
    n = xq.shape[0]
    per_pass = ROWS_PER_PASS if fmt in SUPERBLOCK_FORMATS else LEGACY_ROWS_PER_PASS
    step = r1 - r0 if n <= per_pass else max(1, PASS_BYTES // raw2d.shape[1])
    for a in range(r0, r1, step):
        b = min(r1, a + step)
        for t0 in range(0, n, per_pass):
            g = min(per_pass, n - t0)
            if fmt == 0:
                rows_dot_q4_0_q8(isa, raw2d, a, b, xq, xd, xsum, xstart, out, t0, g)
            elif fmt == 1:
                rows_dot_q4_1_q8(isa, raw2d, a, b, xq, xd, xsum, xstart, out, t0, g)
            elif fmt == 2:
                rows_dot_q5_0_q8(isa, raw2d, a, b, xq, xd, xsum, xstart, out, t0, g)
            elif fmt == 3:
                rows_dot_q5_1_q8(isa, raw2d, a, b, xq, xd, xsum, xstart, out, t0, g)
            elif fmt == 4:
                rows_dot_q8_0_q8(isa, raw2d, a, b, xq, xd, xsum, xstart, out, t0, g)
            elif fmt == 7:
                rows_dot_q4_k_q8(isa, raw2d, a, b, xq, xd, xsum, xstart, out, t0, g)
            elif fmt == 8:
                rows_dot_q5_k_q8(isa, raw2d, a, b, xq, xd, xsum, xstart, out, t0, g)
            else:
                rows_dot_q6_k_q8(isa, raw2d, a, b, xq, xd, xsum, xstart, out, t0, g)
