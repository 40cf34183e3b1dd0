"""Intrinsics over whole rows of numba arrays (float32, f16 bits as uint16, int8 codes), ``LANES`` values at a time:
the decode attention's int8 dots and weighted sums, its stores and softmax exp, and fast mode's gated
activations (a paged block's run of f16 or float32 slots: ``key_runs.py``).

numba leaves these loops scalar (it cannot prove that two rows do not overlap) or calls libm once per element
(its exp). Each helper ends with a scalar loop for a row's last values. Tested against numpy and float64 in
tests/backends/cpu/test_vector_rows.py.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.simd import F32, HALF, I8, I16, I32, LANES, fma, hsum, load_vec, splat, vec, zeros


def row_of(context, builder, ty, value):
    """(data pointer, length) of a unit-stride 1-D array argument."""
    arr = context.make_array(ty)(context, builder, value)
    return arr.data, cgutils.unpack_tuple(builder, arr.shape)[0]


def as_f32(builder, x, dtype):
    """A loaded element or <LANES> vector of float32, int8 codes or f16 bits (uint16) as float32."""
    if dtype == types.float32:
        return x
    n = x.type.count if isinstance(x.type, ir.VectorType) else None
    if dtype == types.int8:
        return builder.sitofp(x, vec(F32, n) if n else F32)
    return builder.fpext(builder.bitcast(x, vec(HALF, n) if n else HALF), vec(F32, n) if n else F32)


_ROW_ELEMENTS = {types.float32: F32, types.int8: I8, types.uint16: I16}


def _lanes_then_tail(builder, n, vector_step, scalar_step, start=None) -> None:
    """``vector_step(offset)`` for each ``LANES`` of the ``n`` elements from index ``start`` (0), then
    ``scalar_step(index)`` for the rest."""
    lanes = ir.Constant(n.type, LANES)
    start = start if start is not None else ir.Constant(n.type, 0)
    with cgutils.for_range(builder, builder.sdiv(n, lanes)) as loop:
        vector_step(builder.add(start, builder.mul(loop.index, lanes)))
    whole = builder.add(start, builder.mul(builder.sdiv(n, lanes), lanes))
    with cgutils.for_range_slice(builder, whole, builder.add(start, n), ir.Constant(n.type, 1)) as (d, _):
        scalar_step(d)


def _add_weighted(builder, op, vp, elt, dtype, w, n, start=None) -> None:
    """``o[start:start + n] += w * v[start:start + n]``: float32 ``o`` at ``op``, ``v`` of numba ``dtype`` (LLVM
    element ``elt``) at ``vp``, ``LANES`` at a time."""
    weight = splat(builder, w)

    def lanes(off):
        target = builder.bitcast(builder.gep(op, [off]), vec(F32).as_pointer())
        x = as_f32(builder, load_vec(builder, vp, off, elt), dtype)
        builder.store(fma(builder, weight, x, builder.load(target, align=1)), target, align=1)

    def one(d):
        target = builder.gep(op, [d])
        x = as_f32(builder, builder.load(builder.gep(vp, [d])), dtype)
        builder.store(builder.fadd(builder.load(target), builder.fmul(w, x)), target)

    _lanes_then_tail(builder, n, lanes, one, start)


@intrinsic
def axpy(typingctx, o, w, v):
    """``o[:] += w * v[:]`` for a float32 row ``o`` and a float32, int8 or f16 (uint16 bits) row ``v`` of unit
    stride, ``LANES`` at a time (a decode attention's weighted sum of values). numba's vectoriser leaves this loop
    scalar: it cannot prove that ``o`` and ``v`` do not overlap."""
    elt = _ROW_ELEMENTS[v.dtype]

    def codegen(context, builder, signature, args):
        (op, n), (vp, _) = row_of(context, builder, o, args[0]), row_of(context, builder, v, args[2])
        _add_weighted(builder, op, vp, elt, v.dtype, context.cast(builder, args[1], signature.args[1], types.float32),
                      n)
        return context.get_dummy_value()

    return types.none(o, w, v), codegen


def _groups(context, builder, signature, args, codes_at: int, group_step) -> None:
    """``group_step(base, g, scale)`` for each group of an int8 row (argument ``codes_at``) and its float32 scales
    (the next argument): the ``g = len(codes) // len(scales)`` values from ``base``, and their scale."""
    (_, n), (sp, groups) = (row_of(context, builder, signature.args[j], args[j]) for j in (codes_at, codes_at + 1))
    g = builder.sdiv(n, groups)
    with cgutils.for_range(builder, groups) as loop:
        group_step(builder.mul(loop.index, g), g, builder.load(builder.gep(sp, [loop.index])))


@intrinsic
def scaled_dot_row(typingctx, q, codes, scales):
    """``q · (codes * scales)`` for a float32 row ``q`` and an int8 row ``codes`` with one float32 scale per group
    of ``len(codes) / len(scales)`` values (a decode attention's score against an int8 key): each group's products
    summed in vectors and scaled, one horizontal sum at the end."""

    def codegen(context, builder, signature, args):
        qp, _ = row_of(context, builder, q, args[0])
        cp, _ = row_of(context, builder, codes, args[1])
        total = cgutils.alloca_once_value(builder, zeros())
        tail = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))

        def group(base, g, scale):  # the group's sums start at zero (stored here, in the loop)
            acc = cgutils.alloca_once_value(builder, zeros())
            part = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))

            def lanes(off):
                x = as_f32(builder, load_vec(builder, cp, off, I8), types.int8)
                builder.store(fma(builder, load_vec(builder, qp, off, F32), x, builder.load(acc)), acc)

            def one(d):
                x = as_f32(builder, builder.load(builder.gep(cp, [d])), types.int8)
                builder.store(builder.fadd(builder.load(part), builder.fmul(builder.load(builder.gep(qp, [d])), x)),
                              part)

            _lanes_then_tail(builder, g, lanes, one, base)
            builder.store(fma(builder, builder.load(acc), splat(builder, scale), builder.load(total)), total)
            builder.store(builder.fadd(builder.load(tail), builder.fmul(builder.load(part), scale)), tail)

        _groups(context, builder, signature, args, 1, group)
        return builder.fadd(hsum(builder, builder.load(total)), builder.load(tail))

    return types.float32(q, codes, scales), codegen


@intrinsic
def scaled_axpy(typingctx, o, w, codes, scales):
    """``o[:] += w * codes[:] * scales[group]`` for a float32 row ``o`` and an int8 row ``codes`` with one float32
    scale per group (a decode attention's weighted sum of int8 values)."""

    def codegen(context, builder, signature, args):
        op, _ = row_of(context, builder, o, args[0])
        cp, _ = row_of(context, builder, codes, args[2])
        w = context.cast(builder, args[1], signature.args[1], types.float32)

        def group(base, g, scale):
            _add_weighted(builder, op, cp, I8, types.int8, builder.fmul(w, scale), g, base)

        _groups(context, builder, signature, args, 2, group)
        return context.get_dummy_value()

    return types.none(o, w, codes, scales), codegen


@intrinsic
def store_row(typingctx, dst, src):
    """``dst[:] = src[:]`` for a float32 row ``src`` into a float32 row or an f16 one (uint16 bits, rounded to
    nearest), unit stride. (An int8 ``dst`` gets the values truncated: only so that a kernel's branch for the other
    caches compiles for the q8 one, whose rows are scaled first.)"""

    def convert(builder, x, n=None):
        if dst.dtype == types.uint16:
            return builder.bitcast(builder.fptrunc(x, vec(HALF, n) if n else HALF), vec(I16, n) if n else I16)
        if dst.dtype == types.int8:
            return builder.fptosi(x, vec(I8, n) if n else I8)
        return x

    def codegen(context, builder, signature, args):
        (dp, n), (sp, _) = row_of(context, builder, dst, args[0]), row_of(context, builder, src, args[1])

        def lanes(off):
            x = convert(builder, load_vec(builder, sp, off, F32), LANES)
            builder.store(x, builder.bitcast(builder.gep(dp, [off]), x.type.as_pointer()), align=1)

        def one(d):
            builder.store(convert(builder, builder.load(builder.gep(sp, [d]))), builder.gep(dp, [d]))

        _lanes_then_tail(builder, n, lanes, one)
        return context.get_dummy_value()

    return types.none(dst, src), codegen


@intrinsic
def is_half(typingctx, a):
    """Whether ``a`` holds f16 bits (uint16), as a constant the compiler folds (a kernel's branch per KV dtype)."""

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(1), int(a.dtype == types.uint16))

    return types.boolean(a), codegen


# Cephes' expf: exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), exp(r) by a degree-7
# polynomial; within 2 ulp of libm's expf over the range used
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp_vec(builder, x):
    """exp of each lane of a <LANES x float> (x clamped to [-87.3, 88.3]: no overflow, no denormals)."""
    def c(value):
        return ir.Constant(vec(F32), [value] * LANES)

    def call(name, *values):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec(F32), [vec(F32)] * len(values)),
                                            f"llvm.{name}.v{LANES}f32")
        return builder.call(fn, list(values))

    x = call("maxnum", call("minnum", x, c(88.3)), c(-87.3))
    n = call("floor", fma(builder, x, c(1.44269504088896341), c(0.5)))
    r = fma(builder, n, c(-0.693359375), x)
    r = fma(builder, n, c(2.12194440e-4), r)
    p = c(_EXP_POLY[0])
    for coefficient in _EXP_POLY[1:]:
        p = fma(builder, p, r, c(coefficient))
    p = fma(builder, p, builder.fmul(r, r), builder.fadd(r, c(1.0)))
    bits = builder.shl(builder.add(builder.fptosi(n, vec(I32)), ir.Constant(vec(I32), [127] * LANES)),
                       ir.Constant(vec(I32), [23] * LANES))
    return builder.fmul(p, builder.bitcast(bits, vec(F32)))


@intrinsic
def exp_shifted(typingctx, row, m):
    """``row[j] = exp(row[j] - m)`` for a float32 row of unit stride, ``LANES`` at a time (the rest by libm's
    expf); returns the sum (a softmax's numerator and denominator)."""

    def codegen(context, builder, signature, args):
        rp, n = row_of(context, builder, row, args[0])
        m = context.cast(builder, args[1], signature.args[1], types.float32)
        shift = splat(builder, m)
        total = cgutils.alloca_once_value(builder, zeros())
        tail = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
        expf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32]), "llvm.exp.f32")

        def lanes(off):
            target = builder.bitcast(builder.gep(rp, [off]), vec(F32).as_pointer())
            e = _exp_vec(builder, builder.fsub(builder.load(target, align=1), shift))
            builder.store(e, target, align=1)
            builder.store(builder.fadd(builder.load(total), e), total)

        def one(d):
            target = builder.gep(rp, [d])
            e = builder.call(expf, [builder.fsub(builder.load(target), m)])
            builder.store(e, target)
            builder.store(builder.fadd(builder.load(tail), e), tail)

        _lanes_then_tail(builder, n, lanes, one)
        return builder.fadd(hsum(builder, builder.load(total)), builder.load(tail))

    return types.float32(row, m), codegen


def _gated_intrinsic(name: str, argument):
    """An intrinsic ``f(gate, up, out)`` for float32 rows of unit stride: ``out[j] = gate[j] * up[j] / (1 +
    exp(argument(gate[j])))``, the exp ``LANES`` at a time (``_exp_vec``, 2 ulp) and the rest by libm's expf.
    ``argument(builder, g, const)`` emits the exp's argument for a vector or a scalar ``g``."""

    def typer(typingctx, gate, up, out):
        return types.none(gate, up, out), codegen

    def codegen(context, builder, signature, args):
        (gp, n), (up, _), (op, _) = (row_of(context, builder, signature.args[j], args[j]) for j in range(3))
        expf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32]), "llvm.exp.f32")

        def gated(g, u, exp, const):
            return builder.fdiv(builder.fmul(g, u), builder.fadd(const(1.0), exp(argument(builder, g, const))))

        def lanes(off):
            const = lambda value: ir.Constant(vec(F32), [value] * LANES)  # noqa: E731
            y = gated(load_vec(builder, gp, off, F32), load_vec(builder, up, off, F32),
                      lambda x: _exp_vec(builder, x), const)
            builder.store(y, builder.bitcast(builder.gep(op, [off]), vec(F32).as_pointer()), align=1)

        def one(d):
            y = gated(builder.load(builder.gep(gp, [d])), builder.load(builder.gep(up, [d])),
                      lambda x: builder.call(expf, [x]), lambda value: ir.Constant(F32, value))
            builder.store(y, builder.gep(op, [d]))

        _lanes_then_tail(builder, n, lanes, one)
        return context.get_dummy_value()

    typer.__name__ = name
    return intrinsic(typer)


GELU_C = 0.7978845608028654  # sqrt(2 / pi)


def _minus_tanh_gelu_argument(builder, g, const):
    """-2u with u = sqrt(2/pi) (g + 0.044715 g^3), clamped to [-80, 80]: 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u))."""
    def clamp(x, name, bound):
        t = x.type
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t]),
                                            f"llvm.{name}.v{t.count}f32" if isinstance(t, ir.VectorType) else
                                            f"llvm.{name}.f32")
        return builder.call(fn, [x, const(bound)])

    cube = builder.fmul(builder.fmul(builder.fmul(const(0.044715), g), g), g)
    u = builder.fmul(const(2.0 * GELU_C), builder.fadd(g, cube))
    return builder.fmul(clamp(clamp(u, "maxnum", -80.0), "minnum", 80.0), const(-1.0))


silu_mul_row = _gated_intrinsic("silu_mul_row", lambda builder, g, const: builder.fmul(g, const(-1.0)))
gelu_mul_row = _gated_intrinsic("gelu_mul_row", _minus_tanh_gelu_argument)
