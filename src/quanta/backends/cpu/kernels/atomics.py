"""Atomics, spin hints, raw pointers and the futex for the native worker threads (``workers.py``), as intrinsics.

numba has no atomics; these emit LLVM's ``load atomic``/``cmpxchg``/``atomicrmw`` (sequentially consistent) on one
element of an int64 array, ``llvm.x86.sse2.pause``, and libc's ``syscall``/``sched_yield`` declared by name (so
that a cached kernel holds no process-specific address). ``*_array_*d`` view an address as an array: a worker
finds a job's arrays from the addresses in its descriptor.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I32, I64 = ir.IntType(32), ir.IntType(64)
SYS_FUTEX = 202  # x86-64
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129


def _element(context, builder, sig, args):
    arr = context.make_array(sig.args[0])(context, builder, args[0])
    i = context.cast(builder, args[1], sig.args[1], types.intp)
    return cgutils.get_item_pointer(context, builder, sig.args[0], arr, [i])


@intrinsic
def atomic_load(typingctx, arr, i):
    """``arr[i]`` of an int64 array, read atomically."""

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_element(context, builder, sig, args), "seq_cst", 8)

    return types.int64(arr, i), codegen


@intrinsic
def atomic_store(typingctx, arr, i, value):
    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, _element(context, builder, sig, args), "seq_cst", 8)
        return context.get_dummy_value()

    return types.none(arr, i, value), codegen


@intrinsic
def atomic_add(typingctx, arr, i, value):
    """``arr[i] += value`` atomically; returns the old value."""

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", _element(context, builder, sig, args), v, "seq_cst")

    return types.int64(arr, i, value), codegen


@intrinsic
def compare_exchange(typingctx, arr, i, expected, value):
    """Set ``arr[i] = value`` if it still holds ``expected``; True when it did."""

    def codegen(context, builder, sig, args):
        e = context.cast(builder, args[2], sig.args[2], types.int64)
        v = context.cast(builder, args[3], sig.args[3], types.int64)
        pair = builder.cmpxchg(_element(context, builder, sig, args), e, v, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return types.boolean(arr, i, expected, value), codegen


@intrinsic
def spin_pause(typingctx):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def cycles(typingctx):
    """The time-stamp counter (``rdtsc``): a cheap clock for spin limits."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, []), "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def yield_cpu(typingctx):
    """``sched_yield()``: let another runnable thread have this core."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


def _futex(builder, addr, op: int, value):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, [I64], var_arg=True), "syscall")
    null = ir.Constant(I64, 0)
    return builder.call(fn, [ir.Constant(I64, SYS_FUTEX), addr, ir.Constant(I32, op), value, null, null, null])


@intrinsic
def futex_wait(typingctx, arr, i, expected):
    """Sleep while the low 32 bits of ``arr[i]`` equal ``expected`` (returns at once when they differ)."""

    def codegen(context, builder, sig, args):
        addr = builder.ptrtoint(_element(context, builder, sig, args), I64)
        e = builder.trunc(context.cast(builder, args[2], sig.args[2], types.int64), I32)
        _futex(builder, addr, FUTEX_WAIT_PRIVATE, e)
        return context.get_dummy_value()

    return types.none(arr, i, expected), codegen


@intrinsic
def futex_wake(typingctx, arr, i):
    """Wake every thread sleeping in ``futex_wait`` on ``arr[i]``."""

    def codegen(context, builder, sig, args):
        addr = builder.ptrtoint(_element(context, builder, sig, args), I64)
        _futex(builder, addr, FUTEX_WAKE_PRIVATE, ir.Constant(I32, 1 << 30))
        return context.get_dummy_value()

    return types.none(arr, i), codegen


def _array_from_address(dtype, ndim: int):
    aryty = types.Array(dtype, ndim, "C")

    def typer(typingctx, addr, shape):
        def codegen(context, builder, sig, args):
            ary = context.make_array(aryty)(context, builder)
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(dtype)))
            dims = [builder.extract_value(args[1], j) for j in range(ndim)] if ndim > 1 else [args[1]]
            dims = [context.cast(builder, d, types.int64, types.intp) for d in dims]
            strides, step = [], itemsize
            for d in reversed(dims):
                strides.insert(0, step)
                step = builder.mul(step, d)
            context.populate_array(ary, data=builder.inttoptr(args[0], ary.data.type),
                                   shape=cgutils.pack_array(builder, dims), strides=cgutils.pack_array(builder, strides),
                                   itemsize=itemsize, meminfo=None)
            return ary._getvalue()

        shape_type = types.UniTuple(types.int64, ndim) if ndim > 1 else types.int64
        return aryty(types.int64, shape_type), codegen

    typer.__name__ = f"{dtype}_array_{ndim}d"
    return intrinsic(typer)


# ``<dtype>_array_<n>d(address, shape)``: a C-contiguous view of memory owned elsewhere (numba's ``carray`` pulls
# in numba's array module when a cached kernel loads; this does not)
u8_array_2d = _array_from_address(types.uint8, 2)
i8_array_2d = _array_from_address(types.int8, 2)
i32_array_1d = _array_from_address(types.int32, 1)
i32_array_2d = _array_from_address(types.int32, 2)
i32_array_3d = _array_from_address(types.int32, 3)
u16_array_3d = _array_from_address(types.uint16, 3)
f32_array_2d = _array_from_address(types.float32, 2)
f32_array_3d = _array_from_address(types.float32, 3)
f32_array_1d = _array_from_address(types.float32, 1)
f64_array_1d = _array_from_address(types.float64, 1)
