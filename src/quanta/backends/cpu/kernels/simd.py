"""Small LLVM IR builders for the hand-vectorised dot-product intrinsics.

numba's auto-vectoriser does not reliably vectorise the 16/32-wide inner loops of block formats (it vectorises the
outer block loop with gathers instead, measured 1-5 GB/s), so the hot dot products are written as
``numba.extending.intrinsic`` functions that emit explicit ``<16 x float>`` LLVM vector code (AVX-512 / AVX2 after
LLVM's lowering). These helpers keep that IR short.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


F32 = ir.FloatType()
HALF = ir.HalfType()
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
LANES = 16


def vec(elt: ir.Type, n: int = LANES) -> ir.VectorType:
    return ir.VectorType(elt, n)


def const_vec(elt: ir.Type, values) -> ir.Constant:
    values = list(values)
    return ir.Constant(vec(elt, len(values)), values)


def data_ptr(context, builder, arrty, arr):
    """Pointer to the first element of a numba array argument."""
    return context.make_array(arrty)(context, builder, arr).data


def idx(builder, base, offset: int):
    return builder.add(base, ir.Constant(base.type, offset)) if offset else base


def load_vec(builder, ptr, off, elt: ir.Type, n: int = LANES):
    """``n`` elements of type ``elt`` starting at element ``off`` of ``ptr`` (unaligned)."""
    p = builder.bitcast(builder.gep(ptr, [off]), vec(elt, n).as_pointer())
    return builder.load(p, align=1)


# bytes ahead of a row dot's reads at which it asks for the weights' cache lines: a GEMV streams its weights from
# memory, and the hardware prefetcher alone keeps too few lines in flight (a Q4_K GEMV over 519 MB, one thread of
# an Intel Xeon VM: 6.6 GB/s of a 16.8 GB/s stream, 11.5 GB/s with 1,024 bytes ahead; TinyLlama's decode with
# 768 / 1,024 / 1,536 / 2,048 / 3,072 bytes ahead: 13.3 / 13.5 / 13.7-14.1 / 14.1 / 14.0 tok/s on one thread,
# 22.7 / 23.2 / 23.9-25.2 / 25.0 / 24.8 on two, against 9.7 and 15.2 without: docs/PERF.md, session 50)
PREFETCH_AHEAD = 2048
# ... as non-temporal lines (prefetchnta): each weight is read once a step and a step's weights outgrow the caches,
# so they should not push out what the ops between the GEMVs reuse (activations, the KV cache, the interpreter's
# and numba's own data). Batch-1 decode on a Zen 2, 2 threads, against keep-in-all-levels, alternating twice:
# SmolLM2 119-124 -> 130-136 tok/s, Gemma-3 74-77 -> 85-88, TinyLlama 35.0-35.3 -> 36.1-36.5; prefill unchanged
# (an Intel Ice Lake VM, session 60: keep-in-all-levels is faster only where a matrix fits the 48 MB L3 and is
# read again, as in a GEMV benchmark; batch-1 decode the same within noise: SmolLM2 106.6 / 106.1 tok/s)
PREFETCH_LOCALITY = 0


def prefetch_ahead(builder, byte_ptr, off, nbytes: int) -> None:
    """Ask for the cache lines of the ``nbytes`` bytes ``PREFETCH_AHEAD`` past byte ``off`` of ``byte_ptr`` (a
    hint: a prefetch past the end of the data never faults)."""
    fn = builder.module.declare_intrinsic("llvm.prefetch", [byte_ptr.type],  # named for the pointer type
                                          ir.FunctionType(ir.VoidType(), [byte_ptr.type, I32, I32, I32]))
    for line in range(0, nbytes, 64):
        p = builder.gep(byte_ptr, [idx(builder, off, PREFETCH_AHEAD + line)])
        read, data = ir.Constant(I32, 0), ir.Constant(I32, 1)
        builder.call(fn, [p, read, ir.Constant(I32, PREFETCH_LOCALITY), data])


def load_scalar(builder, byte_ptr, off, elt: ir.Type):
    p = builder.bitcast(builder.gep(byte_ptr, [off]), elt.as_pointer())
    return builder.load(p, align=1)


def load_f16(builder, byte_ptr, off):
    """The little-endian f16 at byte ``off``, as float."""
    return builder.fpext(load_scalar(builder, byte_ptr, off, HALF), F32)


def splat(builder, s, n: int = LANES):
    v = builder.insert_element(ir.Constant(vec(s.type, n), ir.Undefined), s, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(vec(I32, n), [0] * n))


def call(builder, name: str, ret: ir.Type, *args):
    """A call of the LLVM intrinsic (or C function) ``name`` returning ``ret``, declared from the arguments' types."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def fma(builder, a, b, c):
    t = a.type
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), f"llvm.fma.v{t.count}f32")
    return builder.call(fn, [a, b, c])


def hsum(builder, v):
    """Sum of the lanes of a float vector (halving tree)."""
    n = v.type.count
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(vec(I32, h), list(range(h))))
        hi = builder.shuffle_vector(v, v, ir.Constant(vec(I32, h), list(range(h, n))))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(I32, 0))


def zeros(n: int = LANES):
    return ir.Constant(vec(F32, n), [0.0] * n)


def nibble(builder, v, high: bool):
    """The high or low 4 bits of each byte of an i8 vector."""
    n = v.type.count
    return builder.lshr(v, const_vec(I8, [4] * n)) if high else builder.and_(v, const_vec(I8, [15] * n))


def for_block_pairs(builder, nb, block) -> None:
    """Call ``block(i, slot)`` for blocks i = 0..nb-1, two per iteration into accumulator slots 0 and 1 (two
    independent dependency chains), then the odd last block into slot 0."""
    two = ir.Constant(nb.type, 2)
    pairs = builder.sdiv(nb, two)
    with cgutils.for_range(builder, pairs) as loop:
        i0 = builder.mul(loop.index, two)
        block(i0, 0)
        block(idx(builder, i0, 1), 1)
    with builder.if_then(builder.icmp_signed("!=", builder.mul(pairs, two), nb)):
        block(builder.sub(nb, ir.Constant(nb.type, 1)), 0)


def rows_dot_intrinsic(name: str, row_body, block_size: int, type_size: int):
    """An intrinsic ``f(raw2d, r0, r1, x, xsum, out)`` doing ``out[r] = row_body(row r)`` for r in [r0, r1): the row
    loop lives in IR, so a GEMV chunk costs one call (no per-row numba views or dispatch).

    ``row_body(builder, bp, (x, xsum), nb32)`` emits one row's dot product from the row's byte pointer and returns
    a float.
    """

    def typer(typingctx, raw2d, r0, r1, a0, a1, out):
        return types.none(raw2d, r0, r1, a0, a1, out), codegen

    def codegen(context, builder, signature, args):
        base, *act_ptrs, op = (data_ptr(context, builder, signature.args[j], args[j]) for j in (0, 3, 4, 5))
        k = cgutils.unpack_tuple(builder, context.make_array(signature.args[3])(context, builder, args[3]).shape)[0]
        nb32 = builder.sdiv(k, ir.Constant(k.type, 32))
        row_bytes = builder.mul(builder.sdiv(k, ir.Constant(k.type, block_size)), ir.Constant(k.type, type_size))
        r0 = context.cast(builder, args[1], signature.args[1], types.intp)
        r1 = context.cast(builder, args[2], signature.args[2], types.intp)
        with cgutils.for_range_slice(builder, r0, r1, ir.Constant(r0.type, 1)) as (r, _):
            bp = builder.gep(base, [builder.mul(r, row_bytes)])
            builder.store(row_body(builder, bp, act_ptrs, nb32), builder.gep(op, [r]))
        return context.get_dummy_value()

    typer.__name__ = name
    return intrinsic(typer)
