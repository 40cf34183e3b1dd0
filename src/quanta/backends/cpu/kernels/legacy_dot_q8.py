"""Fast-mode row dot products of the legacy formats with 8-bit activations, for each int8 path of ``isa.py``.

``rows_dot_<fmt>_q8(isa, raw2d, r0, r1, xq, xd, xsum, xstart, out, t0, g)``: the frame and the activation layout are
``q8_rows.py``'s (blocks in pairs, up to ``LEGACY_ROWS_PER_PASS`` activation rows per pass, one accumulator each). Per
pair of 32-weight blocks the unsigned codes ``u`` (4/5-bit nibbles; Q8_0's signed bytes xor 0x80, i.e. +128) are laid
out as the activations: ``a`` = weights 0-15 of block 2p then of 2p+1, ``b`` = weights 16-31 of both, and meet them in
one integer dot (``int8_dots``; with AVX2, Q8_0's +128 codes would saturate the i16 pair sums, so there Q8_0 keeps its
signed bytes and takes llama.cpp's sign trick). The code offset (8 for Q4_0, 16 for Q5_0, 128 for Q8_0 with VNNI) is
removed exactly by the dot's starting value ``-offset * sum(xq)``; block j adds ``d_j * xd_j * isum_j`` (+ ``m_j *
xsum_j`` for Q4_1/Q5_1). Same result as llama.cpp's ``ggml_vec_dot_q*_q8`` up to fp32 rounding; tested against gguf-py's
dequantize with a tolerance for the activation rounding, on every path the CPU has.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.int8_dots import dot2_u8s8, dot_s8s8
from quanta.backends.cpu.kernels.isa import isa_of
from quanta.backends.cpu.kernels.q8_rows import (
    LEGACY_ROWS_PER_PASS, for_pairs, pair_lanes, pair_pattern, row_lanes, row_sum, rows_dot_q8_intrinsic,
)
from quanta.backends.cpu.kernels.simd import (
    F32, HALF, I8, I16, I32, const_vec, fma, hsum, idx, load_scalar, load_vec, prefetch_ahead, vec, zeros,
)  # fmt: skip
from quanta.quant.formats import FORMATS

_OFFSETS = {"Q4_0": 8, "Q4_1": 0, "Q5_0": 16, "Q5_1": 0, "Q8_0": 128}
_BITS = const_vec(I8, [1 << (j % 8) for j in range(32)])


def code_offset(isa: str, fmt_name: str) -> int:
    """The constant removed from ``fmt_name``'s codes in ``isa``'s dots (0: none, or Q8_0's signed codes)."""
    return 0 if isa == "avx2" and fmt_name == "Q8_0" else _OFFSETS[fmt_name]


@intrinsic
def q8_0_offset(typingctx, isa):
    """Q8_0's code offset on the path of ``isa`` (a token of ``isa.token``), as ``code_offset``."""

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(64), code_offset(isa_of(signature.args[0]), "Q8_0"))

    return types.int64(isa), codegen


def _halves(builder, bp, first, second, single: bool):
    """<32 x i8>: 16 bytes at ``first``, then 16 at ``second`` (zeros for a ``single`` block)."""
    lo = load_vec(builder, bp, first, I8)
    hi = ir.Constant(vec(I8), [0] * 16) if single else load_vec(builder, bp, second, I8)
    return builder.shuffle_vector(lo, hi, ir.Constant(vec(I32, 32), list(range(32))))


def _fifth_bits(builder, qh0, qh1, high: bool):
    """0x10 in byte l of the pair's ``a`` (or ``b`` if ``high``) where the block's ``qh`` has bit l (16 + l)."""
    pair = builder.insert_element(ir.Constant(vec(I32, 2), [0, 0]), qh0, ir.Constant(I32, 0))
    pair = builder.bitcast(builder.insert_element(pair, qh1, ir.Constant(I32, 1)), vec(I8, 8))
    first = 2 if high else 0  # byte of qh holding bit l: (first + l // 8) of block 2p, 4 + that of block 2p+1
    spread = [(first + (j % 16) // 8) + 4 * (j // 16) for j in range(32)]
    bytes_ = builder.shuffle_vector(pair, pair, ir.Constant(vec(I32, 32), spread))
    is_set = builder.icmp_unsigned("==", builder.and_(bytes_, _BITS), _BITS)
    return builder.and_(builder.sext(is_set, vec(I8, 32)), const_vec(I8, [16] * 32))


def _codes_pair(fmt_name: str, builder, bp, b0, b1, single: bool, signed: bool):
    """The pair's unsigned codes (a, b) (Q8_0's own signed bytes if ``signed``); block 2p at byte ``b0``."""
    fmt = FORMATS[fmt_name]
    qs0, qs1 = idx(builder, b0, fmt.offset("qs")), idx(builder, b1, fmt.offset("qs"))
    if fmt_name == "Q8_0":
        a = _halves(builder, bp, qs0, qs1, single)
        b = _halves(builder, bp, idx(builder, qs0, 16), idx(builder, qs1, 16), single)
        if signed:
            return a, b
        flip = const_vec(I8, [0x80] * 32)
        return builder.xor(a, flip), builder.xor(b, flip)
    q = _halves(builder, bp, qs0, qs1, single)
    a = builder.and_(q, const_vec(I8, [15] * 32))
    b = builder.lshr(q, const_vec(I8, [4] * 32))
    if fmt_name in ("Q5_0", "Q5_1"):
        qh0 = load_scalar(builder, bp, idx(builder, b0, fmt.offset("qh")), I32)
        qh1 = ir.Constant(I32, 0) if single else load_scalar(builder, bp, idx(builder, b1, fmt.offset("qh")), I32)
        a = builder.or_(a, _fifth_bits(builder, qh0, qh1, high=False))
        b = builder.or_(b, _fifth_bits(builder, qh0, qh1, high=True))
    return a, b


def _scale_min_pairs(builder, bp, b0, b1, single: bool, rows: int):
    """Q4_1/Q5_1: the pair's scales and minimums as two pair vectors of ``rows`` rows (``pair_pattern``), from one
    32-bit load per block (its f16 ``d`` and ``m`` side by side) and one conversion of the four halves."""
    words = ir.Constant(vec(I32, 2), [0, 0])
    words = builder.insert_element(words, load_scalar(builder, bp, b0, I32), ir.Constant(I32, 0))
    if not single:
        words = builder.insert_element(words, load_scalar(builder, bp, b1, I32), ir.Constant(I32, 1))
    dm = builder.fpext(builder.bitcast(words, vec(HALF, 4)), vec(F32, 4))  # d0, m0, d1, m1
    pick = lambda first, second: builder.shuffle_vector(  # noqa: E731
        dm, dm, ir.Constant(vec(I32, pair_lanes(rows)), pair_pattern(first, second, rows)))
    return pick(0, 2), pick(1, 3)


def _scale_pair(builder, bp, b0, b1, single: bool, rows: int):
    """The pair's f16 scales (at the start of each block) as a pair vector of ``rows`` rows, in one conversion."""
    halves = ir.Constant(vec(I16, 2), [0, 0])
    halves = builder.insert_element(halves, load_scalar(builder, bp, b0, I16), ir.Constant(I32, 0))
    if not single:
        halves = builder.insert_element(halves, load_scalar(builder, bp, b1, I16), ir.Constant(I32, 1))
    d = builder.fpext(builder.bitcast(halves, vec(HALF, 2)), vec(F32, 2))
    return builder.shuffle_vector(d, d, ir.Constant(vec(I32, pair_lanes(rows)), pair_pattern(0, 1, rows)))


def _make_rows_dot_q8(fmt_name: str):
    fmt = FORMATS[fmt_name]
    has_min = fmt_name in ("Q4_1", "Q5_1")
    assert fmt.offset("d") == 0 and (not has_min or fmt.offset("m") == 2)  # the scale loads below

    def row_body(isa, builder, bp, rows, nb):
        signed = isa == "avx2" and fmt_name == "Q8_0"
        offset, n = code_offset(isa, fmt_name), len(rows)
        # one accumulator per row (two would make eight rows' sixteen spill out of AVX2's registers)
        accs = [cgutils.alloca_once_value(builder, zeros(8)) for _ in range(n)]
        macc = cgutils.alloca_once_value(builder, zeros(pair_lanes(n)))

        def pair(p, single):
            b0 = builder.mul(p, ir.Constant(p.type, 2 * fmt.type_size))
            b1 = idx(builder, b0, fmt.type_size)
            prefetch_ahead(builder, bp, b0, 2 * fmt.type_size)
            a, b = _codes_pair(fmt_name, builder, bp, b0, b1, single, signed)
            if has_min:
                d, m = _scale_min_pairs(builder, bp, b0, b1, single, n)
                mins = builder.fmul(m, rows.sums(p))
                builder.store(builder.fadd(builder.load(macc), mins), macc)
            else:
                d = _scale_pair(builder, bp, b0, b1, single, n)
            scales = builder.fmul(d, rows.scales(p))
            for t, acc in enumerate(accs):
                xa, xb = rows.codes(t, p)
                start = rows.start(t, p) if offset else None
                if signed:
                    s = dot_s8s8(isa, builder, b, xb, dot_s8s8(isa, builder, a, xa, start))
                else:
                    s = dot2_u8s8(isa, builder, a, xa, b, xb, start, small=True)
                lanes = row_lanes(builder, scales, t, n)
                builder.store(fma(builder, lanes, builder.sitofp(s, vec(F32, 8)), builder.load(acc)), acc)

        for_pairs(builder, nb, pair)
        mins = builder.load(macc)
        return [builder.fadd(hsum(builder, builder.load(acc)), row_sum(builder, mins, t, n))
                for t, acc in enumerate(accs)]

    return rows_dot_q8_intrinsic(f"rows_dot_{fmt_name.lower()}_q8", row_body, fmt.block_size, fmt.type_size,
                                 LEGACY_ROWS_PER_PASS)


rows_dot_q4_0_q8 = _make_rows_dot_q8("Q4_0")
rows_dot_q4_1_q8 = _make_rows_dot_q8("Q4_1")
rows_dot_q5_0_q8 = _make_rows_dot_q8("Q5_0")
rows_dot_q5_1_q8 = _make_rows_dot_q8("Q5_1")
rows_dot_q8_0_q8 = _make_rows_dot_q8("Q8_0")
