"""Fast-mode row dot products of the legacy formats with 8-bit activations, for each int8 path of ``isa.py``.

``rows_dot_<fmt>_q8(isa, raw2d, r0, r1, xq, xd, xsum, xqsum, out)`` sets ``out[r]`` for rows r0..r1-1 (the row
loop is in IR, ``simd.rows_dot_intrinsic``). Per 32-weight block the unsigned weight codes ``u`` (4/5-bit
nibbles as in ``legacy_dot.py``; Q8_0's signed bytes xor 0x80, i.e. +128) meet the int8 activations ``xq`` in
``dot_u8s8``: one ``vpdpbusd`` (u8 x s8, four products summed per i32 lane) with VNNI, ``vpmaddubsw`` +
``vpmaddwd`` with AVX2 (whose i16 pair sums would saturate on Q8_0's +128 codes: there Q8_0 keeps its signed
bytes and takes llama.cpp's sign trick, ``|q| * sign(q) x``). The code offset (8 for Q4_0, 16 for Q5_0, 128 for
Q8_0 with VNNI) is removed exactly as ``offset * sum(xq)`` in integers; the block adds ``d * xd * isum``
(+ ``m * xsum`` for Q4_1/Q5_1). Same result as llama.cpp's ``ggml_vec_dot_q*_q8`` up to fp32 rounding; tested
against gguf-py's dequantize with a tolerance for the activation rounding, on every path the CPU has.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from quanta.backends.cpu.kernels.simd import (
    F32, I8, I32, const_vec, fma, for_block_pairs, hsum, idx, load_f16, load_scalar, load_vec, rows_dot_intrinsic,
    splat, vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS

_OFFSETS = {"Q4_0": 8, "Q4_1": 0, "Q5_0": 16, "Q5_1": 0, "Q8_0": 128}


def _call(builder, name: str, ret, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def dot_u8s8(isa: str, builder, u, x):
    """Sums of four products ``u * x`` per i32 lane of two <32 x i8> (u unsigned; with AVX2 each pair must fit
    an i16: u <= 128 for any x, as all codes but Q8_0's +128 ones are)."""
    t = vec(I32, 8)
    if isa == "portable":  # widen, multiply, add each lane's four products
        p = builder.mul(builder.zext(u, vec(I32, 32)), builder.sext(x, vec(I32, 32)))
        quarters = [builder.shuffle_vector(p, p, const_vec(I32, range(j, 32, 4))) for j in range(4)]
        return builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3]))
    if isa == "avx2":
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(ir.IntType(16), 16), u, x)
        return _call(builder, "llvm.x86.avx2.pmadd.wd", t, pairs, const_vec(ir.IntType(16), [1] * 16))
    return _call(builder, "llvm.x86.avx512.vpdpbusd.256", t, ir.Constant(t, [0] * 8), builder.bitcast(u, t),
                 builder.bitcast(x, t))


def dot_s8s8(isa: str, builder, q, x):
    """``dot_u8s8`` for signed codes ``q``: ``|q|`` against ``x`` with q's sign (``vpsignb``), llama.cpp's trick."""
    magnitude = _call(builder, "llvm.abs.v32i8", vec(I8, 32), q, ir.Constant(ir.IntType(1), 0))
    return dot_u8s8(isa, builder, magnitude, _call(builder, "llvm.x86.avx2.psign.b", vec(I8, 32), x, q))


def _codes(fmt_name: str, builder, bp, b, signed: bool = False):
    """The 32 unsigned weight codes of the block at byte ``b`` as <32 x i8> (Q8_0's own signed bytes if
    ``signed``)."""
    fmt = FORMATS[fmt_name]
    qs = idx(builder, b, fmt.offset("qs"))
    if fmt_name == "Q8_0":
        q = load_vec(builder, bp, qs, I8, 32)
        return q if signed else builder.xor(q, const_vec(I8, [0x80] * 32))
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
    has_min = fmt_name in ("Q4_1", "Q5_1")

    def row_body(isa, builder, bp, act_ptrs, nb):
        signed = isa == "avx2" and fmt_name == "Q8_0"
        offset = 0 if signed else _OFFSETS[fmt_name]
        qp, dp, sp, qsp = act_ptrs
        accs = [cgutils.alloca_once_value(builder, zeros(8)) for _ in range(2)]
        maccs = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(2)]

        def block(i, slot):
            b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
            xv = load_vec(builder, qp, builder.mul(i, ir.Constant(i.type, 32)), I8, 32)
            codes = _codes(fmt_name, builder, bp, b, signed)
            s = (dot_s8s8 if signed else dot_u8s8)(isa, builder, codes, xv)
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

    return rows_dot_intrinsic(f"rows_dot_{fmt_name.lower()}_q8", row_body, fmt.block_size, fmt.type_size, 4,
                              by_isa=True)


rows_dot_q4_0_q8 = _make_rows_dot_q8("Q4_0")
rows_dot_q4_1_q8 = _make_rows_dot_q8("Q4_1")
rows_dot_q5_0_q8 = _make_rows_dot_q8("Q5_0")
rows_dot_q5_1_q8 = _make_rows_dot_q8("Q5_1")
rows_dot_q8_0_q8 = _make_rows_dot_q8("Q8_0")
