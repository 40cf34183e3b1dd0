"""Fast-mode row dot products of Q4_K, Q5_K and Q6_K with 8-bit activations, one scale per 256 (llama.cpp's q8_K).

``rows_dot_<fmt>_q8(isa, raw2d, r0, r1, xq, xd, xsum, xstart, out, t0, g)``: frame as in ``q8_rows.py`` (a group
of activation rows per pass), activations from ``activations.superblock_activations``. A super-block's codes
(unsigned, all <= 63) meet the activations 32 at a time in their natural order: ``vpmaddubsw`` pairs, weighted by
the sub-block's integer scale (``dot_scaled``) into i32 lanes, so that the whole super-block is one integer sum
per lane, converted and scaled by ``d * xd`` once. Q4_K/Q5_K: the minimums ``dmin * m_j`` against the activation
sums per 32. Q6_K: 16-weight sub-blocks with signed scales, the code offset 32 removed from the integer sum
exactly (``32 * sum_j scale_j * sum16_j`` of the activations). Bit layouts as in ``kquants.py``; tested against
gguf-py's dequantize with llama.cpp's q8_K rounding of the activations.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from quanta.backends.cpu.kernels.int8_dots import dot_scaled, madd_i16
from quanta.backends.cpu.kernels.q8_rows import rows_dot_q8_intrinsic
from quanta.backends.cpu.kernels.simd import (
    F32, I8, I16, I32, const_vec, fma, hsum, idx, load_f16, load_vec, prefetch_ahead, splat, vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS

_Q4, _Q5, _Q6 = FORMATS["Q4_K"], FORMATS["Q5_K"], FORMATS["Q6_K"]
_ZERO = ir.Constant(vec(I32, 8), [0] * 8)


def _scales_mins_k4(builder, bp, s):
    """<16 x i8>: the 8 sub-blocks' 6-bit scales, then their 6-bit minimums, from the 12 packed bytes at ``s``
    (get_scale_min_k4 for all eight at once, llama.cpp's ``utmp`` masks on the words u0-u2 in vector lanes: scales
    0-3 = u0 & 0x3F.., scales 4-7 = u2 & 0x0F.. | (u0 >> 2) & 0x30.., the minimums likewise from u1 and u2 >> 4).
    The 16-byte load reads 4 bytes past the scales, inside the block (``qh`` or ``qs``)."""
    u = builder.bitcast(load_vec(builder, bp, s, I8, 16), vec(I32, 4))
    low = builder.and_(builder.lshr(_lanes(builder, u, [0, 2, 1, 2]), const_vec(I32, [0, 0, 0, 4])),
                       const_vec(I32, [0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]))
    top = builder.and_(builder.lshr(_lanes(builder, u, [0, 0, 1, 1]), const_vec(I32, [2] * 4)),
                       const_vec(I32, [0, 0x30303030, 0, 0x30303030]))
    return builder.bitcast(builder.or_(low, top), vec(I8, 16))


def _lanes(builder, v, lanes):
    return builder.shuffle_vector(v, v, const_vec(I32, lanes))


def _finish(builder, rows, s, d, isums, accs) -> None:
    """Each row's super-block sum (``isums[t]``: two chains of i32 lanes) times ``d`` and its activation scale, into
    ``accs``."""
    n = len(rows)
    scales = builder.fmul(rows.superblock_scales(s), splat(builder, d, n))
    for t, acc in enumerate(accs):
        total = builder.sitofp(builder.add(*isums[t]), vec(F32, 8))
        builder.store(fma(builder, total, _lanes(builder, scales, [t] * 8), builder.load(acc)), acc)


def _q4_k_like(with_high_bit: bool):
    fmt = _Q5 if with_high_bit else _Q4
    o_d, o_dmin, o_sc, o_qs = (fmt.offset(f) for f in ("d", "dmin", "scales", "qs"))
    o_qh = fmt.offset("qh") if with_high_bit else 0

    def superblock(isa, builder, bp, b, rows, s, accs):
        d = load_f16(builder, bp, idx(builder, b, o_d))
        dmin = load_f16(builder, bp, idx(builder, b, o_dmin))
        packed = _scales_mins_k4(builder, bp, idx(builder, b, o_sc))
        scales = builder.zext(_lanes(builder, packed, range(8)), vec(I16, 8))
        neg_mins = builder.fmul(builder.uitofp(_lanes(builder, packed, range(8, 16)), vec(F32, 8)),
                                splat(builder, builder.fneg(dmin), 8))
        qh = load_vec(builder, bp, idx(builder, b, o_qh), I8, 32) if with_high_bit else None
        isums = [[_ZERO, _ZERO] for _ in accs]
        for c in range(4):  # sub-blocks 2c (low nibbles of the 32 bytes c) and 2c+1 (high nibbles)
            q = load_vec(builder, bp, idx(builder, b, o_qs + 32 * c), I8, 32)
            codes = [builder.and_(q, const_vec(I8, [15] * 32)), builder.lshr(q, const_vec(I8, [4] * 32))]
            if with_high_bit:  # bit j of qh[l] is bit 4 of weight l of sub-block j
                codes = [builder.or_(v, builder.shl(builder.and_(builder.lshr(qh, const_vec(I8, [2 * c + h] * 32)),
                                                                 const_vec(I8, [1] * 32)), const_vec(I8, [4] * 32)))
                         for h, v in enumerate(codes)]
            p = builder.add(builder.mul(s, ir.Constant(s.type, 4)), ir.Constant(s.type, c))
            sub_scales = [_lanes(builder, scales, [2 * c + h] * 16) for h in range(2)]
            for t in range(len(accs)):
                for h, x in enumerate(rows.codes(t, p)):
                    isums[t][h] = dot_scaled(isa, builder, isums[t][h], codes[h], x, sub_scales[h])
        _finish(builder, rows, s, d, isums, accs)
        for t, acc in enumerate(accs):
            builder.store(fma(builder, neg_mins, rows.superblock_sums(t, s), builder.load(acc)), acc)

    return superblock


def _q6_k_superblock(isa, builder, bp, b, rows, s, accs):
    o_ql, o_qh, o_sc, o_d = (_Q6.offset(f) for f in ("ql", "qh", "scales", "d"))
    d = load_f16(builder, bp, idx(builder, b, o_d))
    scales = builder.sext(load_vec(builder, bp, idx(builder, b, o_sc), I8, 16), vec(I16, 16))
    isums = [[builder.sub(_ZERO, builder.shl(madd_i16(isa, builder, rows.superblock_sums16(t, s), scales),
                                             const_vec(I32, [5] * 8))), _ZERO] for t in range(len(accs))]
    for half in range(2):  # weights 128*half + 32*quarter + 0..31: the activations' 32 of pair 2*half + quarter // 2
        ql = [load_vec(builder, bp, idx(builder, b, o_ql + 64 * half + 32 * j), I8, 32) for j in range(2)]
        qh = load_vec(builder, bp, idx(builder, b, o_qh + 32 * half), I8, 32)
        for quarter in range(4):  # ql's low nibbles (quarters 0, 1) or high ones; qh's bits 2q, 2q+1
            v = ql[quarter % 2]
            low = builder.lshr(v, const_vec(I8, [4] * 32)) if quarter >= 2 else builder.and_(v, const_vec(I8, [15] * 32))
            high = builder.and_(builder.lshr(qh, const_vec(I8, [2 * quarter] * 32)), const_vec(I8, [3] * 32))
            codes = builder.or_(low, builder.shl(high, const_vec(I8, [4] * 32)))
            first = 8 * half + 2 * quarter  # the scales of weights 0-15 and 16-31 of this 32
            pair_scales = _lanes(builder, scales, [first] * 8 + [first + 1] * 8)
            p = builder.add(builder.mul(s, ir.Constant(s.type, 4)), ir.Constant(s.type, 2 * half + quarter // 2))
            for t in range(len(accs)):
                x = rows.codes(t, p)[quarter % 2]
                isums[t][quarter % 2] = dot_scaled(isa, builder, isums[t][quarter % 2], codes, x, pair_scales)
    _finish(builder, rows, s, d, isums, accs)


def _make_rows_dot_q8(name: str, superblock, fmt):
    def row_body(isa, builder, bp, rows, nb32):
        accs = [cgutils.alloca_once_value(builder, zeros(8)) for _ in range(len(rows))]
        with cgutils.for_range(builder, builder.sdiv(nb32, ir.Constant(nb32.type, 8))) as loop:
            i = loop.index
            b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
            prefetch_ahead(builder, bp, b, fmt.type_size)
            superblock(isa, builder, bp, b, rows, i, accs)
        return [hsum(builder, builder.load(acc)) for acc in accs]

    return rows_dot_q8_intrinsic(name, row_body, fmt.block_size, fmt.type_size)


rows_dot_q4_k_q8 = _make_rows_dot_q8("rows_dot_q4_k_q8", _q4_k_like(False), _Q4)
rows_dot_q5_k_q8 = _make_rows_dot_q8("rows_dot_q5_k_q8", _q4_k_like(True), _Q5)
rows_dot_q6_k_q8 = _make_rows_dot_q8("rows_dot_q6_k_q8", _q6_k_superblock, _Q6)
