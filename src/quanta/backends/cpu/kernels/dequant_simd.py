"""Vectorised row dequantization (GEMM tiles, embeddings) as explicit-SIMD intrinsics.

``dequant_<fmt>_simd(row, out, nblocks)`` writes ``dequantize(row)`` into the float32 array ``out``. It reuses
the block unpackers of the dot-product intrinsics (``legacy_dot._block_q``, ``kquants_dot`` unpackers), storing
``scale*q - min`` 16 lanes at a time instead of multiplying with activations. Tested against gguf-py.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.kquants_dot import q4_k_like_unpacker, q6_k_unpack
from quanta.backends.cpu.kernels.legacy_dot import _block_q
from quanta.backends.cpu.kernels.simd import F32, data_ptr, idx, splat, vec
from quanta.quant.formats import FORMATS


def _store_vec(builder, ptr, off, v):
    builder.store(v, builder.bitcast(builder.gep(ptr, [off]), vec(F32).as_pointer()), align=4)


def _legacy_block(fmt_name: str):
    def emit(builder, bp, b, op, oo):
        d, m, lo, hi = _block_q(fmt_name, builder, bp, b, centered=True)
        dv = splat(builder, d)
        for off, q in ((0, lo), (16, hi)):  # d*q (+ m) in two roundings, exactly as the reference
            w = builder.fmul(dv, q)
            _store_vec(builder, op, idx(builder, oo, off), w if m is None else builder.fadd(w, splat(builder, m)))

    return emit


def _kquant_block(unpack):
    def emit(builder, bp, b, op, oo):
        def sink(q, scale, mn, pos, j):  # scale*q - min in two roundings, exactly as the reference
            w = builder.fmul(splat(builder, scale), q)
            _store_vec(builder, op, idx(builder, oo, pos), w if mn is None else builder.fsub(w, splat(builder, mn)))

        unpack(builder, bp, b, sink)

    return emit


def _make_dequant(fmt_name: str, emit):
    fmt = FORMATS[fmt_name]

    def typer(typingctx, row, out, nblocks):
        sig = types.none(row, out, nblocks)

        def codegen(context, builder, signature, args):
            bp = data_ptr(context, builder, signature.args[0], args[0])
            op = data_ptr(context, builder, signature.args[1], args[1])
            with cgutils.for_range(builder, args[2]) as loop:
                i = loop.index
                b = builder.mul(i, ir.Constant(i.type, fmt.type_size))
                emit(builder, bp, b, op, builder.mul(i, ir.Constant(i.type, fmt.block_size)))
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"dequant_{fmt_name.lower()}_simd"
    return intrinsic(typer)


dequant_q4_0_simd = _make_dequant("Q4_0", _legacy_block("Q4_0"))
dequant_q4_1_simd = _make_dequant("Q4_1", _legacy_block("Q4_1"))
dequant_q5_0_simd = _make_dequant("Q5_0", _legacy_block("Q5_0"))
dequant_q5_1_simd = _make_dequant("Q5_1", _legacy_block("Q5_1"))
dequant_q8_0_simd = _make_dequant("Q8_0", _legacy_block("Q8_0"))
dequant_q4_k_simd = _make_dequant("Q4_K", _kquant_block(q4_k_like_unpacker(False)))
dequant_q5_k_simd = _make_dequant("Q5_K", _kquant_block(q4_k_like_unpacker(True)))
dequant_q6_k_simd = _make_dequant("Q6_K", _kquant_block(q6_k_unpack))
