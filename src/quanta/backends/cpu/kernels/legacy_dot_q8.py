"""Fast-mode row dot products of the legacy formats with 8-bit activations, using AVX-512 VNNI ``vpdpbusd``.

``rows_dot_<fmt>_q8(raw2d, r0, r1, xq, xd, xsum, xqsum, out)`` sets ``out[r]`` for rows r0..r1-1 (the row
loop is in IR, ``simd.rows_dot_intrinsic``). Per 32-weight block the unsigned weight codes ``u`` (4/5-bit
nibbles as in ``legacy_dot.py``; Q8_0's signed bytes xor 0x80, i.e. +128) meet the int8 activations ``xq`` in one
``vpdpbusd`` (u8 x s8, four products summed per i32 lane). The code offset (8 for Q4_0, 16 for Q5_0, 128 for
Q8_0) is removed exactly as ``offset * sum(xq)`` in integers; the block adds ``d * xd * isum`` (+ ``m * xsum`` for
Q4_1/Q5_1). Same result as llama.cpp's ``ggml_vec_dot_q*_q8`` up to fp32 rounding; tested against gguf-py's
dequantize with a tolerance for the activation rounding. Only built when the CPU has AVX512-VNNI + AVX512-VL.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba.core import cgutils

from quanta.backends.cpu.kernels.simd import (
    F32, I8, I32, const_vec, fma, for_block_pairs, hsum, idx, load_f16, load_scalar, load_vec, rows_dot_intrinsic,
    splat, vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS

HAS_VNNI = all(f"+{f}" in llvm.get_host_cpu_features().flatten().split(",") for f in ("avx512vnni", "avx512vl"))
_OFFSETS = {"Q4_0": 8, "Q4_1": 0, "Q5_0": 16, "Q5_1": 0, "Q8_0": 128}


def _vpdpbusd(builder, a, b):
    t = vec(I32, 8)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), "llvm.x86.avx512.vpdpbusd.256")
    return builder.call(fn, [ir.Constant(t, [0] * 8), builder.bitcast(a, t), builder.bitcast(b, t)])


def _codes(fmt_name: str, builder, bp, b):
    """The 32 unsigned weight codes of the block at byte ``b`` as <32 x i8>."""
    fmt = FORMATS[fmt_name]
    qs = idx(builder, b, fmt.offset("qs"))
    if fmt_name == "Q8_0":
        return builder.xor(load_vec(builder, bp, qs, I8, 32), const_vec(I8, [0x80] * 32))
    q = load_vec(builder, bp, qs, I8)
    lo = builder.and_(q, const_vec(I8, [15] * 16))
    hi = builder.lshr(q, const_vec(I8, [4] * 16))
    if fmt_name in ("Q5_0", "Q5_1"):  # bit j of qh is bit 4 of weight j
        qv = splat(builder, load_scalar(builder, bp, idx(builder, b, fmt.offset("qh")), I32))
        one, four = const_vec(I8, [1] * 16), const_vec(I8, [4] * 16)
        b_lo = builder.and_(builder.trunc(builder.lshr(qv, const_vec(I32, range(16))), vec(I8)), one)
        b_hi = builder.and_(builder.trunc(builder.lshr(qv, const_vec(I32, range(16, 32))), vec(I8)), one)
        lo = builder.or_(lo, builder.shl(b_lo, four))
        hi = builder.or_(hi, builder.shl(b_hi, four))
    return builder.shuffle_vector(lo, hi, ir.Constant(vec(I32, 32), list(range(32))))


def _make_rows_dot_q8(fmt_name: str):
    fmt = FORMATS[fmt_name]
    offset = _OFFSETS[fmt_name]
    has_min = fmt_name in ("Q4_1", "Q5_1")

    def row_body(builder, bp, act_ptrs, nb):
        qp, dp, sp, qsp = act_ptrs
        accs = [cgutils.alloca_once_value(builder, zeros(8)) for _ in range(2)]
        maccs = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(2)]

        def block(i, slot):
            b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
            xv = load_vec(builder, qp, builder.mul(i, ir.Constant(i.type, 32)), I8, 32)
            s = _vpdpbusd(builder, _codes(fmt_name, builder, bp, b), xv)
            if offset:
                corr = builder.mul(builder.load(builder.gep(qsp, [i])), ir.Constant(I32, offset))
                zero = ir.Constant(vec(I32, 8), [0] * 8)
                s = builder.sub(s, builder.insert_element(zero, corr, ir.Constant(I32, 0)))
            d = load_f16(builder, bp, b)
            sc = builder.fmul(d, builder.load(builder.gep(dp, [i])))
            acc = fma(builder, splat(builder, sc, 8), builder.sitofp(s, vec(F32, 8)), builder.load(accs[slot]))
            builder.store(acc, accs[slot])
            if has_min:
                m = load_f16(builder, bp, idx(builder, b, fmt.offset("m")))
                mx = builder.fmul(m, builder.load(builder.gep(sp, [i])))
                builder.store(builder.fadd(builder.load(maccs[slot]), mx), maccs[slot])

        for_block_pairs(builder, nb, block)
        total = hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))
        return builder.fadd(total, builder.fadd(builder.load(maccs[0]), builder.load(maccs[1])))

    return rows_dot_intrinsic(f"rows_dot_{fmt_name.lower()}_q8", row_body, fmt.block_size, fmt.type_size, 4)


rows_dot_q4_0_q8 = _make_rows_dot_q8("Q4_0")
rows_dot_q4_1_q8 = _make_rows_dot_q8("Q4_1")
rows_dot_q5_0_q8 = _make_rows_dot_q8("Q5_0")
rows_dot_q5_1_q8 = _make_rows_dot_q8("Q5_1")
rows_dot_q8_0_q8 = _make_rows_dot_q8("Q8_0")
