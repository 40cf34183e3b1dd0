"""Intrinsics over a run of consecutive KV slots (the part of a paged block a query sees): a query's scores against
the run's keys, and the weighted sum of its values.

The decode attention on the CPU met its keys one at a time: a dot product with a horizontal sum per key, and an
``o += w * v`` per value that went through memory (each key's update waited on the one before it). Here four keys
share each load of the query and keep four independent sums, and the weighted sum keeps ``LANES`` of the output in
registers across the whole run (four running sums, added once at the end). Rows are float32, f16 (uint16 bits) or
int8 (taken as they are: an int8 cache's scales are not applied here); tested against numpy in
tests/backends/cpu/test_key_runs.py.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.simd import F32, I8, I16, I32, LANES, fma, hsum, load_vec, splat, vec, zeros
from quanta.backends.cpu.kernels.vector_rows import as_f32, row_of

KEYS_PER_STEP = 4  # keys (or values) per iteration: independent sums in flight
_ELEMENTS = {types.float32: F32, types.uint16: I16, types.int8: I8}


def _element(rows):
    """The LLVM element type of a run argument's rows, or None where it is not a C-contiguous 2-D array of a
    supported dtype (the intrinsic then does not type)."""
    ok = isinstance(rows, types.Array) and rows.ndim == 2 and rows.layout == "C" and rows.dtype in _ELEMENTS
    return _ELEMENTS[rows.dtype] if ok else None


def _run(context, builder, ty, value):
    """(data pointer, rows, row length) of a C-contiguous 2-D array argument."""
    arr = context.make_array(ty)(context, builder, value)
    rows, width = cgutils.unpack_tuple(builder, arr.shape)
    return arr.data, rows, width


def _keys_then_rest(builder, n, step) -> None:
    """``step(first, count)`` for the ``n`` rows ``KEYS_PER_STEP`` at a time, then one at a time."""
    four = ir.Constant(n.type, KEYS_PER_STEP)
    with cgutils.for_range(builder, builder.sdiv(n, four)) as loop:
        step(builder.mul(loop.index, four), KEYS_PER_STEP)
    with cgutils.for_range_slice(builder, builder.mul(builder.sdiv(n, four), four), n, ir.Constant(n.type, 1)) as (
            j, _):
        step(j, 1)


def _sums_of_four(builder, accs):
    """<4 x float>: the lane sums of four <LANES x float> vectors, in one reduction (pairwise adds of shuffled
    halves, as ``vhaddps`` does) instead of four."""
    def halves(v, n):
        lo = builder.shuffle_vector(v, v, ir.Constant(vec(I32, n // 2), list(range(n // 2))))
        hi = builder.shuffle_vector(v, v, ir.Constant(vec(I32, n // 2), list(range(n // 2, n))))
        return builder.fadd(lo, hi)

    def pair_sums(a, b):  # [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
        even = builder.shuffle_vector(a, b, ir.Constant(vec(I32, 8), [0, 2, 8, 10, 4, 6, 12, 14]))
        odd = builder.shuffle_vector(a, b, ir.Constant(vec(I32, 8), [1, 3, 9, 11, 5, 7, 13, 15]))
        return builder.fadd(even, odd)

    eights = [halves(a, LANES) for a in accs]  # 16 → 8 lanes each
    sums = pair_sums(pair_sums(eights[0], eights[1]), pair_sums(eights[2], eights[3]))
    return halves(sums, 8)


@intrinsic
def scores_of_run(typingctx, scores, q, keys, scale):
    """``scores[j] = scale * (q · keys[j])`` for the rows of a C-contiguous (n, d) float32 or f16 ``keys`` and a
    float32 row ``q`` of d values; returns the largest score (-inf for no rows)."""
    elt = _element(keys)
    if elt is None:
        return None

    def codegen(context, builder, signature, args):
        sp, _ = row_of(context, builder, scores, args[0])
        qp, _ = row_of(context, builder, q, args[1])
        kp, n, d = _run(context, builder, keys, args[2])
        s = context.cast(builder, args[3], signature.args[3], types.float32)
        best = cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 4), [float("-inf")] * 4))
        accs = [cgutils.alloca_once_value(builder, zeros()) for _ in range(KEYS_PER_STEP)]
        tails = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(KEYS_PER_STEP)]
        lanes = ir.Constant(d.type, LANES)
        whole = builder.mul(builder.sdiv(d, lanes), lanes)
        maxnum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec(F32, 4), [vec(F32, 4)] * 2),
                                                "llvm.maxnum.v4f32")

        def step(first, count):
            rows = [builder.mul(builder.add(first, ir.Constant(first.type, i)), d) for i in range(count)]
            for i in range(count):
                builder.store(zeros(), accs[i])
                builder.store(ir.Constant(F32, 0.0), tails[i])
            with cgutils.for_range(builder, builder.sdiv(d, lanes)) as loop:
                off = builder.mul(loop.index, lanes)
                qv = load_vec(builder, qp, off, F32)
                for i in range(count):
                    k = as_f32(builder, load_vec(builder, kp, builder.add(rows[i], off), elt), keys.dtype)
                    builder.store(fma(builder, qv, k, builder.load(accs[i])), accs[i])
            with cgutils.for_range_slice(builder, whole, d, ir.Constant(d.type, 1)) as (e, _):
                qe = builder.load(builder.gep(qp, [e]))
                for i in range(count):
                    k = as_f32(builder, builder.load(builder.gep(kp, [builder.add(rows[i], e)])), keys.dtype)
                    builder.store(builder.fadd(builder.load(tails[i]), builder.fmul(qe, k)), tails[i])
            tail = ir.Constant(vec(F32, 4), [0.0] * 4)
            for i in range(count):
                tail = builder.insert_element(tail, builder.load(tails[i]), ir.Constant(I32, i))
            if count == KEYS_PER_STEP:
                dots = _sums_of_four(builder, [builder.load(acc) for acc in accs])
            else:  # one key: its sum in lane 0, the other lanes -inf for the maximum
                dots = builder.insert_element(ir.Constant(vec(F32, 4), [0.0] + [float("-inf")] * 3),
                                              hsum(builder, builder.load(accs[0])), ir.Constant(I32, 0))
            found = builder.fmul(splat(builder, s, 4), builder.fadd(dots, tail))
            builder.store(builder.call(maxnum, [builder.load(best), found]), best)
            for i in range(count):
                builder.store(builder.extract_element(found, ir.Constant(I32, i)),
                              builder.gep(sp, [builder.add(first, ir.Constant(first.type, i))]))

        _keys_then_rest(builder, n, step)
        top = builder.load(best)
        pairs = builder.call(maxnum, [top, builder.shuffle_vector(top, top, ir.Constant(vec(I32, 4), [2, 3, 0, 1]))])
        swapped = builder.shuffle_vector(pairs, pairs, ir.Constant(vec(I32, 4), [1, 0, 3, 2]))
        last = builder.call(maxnum, [pairs, swapped])
        return builder.extract_element(last, ir.Constant(I32, 0))

    return types.float32(scores, q, keys, scale), codegen


@intrinsic
def add_weighted_run(typingctx, o, weights, values):
    """``o[:] += Σ_j weights[j] * values[j]`` for a float32 row ``o`` of d values and the rows of a C-contiguous
    (n, d) float32 or f16 ``values``."""
    elt = _element(values)
    if elt is None:
        return None

    def codegen(context, builder, signature, args):
        op, _ = row_of(context, builder, o, args[0])
        wp, _ = row_of(context, builder, weights, args[1])
        vp, n, d = _run(context, builder, values, args[2])
        accs = [cgutils.alloca_once_value(builder, zeros()) for _ in range(KEYS_PER_STEP)]
        tail = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
        lanes = ir.Constant(d.type, LANES)

        def column(off, width):  # o[off:off + width] += the run's weighted values there
            def step(first, count):
                for i in range(count):
                    j = builder.add(first, ir.Constant(first.type, i))
                    w = builder.load(builder.gep(wp, [j]))
                    at = builder.add(builder.mul(j, d), off)
                    if width == LANES:
                        x = as_f32(builder, load_vec(builder, vp, at, elt), values.dtype)
                        builder.store(fma(builder, splat(builder, w), x, builder.load(accs[i])), accs[i])
                    else:
                        x = as_f32(builder, builder.load(builder.gep(vp, [at])), values.dtype)
                        builder.store(builder.fadd(builder.load(tail), builder.fmul(w, x)), tail)
            return step

        with cgutils.for_range(builder, builder.sdiv(d, lanes)) as loop:
            off = builder.mul(loop.index, lanes)
            for acc in accs:
                builder.store(zeros(), acc)
            _keys_then_rest(builder, n, column(off, LANES))
            total = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                                 builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
            target = builder.bitcast(builder.gep(op, [off]), vec(F32).as_pointer())
            builder.store(builder.fadd(builder.load(target, align=1), total), target, align=1)
        whole = builder.mul(builder.sdiv(d, lanes), lanes)
        with cgutils.for_range_slice(builder, whole, d, ir.Constant(d.type, 1)) as (e, _):
            builder.store(ir.Constant(F32, 0.0), tail)
            with cgutils.for_range(builder, n) as loop:
                column(e, 1)(loop.index, 1)
            target = builder.gep(op, [e])
            builder.store(builder.fadd(builder.load(target), builder.load(tail)), target)
        return context.get_dummy_value()

    return types.none(o, weights, values), codegen


@intrinsic
def prefetch_run(typingctx, rows):
    """Ask for the cache lines of a C-contiguous 2-D array (a run of pool slots about to be read: the next paged
    block's keys, a block's values while its keys are scored); a hint, it never faults."""
    if not (isinstance(rows, types.Array) and rows.ndim == 2 and rows.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        base, n, d = _run(context, builder, rows, args[0])
        nbytes = builder.mul(builder.mul(n, d), ir.Constant(n.type, context.get_abi_sizeof(
            context.get_data_type(rows.dtype))))
        byte_ptr = builder.bitcast(base, ir.IntType(8).as_pointer())
        fn = builder.module.declare_intrinsic("llvm.prefetch", [byte_ptr.type],
                                              ir.FunctionType(ir.VoidType(), [byte_ptr.type, I32, I32, I32]))
        with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), nbytes, ir.Constant(n.type, 64)) as (at, _):
            builder.call(fn, [builder.gep(byte_ptr, [at]), ir.Constant(I32, 0), ir.Constant(I32, 3),
                              ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return types.none(rows), codegen
