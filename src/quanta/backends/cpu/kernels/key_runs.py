"""Intrinsics over a run of consecutive KV slots (the part of a paged block a query sees): the scores of a KV head's
query heads against the run's keys, and the weighted sums of its values.

The decode attention on the CPU met its keys one at a time: a dot product with a horizontal sum per key, and an
``o += w * v`` per value that went through memory (each key's update waited on the one before it). Here a few keys
share each load of the queries and keep independent sums, the weighted sums keep their slice of the output in
registers across the whole run (added once at the end), and the query heads that share a KV head (GQA) share each
key's and value's load and f16 conversion (``HEADS_PER_PASS`` at most; the conversion, one instruction per 8 values
on AVX2, bounded the per-head loop). Rows are float32, f16 (uint16 bits) or int8 (taken as they are: an int8
cache's scales are not applied here); tested against numpy in tests/backends/cpu/test_key_runs.py.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.simd import F32, I8, I16, I32, call, fma, load_vec, splat, vec, zeros
from quanta.backends.cpu.kernels.vector_rows import as_f32, row_of

HEADS_PER_PASS = 4  # query heads of one KV head served by each load of its keys and values (GQA)
# per number of heads in a pass: the vectors' lanes and the keys (or independent sums) per step, so that the sums
# (heads x keys vectors), the query rows and one key stay within AVX2's sixteen registers
_STEP_SHAPE = {1: (16, 4), 2: (8, 4), 3: (8, 4), 4: (8, 2)}
_ELEMENTS = {types.float32: F32, types.uint16: I16, types.int8: I8}


def _element(rows):
    """The LLVM element type of a run argument's rows, or None where it is not a C-contiguous 2-D array of a
    supported dtype (the intrinsic then does not type)."""
    return _ELEMENTS[rows.dtype] if _is_rows(rows) and rows.dtype in _ELEMENTS else None


def _is_rows(a, dtype=None) -> bool:
    """Whether ``a`` is a C-contiguous 2-D array (of ``dtype`` if given)."""
    return isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and dtype in (None, a.dtype)


def _run(context, builder, ty, value):
    """(data pointer, rows, row length) of a C-contiguous 2-D array argument."""
    arr = context.make_array(ty)(context, builder, value)
    rows, width = cgutils.unpack_tuple(builder, arr.shape)
    return arr.data, rows, width


def _keys_then_rest(builder, n, step, per_step: int) -> None:
    """``step(first, count)`` for the ``n`` rows ``per_step`` at a time, then one at a time."""
    size = ir.Constant(n.type, per_step)
    with cgutils.for_range(builder, builder.sdiv(n, size)) as loop:
        step(builder.mul(loop.index, size), per_step)
    with cgutils.for_range_slice(builder, builder.mul(builder.sdiv(n, size), size), n, ir.Constant(n.type, 1)) as (
            j, _):
        step(j, 1)


def _for_heads(builder, heads, emit) -> None:
    """``emit(g)`` for the run-time number of heads ``heads`` (1 to ``HEADS_PER_PASS``; nothing for others)."""
    def dispatch(g: int) -> None:
        with builder.if_else(builder.icmp_signed("==", heads, ir.Constant(heads.type, g))) as (then, otherwise):
            with then:
                emit(g)
            with otherwise:
                if g < HEADS_PER_PASS:
                    dispatch(g + 1)
    dispatch(1)


def _sums(builder, accs):
    """<4 x float>: the lane sums of up to four <8 or 16 x float> vectors (zero in the lanes past them), in one
    reduction (pairwise adds of shuffled halves, as ``vhaddps`` does) instead of one each."""
    def halves(v, n):
        lo = builder.shuffle_vector(v, v, ir.Constant(vec(I32, n // 2), list(range(n // 2))))
        hi = builder.shuffle_vector(v, v, ir.Constant(vec(I32, n // 2), list(range(n // 2, n))))
        return builder.fadd(lo, hi)

    def pair_sums(a, b):  # [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
        even = builder.shuffle_vector(a, b, ir.Constant(vec(I32, 8), [0, 2, 8, 10, 4, 6, 12, 14]))
        odd = builder.shuffle_vector(a, b, ir.Constant(vec(I32, 8), [1, 3, 9, 11, 5, 7, 13, 15]))
        return builder.fadd(even, odd)

    eights = [halves(a, 16) if a.type.count == 16 else a for a in accs]  # 16 → 8 lanes each
    eights += [zeros(8)] * (4 - len(eights))
    sums = pair_sums(pair_sums(eights[0], eights[1]), pair_sums(eights[2], eights[3]))
    return halves(sums, 8)


def _maxnum(builder, a, b):
    """LLVM's lane-wise maximum of two <4 x float>."""
    return call(builder, "llvm.maxnum.v4f32", vec(F32, 4), a, b)


def _max_of_four(builder, v):
    """The largest lane of a <4 x float>."""
    pairs = _maxnum(builder, v, builder.shuffle_vector(v, v, ir.Constant(vec(I32, 4), [2, 3, 0, 1])))
    swapped = builder.shuffle_vector(pairs, pairs, ir.Constant(vec(I32, 4), [1, 0, 3, 2]))
    return builder.extract_element(_maxnum(builder, pairs, swapped), ir.Constant(I32, 0))


@intrinsic
def scores_of_run(typingctx, scores, start, q, keys, scale, best):
    """``scores[g, start + j] = scale * (q[g] · keys[j])`` for the rows j of a C-contiguous (n, d) float32, f16 or
    int8 ``keys`` and each of the G <= ``HEADS_PER_PASS`` float32 query rows of ``q`` (G, d) (``scores``: G rows,
    C-contiguous); ``best[g]`` becomes the larger of itself and head g's largest score. Each key is loaded and
    converted once for the G heads."""
    elt = _element(keys)
    if elt is None or not (_is_rows(q, types.float32) and _is_rows(scores, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        sp, _, width = _run(context, builder, scores, args[0])
        at = context.cast(builder, args[1], signature.args[1], types.intp)
        qp, heads, d = _run(context, builder, q, args[2])
        kp, n, _ = _run(context, builder, keys, args[3])
        s = context.cast(builder, args[4], signature.args[4], types.float32)
        bp, _ = row_of(context, builder, best, args[5])

        def emit(g_count: int) -> None:
            lanes, per_step = _STEP_SHAPE[g_count]
            heads_ = range(g_count)
            accs = [[cgutils.alloca_once_value(builder, zeros(lanes)) for _ in range(per_step)] for _ in heads_]
            tails = [[cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(per_step)]
                     for _ in heads_]
            bests = [cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 4), [float("-inf")] * 4))
                     for _ in heads_]
            q_rows = [builder.mul(ir.Constant(d.type, g), d) for g in heads_]
            whole = builder.mul(builder.sdiv(d, ir.Constant(d.type, lanes)), ir.Constant(d.type, lanes))

            def step(first, count):
                rows = [builder.mul(builder.add(first, ir.Constant(first.type, i)), d) for i in range(count)]
                for g in heads_:
                    for i in range(count):
                        builder.store(zeros(lanes), accs[g][i])
                        builder.store(ir.Constant(F32, 0.0), tails[g][i])
                with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(d.type, lanes))) as loop:
                    off = builder.mul(loop.index, ir.Constant(d.type, lanes))
                    for i in range(count):
                        k = as_f32(builder, load_vec(builder, kp, builder.add(rows[i], off), elt, lanes), keys.dtype)
                        for g in heads_:
                            qv = load_vec(builder, qp, builder.add(q_rows[g], off), F32, lanes)
                            builder.store(fma(builder, qv, k, builder.load(accs[g][i])), accs[g][i])
                with cgutils.for_range_slice(builder, whole, d, ir.Constant(d.type, 1)) as (e, _):
                    for i in range(count):
                        k = as_f32(builder, builder.load(builder.gep(kp, [builder.add(rows[i], e)])), keys.dtype)
                        for g in heads_:
                            qe = builder.load(builder.gep(qp, [builder.add(q_rows[g], e)]))
                            builder.store(builder.fadd(builder.load(tails[g][i]), builder.fmul(qe, k)), tails[g][i])
                for g in heads_:
                    tail = ir.Constant(vec(F32, 4), [0.0] * 4)
                    for i in range(count):
                        tail = builder.insert_element(tail, builder.load(tails[g][i]), ir.Constant(I32, i))
                    dots = _sums(builder, [builder.load(accs[g][i]) for i in range(count)])
                    found = builder.fmul(splat(builder, s, 4), builder.fadd(dots, tail))
                    seen = found if count == 4 else builder.shuffle_vector(  # lanes past the run: -inf
                        found, ir.Constant(vec(F32, 4), [float("-inf")] * 4),
                        ir.Constant(vec(I32, 4), [*range(count), *range(4 + count, 8)]))
                    builder.store(_maxnum(builder, builder.load(bests[g]), seen), bests[g])
                    row = builder.add(builder.mul(ir.Constant(width.type, g), width), builder.add(at, first))
                    for i in range(count):
                        builder.store(builder.extract_element(found, ir.Constant(I32, i)),
                                      builder.gep(sp, [builder.add(row, ir.Constant(row.type, i))]))

            _keys_then_rest(builder, n, step, per_step)
            for g in heads_:
                slot = builder.gep(bp, [ir.Constant(d.type, g)])
                top = _max_of_four(builder, builder.load(bests[g]))
                builder.store(builder.select(builder.fcmp_ordered(">", top, builder.load(slot)), top,
                                             builder.load(slot)), slot)

        _for_heads(builder, heads, emit)
        return context.get_dummy_value()

    return types.none(scores, start, q, keys, scale, best), codegen


@intrinsic
def add_weighted_run(typingctx, o, weights, start, values):
    """``o[g] += Σ_j weights[g, start + j] * values[j]`` for each of the G <= ``HEADS_PER_PASS`` float32 rows of
    ``o`` (G, d) and the rows j of a C-contiguous (n, d) float32, f16 or int8 ``values`` (``weights``: G rows,
    C-contiguous). Each value is loaded and converted once for the G heads."""
    elt = _element(values)
    if elt is None or not (_is_rows(o, types.float32) and _is_rows(weights, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        op, heads, d = _run(context, builder, o, args[0])
        wp, _, width = _run(context, builder, weights, args[1])
        at = context.cast(builder, args[2], signature.args[2], types.intp)
        vp, n, _ = _run(context, builder, values, args[3])

        def emit(g_count: int) -> None:
            lanes, per_step = _STEP_SHAPE[g_count]
            heads_ = range(g_count)
            accs = [[cgutils.alloca_once_value(builder, zeros(lanes)) for _ in range(per_step)] for _ in heads_]
            tail = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
            w_rows = [builder.add(builder.mul(ir.Constant(width.type, g), width), at) for g in heads_]

            def column(off):  # o[g, off:off + lanes] += the run's weighted values there
                def step(first, count):
                    for i in range(count):
                        j = builder.add(first, ir.Constant(first.type, i))
                        spot = builder.add(builder.mul(j, d), off)
                        x = as_f32(builder, load_vec(builder, vp, spot, elt, lanes), values.dtype)
                        for g in heads_:
                            w = splat(builder, builder.load(builder.gep(wp, [builder.add(w_rows[g], j)])), lanes)
                            builder.store(fma(builder, w, x, builder.load(accs[g][i])), accs[g][i])
                return step

            with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(d.type, lanes))) as loop:
                off = builder.mul(loop.index, ir.Constant(d.type, lanes))
                for g in heads_:
                    for acc in accs[g]:
                        builder.store(zeros(lanes), acc)
                _keys_then_rest(builder, n, column(off), per_step)
                for g in heads_:
                    total = builder.load(accs[g][0])
                    for acc in accs[g][1:]:
                        total = builder.fadd(total, builder.load(acc))
                    spot = builder.add(builder.mul(ir.Constant(d.type, g), d), off)
                    target = builder.bitcast(builder.gep(op, [spot]), vec(F32, lanes).as_pointer())
                    builder.store(builder.fadd(builder.load(target, align=1), total), target, align=1)
            whole = builder.mul(builder.sdiv(d, ir.Constant(d.type, lanes)), ir.Constant(d.type, lanes))
            for g in heads_:  # the columns past the vectors, a head and a value at a time
                with cgutils.for_range_slice(builder, whole, d, ir.Constant(d.type, 1)) as (e, _):
                    builder.store(ir.Constant(F32, 0.0), tail)
                    with cgutils.for_range(builder, n) as loop:
                        j = loop.index
                        x = as_f32(builder, builder.load(builder.gep(vp, [builder.add(builder.mul(j, d), e)])),
                                   values.dtype)
                        w = builder.load(builder.gep(wp, [builder.add(w_rows[g], j)]))
                        builder.store(builder.fadd(builder.load(tail), builder.fmul(w, x)), tail)
                    target = builder.gep(op, [builder.add(builder.mul(ir.Constant(d.type, g), d), e)])
                    builder.store(builder.fadd(builder.load(target), builder.load(tail)), target)

        _for_heads(builder, heads, emit)
        return context.get_dummy_value()

    return types.none(o, weights, start, values), codegen


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
