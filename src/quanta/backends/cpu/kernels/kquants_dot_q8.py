"""Fast-mode row dot products of Q4_K, Q5_K and Q6_K with 8-bit activations (per-32 q8 blocks), per int8 path.

``rows_dot_<fmt>_q8(isa, raw2d, r0, r1, xq, xd, xsum, xstart, out, t0, g)``: frame and activation layout as in
``q8_rows.py`` (32-weight blocks in pairs, a group of activation rows per pass). A 32-weight slice of a
super-block lines up with one q8 activation block; its unsigned codes (all <= 63: AVX2's i16 pair sums cannot
saturate) are laid out as the activations' pair vectors ``a`` (weights 0-15 of both slices) and ``b`` (16-31).
Q4_K/Q5_K: a slice is one sub-block, ``d*sc_j*xd*isum - dmin*m_j*xsum`` (mins on the quantized activations'
sums), ``a`` and ``b`` summed in one integer dot. Q6_K: a slice holds two 16-weight sub-blocks with their own
scales, so ``a`` and ``b`` are dotted apart and scaled by ``s * d * xd`` per lane group; the code offset 32 is
removed exactly by the dots' starting values (``-32 *`` the sums of the activations). Bit layouts as in
``kquants.py``; tested against gguf-py's dequantize with a tolerance for the activation rounding.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from quanta.backends.cpu.kernels.int8_dots import dot2_u8s8, dot_u8s8
from quanta.backends.cpu.kernels.kquants_dot import _scale_min_k4
from quanta.backends.cpu.kernels.q8_rows import pair_splat, row_lanes, row_sum, rows_dot_q8_intrinsic
from quanta.backends.cpu.kernels.simd import (
    F32, I8, I32, const_vec, fma, hsum, idx, load_f16, load_vec, splat, vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS

_Q4, _Q5, _Q6 = FORMATS["Q4_K"], FORMATS["Q5_K"], FORMATS["Q6_K"]


def _split(builder, bp, off, first: int, second: int, mask: int):
    """<32 x i8>: the 16 bytes at ``off`` shifted right by ``first`` bits, then the same bytes by ``second``, each
    masked by ``mask`` (a 32-bit shift per lane: the bits a byte takes from its neighbour are masked off)."""
    v = load_vec(builder, bp, off, I8)
    v = builder.bitcast(builder.shuffle_vector(v, v, ir.Constant(vec(I32, 32), list(range(16)) * 2)), vec(I32, 8))
    v = builder.lshr(v, const_vec(I32, [first] * 4 + [second] * 4))
    return builder.and_(builder.bitcast(v, vec(I8, 32)), const_vec(I8, [mask] * 32))


def _q4_k_like(with_high_bit: bool):
    fmt = _Q5 if with_high_bit else _Q4
    o_d, o_dmin, o_sc, o_qs = (fmt.offset(f) for f in ("d", "dmin", "scales", "qs"))
    o_qh = fmt.offset("qh") if with_high_bit else 0

    def superblock(isa, builder, bp, b, rows, p0, accs, macc):
        n = len(rows)
        d = load_f16(builder, bp, idx(builder, b, o_d))
        dmin = load_f16(builder, bp, idx(builder, b, o_dmin))
        s = idx(builder, b, o_sc)
        mins = zeros(2 * n)
        for c in range(4):  # sub-blocks 2c (low nibbles of the 32 bytes c) and 2c+1 (high nibbles)
            codes = [_split(builder, bp, idx(builder, b, o_qs + 32 * c + 16 * h), 0, 4, 15) for h in range(2)]
            if with_high_bit:  # bit j of qh[l] is bit 4 of weight l of sub-block j
                for h in range(2):
                    hb = _split(builder, bp, idx(builder, b, o_qh + 16 * h), 2 * c, 2 * c + 1, 1)
                    codes[h] = builder.or_(codes[h], builder.shl(hb, const_vec(I8, [4] * 32)))
            (sc0, mn0), (sc1, mn1) = _scale_min_k4(builder, bp, s, 2 * c), _scale_min_k4(builder, bp, s, 2 * c + 1)
            p = idx(builder, p0, c)
            scales = builder.fmul(pair_splat(builder, builder.fmul(d, sc0), builder.fmul(d, sc1), n), rows.scales(p))
            mins = builder.fadd(mins, builder.fmul(pair_splat(builder, mn0, mn1, n), rows.sums(p)))
            for t, acc in enumerate(accs):
                xa, xb = rows.codes(t, p)
                isum = dot2_u8s8(isa, builder, codes[0], xa, codes[1], xb, small=True)
                slot = acc[c % 2]
                builder.store(fma(builder, row_lanes(builder, scales, t, n), builder.sitofp(isum, vec(F32, 8)),
                                  builder.load(slot)), slot)
        builder.store(builder.fsub(builder.load(macc), builder.fmul(splat(builder, dmin, 2 * n), mins)), macc)

    return superblock


def _q6_k_superblock(isa, builder, bp, b, rows, p0, accs, macc):
    o_ql, o_qh, o_sc, o_d = (_Q6.offset(f) for f in ("ql", "qh", "scales", "d"))
    n = len(rows)
    d = splat(builder, load_f16(builder, bp, idx(builder, b, o_d)), 2 * n)
    for half in range(2):  # weights 128*half + 32*quarter + 0..31 form activation block 4*half + quarter
        ql = idx(builder, b, o_ql + 64 * half)
        ql = [builder.shuffle_vector(load_vec(builder, bp, idx(builder, ql, h), I8),
                                     load_vec(builder, bp, idx(builder, ql, 32 + h), I8),
                                     ir.Constant(vec(I32, 32), list(range(32)))) for h in (0, 16)]
        for q0 in (0, 2):  # quarters q0 and q0+1: the low (q0 = 0) or high nibbles of ql's 64 bytes
            codes = [builder.lshr(v, const_vec(I8, [4] * 32)) if q0 else builder.and_(v, const_vec(I8, [15] * 32))
                     for v in ql]
            for h in range(2):  # two bits per weight in qh: quarter q at bits 2q, 2q+1
                hb = _split(builder, bp, idx(builder, b, o_qh + 32 * half + 16 * h), 2 * q0, 2 * q0 + 2, 3)
                codes[h] = builder.or_(codes[h], builder.shl(hb, const_vec(I8, [4] * 32)))
            sc = builder.sitofp(load_vec(builder, bp, idx(builder, b, o_sc + 8 * half + 2 * q0), I8, 4), vec(F32, 4))
            p = idx(builder, p0, 2 * half + q0 // 2)
            dxd = builder.fmul(d, rows.scales(p))
            s = [builder.extract_element(sc, ir.Constant(I32, j)) for j in range(4)]
            scales = [builder.fmul(pair_splat(builder, s[h], s[2 + h], n), dxd) for h in range(2)]
            for t, acc in enumerate(accs):
                for h, x in enumerate(rows.codes(t, p)):  # 16-weight sub-blocks: lanes 0-3 quarter q0, 4-7 q0+1
                    isum = dot_u8s8(isa, builder, codes[h], x, rows.start(t, p, h))
                    builder.store(fma(builder, row_lanes(builder, scales[h], t, n), builder.sitofp(isum, vec(F32, 8)),
                                      builder.load(acc[h])), acc[h])


def _make_rows_dot_q8(name: str, superblock, fmt):
    def row_body(isa, builder, bp, rows, nb32):
        n = len(rows)
        accs = [[cgutils.alloca_once_value(builder, zeros(8)) for _ in range(2)] for _ in range(n)]
        macc = cgutils.alloca_once_value(builder, zeros(2 * n))
        with cgutils.for_range(builder, builder.sdiv(nb32, ir.Constant(nb32.type, 8))) as loop:
            i = loop.index
            b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
            superblock(isa, builder, bp, b, rows, builder.mul(i, ir.Constant(i.type, 4)), accs, macc)
        mins = builder.load(macc)
        return [builder.fadd(hsum(builder, builder.fadd(builder.load(acc[0]), builder.load(acc[1]))),
                             row_sum(builder, mins, t, n)) for t, acc in enumerate(accs)]

    return rows_dot_q8_intrinsic(name, row_body, fmt.block_size, fmt.type_size)


rows_dot_q4_k_q8 = _make_rows_dot_q8("rows_dot_q4_k_q8", _q4_k_like(False), _Q4)
rows_dot_q5_k_q8 = _make_rows_dot_q8("rows_dot_q5_k_q8", _q4_k_like(True), _Q5)
rows_dot_q6_k_q8 = _make_rows_dot_q8("rows_dot_q6_k_q8", _q6_k_superblock, _Q6)
