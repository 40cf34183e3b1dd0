"""Row dot products of the K-quants with fp32 activations, as explicit-SIMD intrinsics (Q4_K, Q5_K, Q6_K).

``rows_dot_<fmt>(raw2d, r0, r1, x, xsum, out)`` sets ``out[r] = dot(dequantize(raw2d[r]), x)`` for rows
r0..r1-1 (row loop in IR, ``simd.rows_dot_intrinsic``); ``xsum[i]`` is the sum of ``x[32i:32i+32]`` (used by
the per-sub-block mins of Q4_K/Q5_K: ``w = d*sc_j*q - dmin*m_j`` so a sub-block adds
``d*sc_j*dot(q, x) - dmin*m_j*xsum``). Quants are expanded
16 at a time into ``<16 x float>`` and accumulated with the sub-block scale broadcast. Bit layouts as in
``kquants.py`` (ggml-quants.c); tested against gguf-py's dequantize.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from quanta.backends.cpu.kernels.simd import (
    F32, I8, I32, const_vec, fma, hsum, idx, load_f16, load_vec, nibble, prefetch_ahead, rows_dot_intrinsic, splat,
    vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS

_Q4, _Q5, _Q6 = FORMATS["Q4_K"], FORMATS["Q5_K"], FORMATS["Q6_K"]


def _u8(builder, bp, off):
    return builder.zext(builder.load(builder.gep(bp, [off])), I32)


def _scale_min_k4(builder, bp, s, j: int):
    """(scale, min) of sub-block j as float, from the 12 packed 6-bit bytes at ``s`` (get_scale_min_k4)."""
    c63, c15 = ir.Constant(I32, 63), ir.Constant(I32, 15)
    c4, c6 = ir.Constant(I32, 4), ir.Constant(I32, 6)
    if j < 4:
        sc = builder.and_(_u8(builder, bp, idx(builder, s, j)), c63)
        mn = builder.and_(_u8(builder, bp, idx(builder, s, j + 4)), c63)
    else:
        b_j4 = _u8(builder, bp, idx(builder, s, j + 4))
        top_sc = builder.shl(builder.lshr(_u8(builder, bp, idx(builder, s, j - 4)), c6), c4)
        top_mn = builder.shl(builder.lshr(_u8(builder, bp, idx(builder, s, j)), c6), c4)
        sc = builder.or_(builder.and_(b_j4, c15), top_sc)
        mn = builder.or_(builder.lshr(b_j4, c4), top_mn)
    return builder.uitofp(sc, F32), builder.uitofp(mn, F32)


def q4_k_like_unpacker(with_high_bit: bool):
    """Unpack a Q4_K (or Q5_K) super-block: calls ``sink(q, scale, min, pos, j)`` per 16 weights, where the
    weights at ``pos..pos+15`` are ``scale*q - min`` (q a <16 x float> of codes, j the 32-weight sub-block)."""
    fmt = _Q5 if with_high_bit else _Q4
    o_d, o_dmin, o_sc, o_qs = (fmt.offset(f) for f in ("d", "dmin", "scales", "qs"))
    o_qh = fmt.offset("qh") if with_high_bit else 0

    def unpack(builder, bp, b, sink):
        d = load_f16(builder, bp, idx(builder, b, o_d))
        dmin = load_f16(builder, bp, idx(builder, b, o_dmin))
        s = idx(builder, b, o_sc)
        qh = [load_vec(builder, bp, idx(builder, b, o_qh + 16 * g), I8) for g in range(2)] if with_high_bit else None
        for j in range(8):  # sub-block j: chunk j//2, low (even j) or high (odd j) nibbles
            sc, mn = _scale_min_k4(builder, bp, s, j)
            scale, mnv = builder.fmul(d, sc), builder.fmul(dmin, mn)
            for g in range(2):
                q = load_vec(builder, bp, idx(builder, b, o_qs + 32 * (j // 2) + 16 * g), I8)
                q = nibble(builder, q, high=j % 2 == 1)
                if with_high_bit:  # bit j of qh[l] is the fifth bit of weight l of sub-block j
                    hb = builder.and_(builder.lshr(qh[g], const_vec(I8, [j] * 16)), const_vec(I8, [1] * 16))
                    q = builder.or_(q, builder.shl(hb, const_vec(I8, [4] * 16)))
                sink(builder.uitofp(q, vec(F32)), scale, mnv, 32 * j + 16 * g, j)

    return unpack


def q6_k_unpack(builder, bp, b, sink):
    """Unpack a Q6_K super-block: ``sink(q, scale, None, pos, j)`` per 16 weights ``scale*q`` (q signed codes)."""
    o_ql, o_qh, o_sc, o_d = (_Q6.offset(f) for f in ("ql", "qh", "scales", "d"))
    d = load_f16(builder, bp, idx(builder, b, o_d))
    for half in range(2):
        for quarter in range(4):
            for g in range(2):  # 16 weights with one scale: low/high nibble of ql, 2 bits of qh, minus 32
                lo = load_vec(builder, bp, idx(builder, b, o_ql + 64 * half + 32 * (quarter & 1) + 16 * g), I8)
                lo = nibble(builder, lo, high=quarter >= 2)
                hi = load_vec(builder, bp, idx(builder, b, o_qh + 32 * half + 16 * g), I8)
                hi = builder.and_(builder.lshr(hi, const_vec(I8, [2 * quarter] * 16)), const_vec(I8, [3] * 16))
                q = builder.sub(builder.or_(lo, builder.shl(hi, const_vec(I8, [4] * 16))), const_vec(I8, [32] * 16))
                j = 8 * half + 2 * quarter + g
                sc = builder.sitofp(builder.load(builder.gep(bp, [idx(builder, b, o_sc + j)])), F32)
                sink(builder.sitofp(q, vec(F32)), builder.fmul(d, sc), None, 128 * half + 32 * quarter + 16 * g, j)


def _make_rows_dot(name: str, unpack, fmt):
    def row_body(builder, bp, act_ptrs, nb32):
        xp, sp = act_ptrs
        accs = [cgutils.alloca_once_value(builder, zeros()) for _ in range(4)]
        macc = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
        with cgutils.for_range(builder, builder.sdiv(nb32, ir.Constant(nb32.type, 8))) as loop:
            i = loop.index
            prefetch_ahead(builder, bp, builder.mul(i, ir.Constant(i.type, fmt.type_size)), fmt.type_size)
            xo = builder.mul(i, ir.Constant(i.type, 256))
            so = builder.mul(i, ir.Constant(i.type, 8))
            n = iter(range(1 << 30))

            def sink(q, scale, mn, pos, j):
                slot = accs[next(n) % len(accs)]
                t = builder.fmul(q, load_vec(builder, xp, idx(builder, xo, pos), F32))
                builder.store(fma(builder, splat(builder, scale), t, builder.load(slot)), slot)
                if mn is not None and pos % 32 == 0:  # once per 32-weight sub-block: - min * sum(x)
                    mx = builder.fmul(mn, builder.load(builder.gep(sp, [idx(builder, so, j)])))
                    builder.store(builder.fsub(builder.load(macc), mx), macc)

            unpack(builder, bp, builder.mul(i, ir.Constant(i.type, fmt.type_size)), sink)
        acc = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                           builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
        return builder.fadd(hsum(builder, acc), builder.load(macc))

    return rows_dot_intrinsic(name, row_body, fmt.block_size, fmt.type_size)


rows_dot_q4_k = _make_rows_dot("rows_dot_q4_k", q4_k_like_unpacker(False), _Q4)
rows_dot_q5_k = _make_rows_dot("rows_dot_q5_k", q4_k_like_unpacker(True), _Q5)
rows_dot_q6_k = _make_rows_dot("rows_dot_q6_k", q6_k_unpack, _Q6)
