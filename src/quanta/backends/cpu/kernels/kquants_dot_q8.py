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
from quanta.backends.cpu.kernels.q8_rows import row_lanes, row_sum, rows_dot_q8_intrinsic
from quanta.backends.cpu.kernels.simd import (
    F32, I8, I32, const_vec, fma, hsum, idx, load_f16, load_scalar, load_vec, splat, vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS

_Q4, _Q5, _Q6 = FORMATS["Q4_K"], FORMATS["Q5_K"], FORMATS["Q6_K"]


def _load_i32(builder, bp, off):
    return load_scalar(builder, bp, off, I32)


def _scales_mins_k4(builder, bp, s, d, dmin):
    """<8 x float> ``d * scale_j`` and <8 x float> ``dmin * min_j`` of the 8 sub-blocks, from the 12 packed 6-bit
    bytes at ``s`` (get_scale_min_k4 for all eight at once, on 32-bit words: llama.cpp's ``utmp`` masks)."""
    u0, u1, u2 = (_load_i32(builder, bp, idx(builder, s, 4 * w)) for w in range(3))

    def c(v: int):
        return ir.Constant(I32, v)

    low6, low4, top2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)

    def high(u_low4, u_top, shift_low4: int):  # sub-blocks 4-7: 4 bits from bytes 8-11, the top 2 of bytes 0-7
        lo = builder.and_(builder.lshr(u_low4, c(shift_low4)) if shift_low4 else u_low4, low4)
        return builder.or_(lo, builder.shl(builder.and_(builder.lshr(u_top, c(6)), top2), c(4)))

    words = [builder.and_(u0, low6), high(u2, u0, 0), builder.and_(u1, low6), high(u2, u1, 4)]
    v = ir.Constant(vec(I32, 4), ir.Undefined)
    for w, word in enumerate(words):
        v = builder.insert_element(v, word, ir.Constant(I32, w))
    values = builder.uitofp(builder.bitcast(v, vec(I8, 16)), vec(F32, 16))  # scales 0-7, then mins 0-7
    factors = builder.shuffle_vector(splat(builder, d, 1), splat(builder, dmin, 1), const_vec(I32, [0] * 8 + [1] * 8))
    values = builder.fmul(values, factors)
    return tuple(builder.shuffle_vector(values, values, const_vec(I32, range(8 * h, 8 * h + 8))) for h in range(2))


def _pair_lanes(builder, v, first: int, rows: int):
    """<2 * rows x float>: lane ``first`` of ``v`` for block 2p of each row, lane ``first + 1`` for block 2p+1."""
    return builder.shuffle_vector(v, v, const_vec(I32, [first] * rows + [first + 1] * rows))


def _halves(builder, lo, hi):
    """The pair vectors (a, b) of two sub-blocks' 32 codes each: a = lo[0:16], hi[0:16]; b = lo[16:32], hi[16:32]."""
    return tuple(builder.shuffle_vector(lo, hi, const_vec(I32, [*range(h, h + 16), *range(32 + h, 48 + h)]))
                 for h in (0, 16))


def _q4_k_like(with_high_bit: bool):
    fmt = _Q5 if with_high_bit else _Q4
    o_d, o_dmin, o_sc, o_qs = (fmt.offset(f) for f in ("d", "dmin", "scales", "qs"))
    o_qh = fmt.offset("qh") if with_high_bit else 0

    def superblock(isa, builder, bp, b, rows, p0, accs, macc):
        n = len(rows)
        d = load_f16(builder, bp, idx(builder, b, o_d))
        dmin = load_f16(builder, bp, idx(builder, b, o_dmin))
        scales, mins = _scales_mins_k4(builder, bp, idx(builder, b, o_sc), d, dmin)
        qh = load_vec(builder, bp, idx(builder, b, o_qh), I8, 32) if with_high_bit else None
        for c in range(4):  # sub-blocks 2c (low nibbles of the 32 bytes c) and 2c+1 (high nibbles)
            q = load_vec(builder, bp, idx(builder, b, o_qs + 32 * c), I8, 32)
            lo, hi = builder.and_(q, const_vec(I8, [15] * 32)), builder.lshr(q, const_vec(I8, [4] * 32))
            if with_high_bit:  # bit j of qh[l] is bit 4 of weight l of sub-block j
                lo, hi = (builder.or_(v, builder.shl(builder.and_(builder.lshr(qh, const_vec(I8, [j] * 32)),
                                                                  const_vec(I8, [1] * 32)), const_vec(I8, [4] * 32)))
                          for v, j in ((lo, 2 * c), (hi, 2 * c + 1)))
            a, bv = _halves(builder, lo, hi)
            p = idx(builder, p0, c)
            row_scales = builder.fmul(_pair_lanes(builder, scales, 2 * c, n), rows.scales(p))
            slot = macc[c % 2]  # two dependency chains
            builder.store(fma(builder, _pair_lanes(builder, mins, 2 * c, n), rows.sums(p), builder.load(slot)), slot)
            for t, acc in enumerate(accs):
                xa, xb = rows.codes(t, p)
                isum = dot2_u8s8(isa, builder, a, xa, bv, xb, small=True)
                slot = acc[c % 2]
                builder.store(fma(builder, row_lanes(builder, row_scales, t, n), builder.sitofp(isum, vec(F32, 8)),
                                  builder.load(slot)), slot)

    return superblock


def _q6_k_superblock(isa, builder, bp, b, rows, p0, accs, macc):
    o_ql, o_qh, o_sc, o_d = (_Q6.offset(f) for f in ("ql", "qh", "scales", "d"))
    n = len(rows)
    d = load_f16(builder, bp, idx(builder, b, o_d))
    scales = builder.fmul(builder.sitofp(load_vec(builder, bp, idx(builder, b, o_sc), I8, 16), vec(F32, 16)),
                          splat(builder, d, 16))  # d * the 16 sub-blocks' scales
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
            p = idx(builder, p0, 2 * half + q0 // 2)
            xd = rows.scales(p)
            first = 8 * half + 2 * q0  # scale of 16-weight sub-block (quarter q0, h); quarter q0+1's is first + 2 + h
            pair = [builder.shuffle_vector(scales, scales, const_vec(I32, [first + h] * n + [first + 2 + h] * n))
                    for h in range(2)]
            row_scales = [builder.fmul(v, xd) for v in pair]
            for t, acc in enumerate(accs):
                for h, x in enumerate(rows.codes(t, p)):  # 16-weight sub-blocks: lanes 0-3 quarter q0, 4-7 q0+1
                    isum = dot_u8s8(isa, builder, codes[h], x, rows.start(t, p, h))
                    builder.store(fma(builder, row_lanes(builder, row_scales[h], t, n),
                                      builder.sitofp(isum, vec(F32, 8)), builder.load(acc[h])), acc[h])


def _split(builder, bp, off, first: int, second: int, mask: int):
    """<32 x i8>: the 16 bytes at ``off`` shifted right by ``first`` bits, then the same bytes by ``second``, each
    masked by ``mask`` (a 32-bit shift per lane: the bits a byte takes from its neighbour are masked off)."""
    v = load_vec(builder, bp, off, I8)
    v = builder.bitcast(builder.shuffle_vector(v, v, ir.Constant(vec(I32, 32), list(range(16)) * 2)), vec(I32, 8))
    v = builder.lshr(v, const_vec(I32, [first] * 4 + [second] * 4))
    return builder.and_(builder.bitcast(v, vec(I8, 32)), const_vec(I8, [mask] * 32))


def _make_rows_dot_q8(name: str, superblock, fmt):
    def row_body(isa, builder, bp, rows, nb32):
        n = len(rows)
        accs = [[cgutils.alloca_once_value(builder, zeros(8)) for _ in range(2)] for _ in range(n)]
        macc = [cgutils.alloca_once_value(builder, zeros(2 * n)) for _ in range(2)]
        with cgutils.for_range(builder, builder.sdiv(nb32, ir.Constant(nb32.type, 8))) as loop:
            i = loop.index
            b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
            superblock(isa, builder, bp, b, rows, builder.mul(i, ir.Constant(i.type, 4)), accs, macc)
        mins = builder.fadd(*(builder.load(m) for m in macc))  # Q4_K/Q5_K: sum of dmin * min_j * xsum (Q6_K: 0)
        return [builder.fsub(hsum(builder, builder.fadd(builder.load(acc[0]), builder.load(acc[1]))),
                             row_sum(builder, mins, t, n)) for t, acc in enumerate(accs)]

    return rows_dot_q8_intrinsic(name, row_body, fmt.block_size, fmt.type_size)


rows_dot_q4_k_q8 = _make_rows_dot_q8("rows_dot_q4_k_q8", _q4_k_like(False), _Q4)
rows_dot_q5_k_q8 = _make_rows_dot_q8("rows_dot_q5_k_q8", _q4_k_like(True), _Q5)
rows_dot_q6_k_q8 = _make_rows_dot_q8("rows_dot_q6_k_q8", _q6_k_superblock, _Q6)
