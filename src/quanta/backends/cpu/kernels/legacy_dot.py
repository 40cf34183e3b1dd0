"""Row dot products of the legacy 32-weight formats with fp32 activations, as explicit-SIMD intrinsics.

``rows_dot_<fmt>(raw2d, r0, r1, x, xsum, out)`` sets ``out[r] = dot(dequantize(raw2d[r]), x)`` for rows
r0..r1-1 (row loop in IR, ``simd.rows_dot_intrinsic``), where ``xsum[i] = sum(x[32i:32i+32])``. Every legacy
block dequantizes as ``w = d*q + m`` (``m = -8d`` for Q4_0, ``-16d`` for Q5_0, the stored min for Q4_1/Q5_1, 0
for Q8_0), so a block contributes ``d*dot(q, x) + m*xsum``: ``q`` is built as two ``<16 x float>`` halves
(weights 0-15 = low nibbles, 16-31 = high nibbles, plus bit j of ``qh`` as the fifth bit), multiplied with the
matching ``x`` halves and accumulated with ``d`` broadcast. Two blocks per iteration use separate accumulators
to hide the FMA latency. Tested against gguf-py's dequantize.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from quanta.backends.cpu.kernels.simd import (
    F32, I8, I32, const_vec, fma, for_block_pairs, hsum, idx, load_f16, load_scalar, load_vec, prefetch_ahead,
    rows_dot_intrinsic, splat, vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS


def _nibbles(builder, q):
    lo = builder.and_(q, const_vec(I8, [15] * 16))
    hi = builder.lshr(q, const_vec(I8, [4] * 16))
    return lo, hi


def _with_high_bit(builder, lo, hi, qh):
    """Add bit j (low half) / bit j+16 (high half) of the u32 ``qh`` as bit 4 of each 4-bit value."""
    qv = splat(builder, qh)
    one = const_vec(I32, [1] * 16)
    b_lo = builder.and_(builder.lshr(qv, const_vec(I32, range(16))), one)
    b_hi = builder.and_(builder.lshr(qv, const_vec(I32, range(16, 32))), one)
    four = const_vec(I32, [4] * 16)
    lo = builder.or_(builder.zext(lo, vec(I32)), builder.shl(b_lo, four))
    hi = builder.or_(builder.zext(hi, vec(I32)), builder.shl(b_hi, four))
    return lo, hi


def _block_q(fmt_name: str, builder, bp, b, centered: bool = False):
    """(d, m, q_lo, q_hi) for the block at byte ``b``: q as <16 x float> halves, block = d*q + m.

    ``centered`` subtracts Q4_0's / Q5_0's code offset from q instead (m is None then): bit-exact with the
    reference's ``d * (q - 8)`` rounding, for dequantization.
    """
    fmt = FORMATS[fmt_name]
    d = load_f16(builder, bp, b)
    qs = load_vec(builder, bp, idx(builder, b, fmt.offset("qs")), I8)
    if fmt_name == "Q8_0":
        hi = load_vec(builder, bp, idx(builder, b, fmt.offset("qs") + 16), I8)
        return d, None, builder.sitofp(qs, vec(F32)), builder.sitofp(hi, vec(F32))
    lo, hi = _nibbles(builder, qs)
    if fmt_name in ("Q5_0", "Q5_1"):
        qh = load_scalar(builder, bp, idx(builder, b, fmt.offset("qh")), I32)
        lo, hi = _with_high_bit(builder, lo, hi, qh)
    lo, hi = builder.uitofp(lo, vec(F32)), builder.uitofp(hi, vec(F32))
    if centered and fmt_name in ("Q4_0", "Q5_0"):
        off = const_vec(F32, [8.0 if fmt_name == "Q4_0" else 16.0] * 16)
        return d, None, builder.fsub(lo, off), builder.fsub(hi, off)
    if fmt_name in ("Q4_1", "Q5_1"):
        m = load_f16(builder, bp, idx(builder, b, fmt.offset("m")))
    else:
        m = builder.fmul(d, ir.Constant(F32, -8.0 if fmt_name == "Q4_0" else -16.0))
    return d, m, lo, hi


def _make_rows_dot(fmt_name: str):
    fmt = FORMATS[fmt_name]

    def row_body(builder, bp, act_ptrs, nb):
        xp, sp = act_ptrs
        accs = [cgutils.alloca_once_value(builder, zeros()) for _ in range(2)]
        maccs = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(2)]

        def block(i, slot):
            b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
            if slot == 0:  # once per pair of blocks (the loop takes two per iteration)
                prefetch_ahead(builder, bp, b, 2 * fmt.type_size)
            d, m, lo, hi = _block_q(fmt_name, builder, bp, b)
            xo = builder.mul(i, ir.Constant(i.type, 32))
            t = builder.fmul(lo, load_vec(builder, xp, xo, F32))
            t = fma(builder, hi, load_vec(builder, xp, idx(builder, xo, 16), F32), t)
            builder.store(fma(builder, splat(builder, d), t, builder.load(accs[slot])), accs[slot])
            if m is not None:
                mx = builder.fmul(m, builder.load(builder.gep(sp, [i])))
                builder.store(builder.fadd(builder.load(maccs[slot]), mx), maccs[slot])

        for_block_pairs(builder, nb, block)
        total = hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))
        return builder.fadd(total, builder.fadd(builder.load(maccs[0]), builder.load(maccs[1])))

    return rows_dot_intrinsic(f"rows_dot_{fmt_name.lower()}", row_body, fmt.block_size, fmt.type_size)


rows_dot_q4_0 = _make_rows_dot("Q4_0")
rows_dot_q4_1 = _make_rows_dot("Q4_1")
rows_dot_q5_0 = _make_rows_dot("Q5_0")
rows_dot_q5_1 = _make_rows_dot("Q5_1")
rows_dot_q8_0 = _make_rows_dot("Q8_0")
