"""8-bit activation quantization for the fast-mode integer dot products (llama.cpp's q8_0 / q8_1 / q8_K schemes).

Each block of 32 activations gets ``d = max|x| / 127`` and ``xq = round(x / d)`` (int8). Alongside we keep the
block sum of the *quantized* activations ``d * sum(xq)`` (for the minimums of Q4_1/Q5_1 and the K-quants) and the
integer sum of ``xq`` (for the constant offsets of Q4_0/Q5_0/Q8_0, subtracted exactly in integer arithmetic).

Why the quantized sum, as llama.cpp's q8_1 ``s``: the dot is then exactly ``w · x̂`` and its error ``w · (x̂ - x)``
with centred weights ``w = d·u + m``. With the exact sum the error becomes ``d·u · (x̂ - x)``, where the all-positive
codes ``u`` do not cancel: 3.4× the error on SmolLM2's Q4_1 layers and 2 points of top-1 agreement.

The K-quant GEMVs take one scale per 256 activations instead (``superblock_activations``, llama.cpp's q8_K): the
super-block's sub-block scales then apply in integer arithmetic and its float work is done once per 256 weights.

A block's maximum and codes are explicit vector code (``_abs_max32``, ``_codes16``): numba's loops took ~3 ns an
activation, which made quantizing a decode batch's activations a tenth of its GEMVs (8 rows of 576: 13 → 3.8 µs).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.simd import F32, I8, I32, call, data_ptr, load_vec, splat, vec


@intrinsic
def _abs_max32(typingctx, x, j0):
    """``max(|x[j0:j0+32]|)`` of a C-contiguous float32 row, in vector lanes (the order of a maximum is free)."""

    def codegen(context, builder, signature, args):
        v = load_vec(builder, data_ptr(context, builder, signature.args[0], args[0]), args[1], F32, 32)
        v = call(builder, "llvm.fabs.v32f32", vec(F32, 32), v)
        n = 32
        while n > 1:
            half = n // 2
            lo = builder.shuffle_vector(v, v, ir.Constant(vec(I32, half), list(range(half))))
            hi = builder.shuffle_vector(v, v, ir.Constant(vec(I32, half), list(range(half, n))))
            v = call(builder, f"llvm.maxnum.v{half}f32", vec(F32, half), lo, hi)
            n = half
        return builder.extract_element(v, ir.Constant(I32, 0))

    return types.float32(x, types.intp), codegen


@intrinsic
def _codes16(typingctx, x, j0, inv, xq, at):
    """``xq[at:at+16] = rint(x[j0:j0+16] * inv)`` (to nearest, ties to even, as ``np.rint``) for a C-contiguous
    float32 row ``x`` and int8 row ``xq``; returns the codes' sum."""

    def codegen(context, builder, signature, args):
        v = load_vec(builder, data_ptr(context, builder, signature.args[0], args[0]), args[1], F32, 16)
        v = call(builder, "llvm.rint.v16f32", vec(F32, 16), builder.fmul(v, splat(builder, args[2], 16)))
        q = builder.fptosi(v, vec(I32, 16))
        xq = data_ptr(context, builder, signature.args[3], args[3])
        out = builder.bitcast(builder.gep(xq, [args[4]]), vec(I8, 16).as_pointer())
        builder.store(builder.trunc(q, vec(I8, 16)), out, align=1)
        return call(builder, "llvm.vector.reduce.add.v16i32", I32, q)

    return types.int32(x, types.intp, types.float32, xq, types.intp), codegen


@njit
def _quantize_block(x, j0, xq, first, second):
    """The codes of ``x[j0:j0+32]``, the first 16 into ``xq[first:]``, the others into ``xq[second:]``; returns the
    scale and the integer sum of the codes."""
    d = _abs_max32(x, j0) / np.float32(127.0)
    inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
    return d, _codes16(x, j0, inv, xq, first) + _codes16(x, j0 + 16, inv, xq, second)


@njit
def quantize_q8_32(x, xq, xd, xsum, xqsum):
    """Quantize rows ``x`` (n, k) into ``xq`` (n, k) int8 with per-32 scales ``xd`` and sums (n, k/32)."""
    n, k = x.shape
    for t in range(n):
        for i in range(k // 32):
            d, qs = _quantize_block(x[t], 32 * i, xq[t], 32 * i, 32 * i + 16)
            xd[t, i] = d
            xsum[t, i] = d * np.float32(qs)
            xqsum[t, i] = qs


@njit
def gemv_activations(x, xq, xd, xsum, xstart, block_offset):
    """The fast GEMV's q8 activations in the layout of ``q8_rows.py``: codes ``xq`` (n, 64 * pairs) in block pairs,
    scales ``xd`` and sums ``xsum`` (groups, pairs, 8), and with a weight code offset (Q4_0, Q5_0, Q8_0) the
    integer dots' starting values ``xstart`` (n, pairs, 8): ``-block_offset * sum(codes)`` in the first lane of
    each block."""
    n, k = x.shape
    nb, group = k // 32, xd.shape[2] // 2
    for t in range(n):
        g, r = t // group, t % group
        for i in range(nb):
            p, j = i // 2, i % 2
            d, qs = _quantize_block(x[t], 32 * i, xq[t], 64 * p + 16 * j, 64 * p + 32 + 16 * j)
            xd[g, p, group * j + r] = d
            xsum[g, p, group * j + r] = d * np.float32(qs)
            if block_offset:
                xstart[t, p, 4 * j] = -block_offset * qs
                xstart[t, p, 4 * j + 1 : 4 * j + 4] = 0
        if nb % 2:  # the last block's partner (its halves at 64p + 16 and 64p + 48): zero codes, scales and starts
            xq[t, 32 * nb - 16 : 32 * nb] = 0
            xq[t, 32 * nb + 16 : 32 * nb + 32] = 0
            xd[g, nb // 2, group + r] = 0
            xsum[g, nb // 2, group + r] = 0
            xstart[t, nb // 2, 4:] = 0


@njit
def superblock_activations(x, xq, xd, xsum, xstart):
    """The K-quant GEMVs' activations (layout in ``q8_rows.py``): for super-block s of row t (group g = t // 4,
    r = t % 4) the codes in their natural order in ``xq[t]``, the scale ``xd[g, s, r]`` (d = max|x| / 127), the
    8 floats ``xsum[g, r * S + s]`` (S super-blocks per row): ``d * sum(codes)`` per 32 (Q4_K/Q5_K's minimums),
    and the 16 integer sums per 16 (Q6_K's code offset) as int16 pairs in ``xstart[t, s]``."""
    n, k = x.shape
    group, superblocks = xd.shape[2] // 2, k // 256
    for t in range(n):
        g, r = t // group, t % group
        for s in range(superblocks):
            amax = np.float32(0.0)
            for j in range(256 * s, 256 * s + 256, 32):
                amax = max(amax, _abs_max32(x[t], j))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            xd[g, s, r] = d
            for b in range(0, 16, 2):  # two sums of 16 codes packed little-endian into one int32
                j = 256 * s + 16 * b
                first, second = _codes16(x[t], j, inv, xq[t], j), _codes16(x[t], j + 16, inv, xq[t], j + 16)
                xstart[t, s, b // 2] = (first & 0xFFFF) | (second << 16)
                xsum[g, r * superblocks + s, b // 2] = d * np.float32(first + second)
