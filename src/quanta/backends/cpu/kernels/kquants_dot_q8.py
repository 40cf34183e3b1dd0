"""Fast-mode row dot products of Q4_K, Q5_K and Q6_K with 8-bit activations (per-32 q8 blocks), per int8 path.

``rows_dot_<fmt>_q8(isa, raw2d, r0, r1, xq, xd, xsum, xqsum, out)`` sets ``out[r]`` for rows r0..r1-1 (row loop in
IR, ``simd.rows_dot_intrinsic``). A 32-weight slice of a super-block lines up with one q8 activation
block, so its unsigned codes (all <= 63: AVX2's i16 pairs cannot saturate) meet ``xq`` in one ``dot_u8s8``
(``legacy_dot_q8.py``). Q4_K/Q5_K: one sub-block
per slice, ``d*sc_j*xd*isum - dmin*m_j*xsum`` (mins on the exact fp32 sums). Q6_K: a slice holds two 16-weight
sub-blocks, which land in i32 lanes 0-3 and 4-7, so the scale is a vector ``[s0]*4 + [s1]*4``; the code offset
32 is removed exactly with a second ``vpdpbusd`` of 32s against ``xq``. Bit layouts as in ``kquants.py``;
tested against gguf-py's dequantize with a tolerance for the activation rounding.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from quanta.backends.cpu.kernels.kquants_dot import _scale_min_k4
from quanta.backends.cpu.kernels.legacy_dot_q8 import dot_u8s8
from quanta.backends.cpu.kernels.simd import (
    F32, I8, I32, const_vec, fma, hsum, idx, load_f16, load_vec, nibble, rows_dot_intrinsic, splat, vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS

_Q4, _Q5, _Q6 = FORMATS["Q4_K"], FORMATS["Q5_K"], FORMATS["Q6_K"]


def _q4_k_like(with_high_bit: bool):
    fmt = _Q5 if with_high_bit else _Q4
    o_d, o_dmin, o_sc, o_qs = (fmt.offset(f) for f in ("d", "dmin", "scales", "qs"))
    o_qh = fmt.offset("qh") if with_high_bit else 0

    def superblock(isa, builder, bp, b, qp, dp, sp, bi0, accs, macc):
        d = load_f16(builder, bp, idx(builder, b, o_d))
        dmin = load_f16(builder, bp, idx(builder, b, o_dmin))
        s = idx(builder, b, o_sc)
        qh = load_vec(builder, bp, idx(builder, b, o_qh), I8, 32) if with_high_bit else None
        mins = ir.Constant(F32, 0.0)
        for j in range(8):
            q = load_vec(builder, bp, idx(builder, b, o_qs + 32 * (j // 2)), I8, 32)
            q = nibble(builder, q, high=j % 2 == 1)
            if with_high_bit:  # bit j of qh[l] is bit 4 of weight l of sub-block j
                hb = builder.and_(builder.lshr(qh, const_vec(I8, [j] * 32)), const_vec(I8, [1] * 32))
                q = builder.or_(q, builder.shl(hb, const_vec(I8, [4] * 32)))
            bi = idx(builder, bi0, j)
            isum = dot_u8s8(isa, builder, q, load_vec(builder, qp, builder.mul(bi, ir.Constant(bi.type, 32)), I8, 32))
            sc, mn = _scale_min_k4(builder, bp, s, j)
            scale = builder.fmul(builder.fmul(d, sc), builder.load(builder.gep(dp, [bi])))
            slot = accs[j % len(accs)]
            acc = fma(builder, splat(builder, scale, 8), builder.sitofp(isum, vec(F32, 8)), builder.load(slot))
            builder.store(acc, slot)
            mins = builder.fadd(mins, builder.fmul(mn, builder.load(builder.gep(sp, [bi]))))
        builder.store(builder.fsub(builder.load(macc), builder.fmul(dmin, mins)), macc)

    return superblock


def _q6_k_superblock(isa, builder, bp, b, qp, dp, sp, bi0, accs, macc):
    o_ql, o_qh, o_sc, o_d = (_Q6.offset(f) for f in ("ql", "qh", "scales", "d"))
    d = load_f16(builder, bp, idx(builder, b, o_d))
    thirty_two = const_vec(I8, [32] * 32)
    for half in range(2):
        qh = load_vec(builder, bp, idx(builder, b, o_qh + 32 * half), I8, 32)
        for quarter in range(4):  # 32 weights = activation block 4*half + quarter, sub-blocks 2 of 16
            lo = load_vec(builder, bp, idx(builder, b, o_ql + 64 * half + 32 * (quarter & 1)), I8, 32)
            lo = nibble(builder, lo, high=quarter >= 2)
            hi = builder.and_(builder.lshr(qh, const_vec(I8, [2 * quarter] * 32)), const_vec(I8, [3] * 32))
            u = builder.or_(lo, builder.shl(hi, const_vec(I8, [4] * 32)))
            bi = idx(builder, bi0, 4 * half + quarter)
            xv = load_vec(builder, qp, builder.mul(bi, ir.Constant(bi.type, 32)), I8, 32)
            isum = builder.sub(dot_u8s8(isa, builder, u, xv), dot_u8s8(isa, builder, thirty_two, xv))
            sc2 = load_vec(builder, bp, idx(builder, b, o_sc + 8 * half + 2 * quarter), I8, 2)
            sc2 = builder.sitofp(sc2, vec(F32, 2))
            sc2 = builder.fmul(sc2, splat(builder, builder.fmul(d, builder.load(builder.gep(dp, [bi]))), 2))
            scale = builder.shuffle_vector(sc2, sc2, ir.Constant(vec(I32, 8), [0, 0, 0, 0, 1, 1, 1, 1]))
            slot = accs[quarter % len(accs)]
            builder.store(fma(builder, scale, builder.sitofp(isum, vec(F32, 8)), builder.load(slot)), slot)


def _make_rows_dot_q8(name: str, superblock, fmt):
    def row_body(isa, builder, bp, act_ptrs, nb32):
        qp, dp, sp, _ = act_ptrs
        accs = [cgutils.alloca_once_value(builder, zeros(8)) for _ in range(4)]
        macc = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
        with cgutils.for_range(builder, builder.sdiv(nb32, ir.Constant(nb32.type, 8))) as loop:
            i = loop.index
            b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
            superblock(isa, builder, bp, b, qp, dp, sp, builder.mul(i, ir.Constant(i.type, 8)), accs, macc)
        acc = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                           builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
        return builder.fadd(hsum(builder, acc), builder.load(macc))

    return rows_dot_intrinsic(name, row_body, fmt.block_size, fmt.type_size, 4, by_isa=True)


rows_dot_q4_k_q8 = _make_rows_dot_q8("rows_dot_q4_k_q8", _q4_k_like(False), _Q4)
rows_dot_q5_k_q8 = _make_rows_dot_q8("rows_dot_q5_k_q8", _q4_k_like(True), _Q5)
rows_dot_q6_k_q8 = _make_rows_dot_q8("rows_dot_q6_k_q8", _q6_k_superblock, _Q6)
