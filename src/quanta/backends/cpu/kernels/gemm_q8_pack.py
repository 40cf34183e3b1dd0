"""Weight side of the int8 prefill GEMM: unpack 16 rows of GGUF blocks into VNNI-ready tiles.

Every format is rewritten per *unit* of ``U`` weights (U = 32; 16 for Q6_K, whose scales are per 16) as
``w = s * u + c`` with unsigned 8-bit codes ``u``, a scale ``s`` and a constant ``c``:
- Q4_0/Q5_0/Q8_0: ``s = d, c = -offset * d`` (offset 8 / 16 / 128; Q8_0's signed bytes xor 0x80 = q + 128);
- Q4_1/Q5_1: ``s = d, c = m``; Q4_K/Q5_K: ``s = d * sc_j, c = -dmin * m_j``; Q6_K: ``s = d * sc, c = -32 s``.
The bit layouts are those of ``kquants.py`` and ``legacy_dot.py`` (tested against gguf-py through the GEMM).

Tile layout (16 rows ``rr``, units ``j``, 4-byte groups ``g`` of a unit):
``codes[((j * U/4 + g) * 16 + rr) * 4 + 0..3]`` = codes ``4g..4g+3`` of unit j of row rr, so one 64-byte load is
the ``<16 x i32>`` operand of ``vpdpbusd`` for 16 rows; ``scales[j * 16 + rr]``, ``consts[j * 16 + rr]``.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.kquants_dot import _scale_min_k4
from quanta.backends.cpu.kernels.legacy_dot_q8 import _OFFSETS
from quanta.backends.cpu.kernels.simd import (
    F32, I8, I32, const_vec, data_ptr, idx, load_f16, load_scalar, load_vec, nibble, splat, vec,
)  # fmt: skip
from quanta.quant.formats import FORMATS

TILE_ROWS = 16


def _codes(fmt_name: str, builder, bp, b):
    """The 32 unsigned codes of the legacy block at byte ``b`` as <32 x i8> (Q8_0's bytes xor 0x80)."""
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


def _legacy_units(fmt_name: str):
    fmt = FORMATS[fmt_name]
    offset, has_min = _OFFSETS[fmt_name], "m" in [f.name for f in fmt.fields]

    def units(builder, bp, b):
        d = load_f16(builder, bp, b)
        c = load_f16(builder, bp, idx(builder, b, fmt.offset("m"))) if has_min else builder.fmul(
            d, ir.Constant(F32, -float(offset)))
        return [(_codes(fmt_name, builder, bp, b), d, c)]

    return units


def _q4_k_like_units(with_high_bit: bool):
    fmt = FORMATS["Q5_K" if with_high_bit else "Q4_K"]
    o_d, o_dmin, o_sc, o_qs = (fmt.offset(f) for f in ("d", "dmin", "scales", "qs"))

    def units(builder, bp, b):
        d = load_f16(builder, bp, idx(builder, b, o_d))
        dmin = load_f16(builder, bp, idx(builder, b, o_dmin))
        s = idx(builder, b, o_sc)
        qh = load_vec(builder, bp, idx(builder, b, fmt.offset("qh")), I8, 32) if with_high_bit else None
        out = []
        for j in range(8):
            q = nibble(builder, load_vec(builder, bp, idx(builder, b, o_qs + 32 * (j // 2)), I8, 32), j % 2 == 1)
            if with_high_bit:  # bit j of qh[l] is bit 4 of weight l of sub-block j
                hb = builder.and_(builder.lshr(qh, const_vec(I8, [j] * 32)), const_vec(I8, [1] * 32))
                q = builder.or_(q, builder.shl(hb, const_vec(I8, [4] * 32)))
            sc, mn = _scale_min_k4(builder, bp, s, j)
            out.append((q, builder.fmul(d, sc), builder.fmul(builder.fneg(dmin), mn)))
        return out

    return units


def _q6_k_units(builder, bp, b):
    fmt = FORMATS["Q6_K"]
    o_ql, o_qh, o_sc, o_d = (fmt.offset(f) for f in ("ql", "qh", "scales", "d"))
    d = load_f16(builder, bp, idx(builder, b, o_d))
    out = []
    for half in range(2):
        qh = load_vec(builder, bp, idx(builder, b, o_qh + 32 * half), I8, 32)
        for quarter in range(4):  # weights 128*half + 32*quarter + 0..31: two 16-weight sub-blocks
            lo = nibble(builder, load_vec(builder, bp, idx(builder, b, o_ql + 64 * half + 32 * (quarter & 1)), I8, 32),
                        quarter >= 2)
            hi = builder.and_(builder.lshr(qh, const_vec(I8, [2 * quarter] * 32)), const_vec(I8, [3] * 32))
            u = builder.or_(lo, builder.shl(hi, const_vec(I8, [4] * 32)))
            for h in range(2):
                sc = builder.load(builder.gep(bp, [idx(builder, b, o_sc + 8 * half + 2 * quarter + h)]))
                s = builder.fmul(d, builder.sitofp(sc, F32))
                code = builder.shuffle_vector(u, u, ir.Constant(vec(I32, 16), list(range(16 * h, 16 * h + 16))))
                out.append((code, s, builder.fmul(s, ir.Constant(F32, -32.0))))
    return out


def _make_pack(fmt_name: str, units_of_block, unit: int):
    fmt = FORMATS[fmt_name]
    groups = unit // 4

    def typer(typingctx, raw2d, r0, nrows, codes, scales, consts):
        sig = types.none(raw2d, r0, nrows, codes, scales, consts)

        def codegen(context, builder, signature, args):
            base = data_ptr(context, builder, signature.args[0], args[0])
            cp = builder.bitcast(data_ptr(context, builder, signature.args[3], args[3]), I32.as_pointer())
            sp = data_ptr(context, builder, signature.args[4], args[4])
            kp = data_ptr(context, builder, signature.args[5], args[5])
            raw = context.make_array(signature.args[0])(context, builder, args[0])
            row_bytes = cgutils.unpack_tuple(builder, raw.shape)[1]
            nb = builder.sdiv(row_bytes, ir.Constant(row_bytes.type, fmt.type_size))
            r0 = context.cast(builder, args[1], signature.args[1], types.intp)
            nrows = context.cast(builder, args[2], signature.args[2], types.intp)
            per_block = fmt.block_size // unit
            with cgutils.for_range(builder, nrows) as rloop:
                rr = rloop.index
                bp = builder.gep(base, [builder.mul(builder.add(r0, rr), row_bytes)])
                with cgutils.for_range(builder, nb) as bloop:
                    i = bloop.index
                    b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
                    for jj, (code, s, c) in enumerate(units_of_block(builder, bp, b)):
                        j = builder.add(builder.mul(i, ir.Constant(i.type, per_block)), ir.Constant(i.type, jj))
                        at = builder.add(builder.mul(j, ir.Constant(j.type, TILE_ROWS)), rr)
                        builder.store(s, builder.gep(sp, [at]))
                        builder.store(c, builder.gep(kp, [at]))
                        words = builder.bitcast(code, vec(I32, groups))
                        first = builder.mul(j, ir.Constant(j.type, groups * TILE_ROWS))
                        for g in range(groups):
                            pos = builder.add(first, builder.add(rr, ir.Constant(rr.type, g * TILE_ROWS)))
                            builder.store(builder.extract_element(words, ir.Constant(I32, g)), builder.gep(cp, [pos]))
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"pack_{fmt_name.lower()}"
    return intrinsic(typer)


UNIT = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}
pack_q4_0 = _make_pack("Q4_0", _legacy_units("Q4_0"), 32)
pack_q4_1 = _make_pack("Q4_1", _legacy_units("Q4_1"), 32)
pack_q5_0 = _make_pack("Q5_0", _legacy_units("Q5_0"), 32)
pack_q5_1 = _make_pack("Q5_1", _legacy_units("Q5_1"), 32)
pack_q8_0 = _make_pack("Q8_0", _legacy_units("Q8_0"), 32)
pack_q4_k = _make_pack("Q4_K", _q4_k_like_units(False), 32)
pack_q5_k = _make_pack("Q5_K", _q4_k_like_units(True), 32)
pack_q6_k = _make_pack("Q6_K", _q6_k_units, 16)
