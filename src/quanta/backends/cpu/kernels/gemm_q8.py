"""Fast-mode prefill GEMM with 8-bit activations: ``out[t, r] = sum_k w[r, k] x[t, k]`` in AVX-512 VNNI integers.

Per thread, for each tile of 16 weight rows: unpack the tile once into VNNI layout (``gemm_q8_pack``: codes
``u``, per-unit scale ``s`` and constant ``c``), then sweep all activation rows 8 tokens at a time. Register tile:
16 rows x 8 tokens; per unit of U weights and token t, ``U/4`` ``vpdpbusd zmm`` (64 code bytes of 16 rows x
4 bytes of ``xq[t]`` broadcast) give 16 integer dots, then ``acc_t += (s * xd[t, j]) * isum + c * xs[t, j]``
where ``xd`` is the activation block scale and ``xs = xd * sum(xq)`` the unit's sum of the quantized activations
(as the GEMV, so the result is exactly ``q8(x) @ W.T`` up to fp32 rounding). 512 MACs per ~12 instructions.
Same arithmetic as the fast GEMV (``legacy_dot_q8``); tested against gguf-py's dequantize.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.activations import quantize_q8_32
from quanta.backends.cpu.kernels.gemm_q8_pack import (
    TILE_ROWS, pack_q4_0, pack_q4_1, pack_q4_k, pack_q5_0, pack_q5_1, pack_q5_k, pack_q6_k, pack_q8_0,
)  # fmt: skip
from quanta.backends.cpu.kernels.isa import isa_of
from quanta.backends.cpu.kernels.int8_dots import dot_u8s8
from quanta.backends.cpu.kernels.simd import F32, I8, I32, data_ptr, fma, splat, vec

TOKENS = 8  # activation rows per register tile (8 int + 8 float accumulators of 16 lanes); padding unit of n
TOKENS_256 = 4  # with 256-bit registers: 8 rows x 4 tokens (4 int + 4 float accumulators: fits AVX2's 16)
_V16 = vec(I32, 16)


def _vpdpbusd512(builder, acc, a, b):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16, [_V16, _V16, _V16]), "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, a, b])


def _shape(context, builder, arrty, arr):
    return cgutils.unpack_tuple(builder, context.make_array(arrty)(context, builder, arr).shape)


def _make_gemm_tile(unit: int):
    """``f(isa, codes, scales, consts, xq, xdu, xsu, n, out, col0)``: the register tile of the module docstring.

    AVX-512 VNNI: 16 rows x ``TOKENS`` tokens in 512-bit registers. The 256-bit paths (AVX-VNNI, AVX2) take each
    16-row tile as two halves of 8 rows (the two 32-byte halves of each 64-byte code line), ``TOKENS_256`` tokens
    at a time, so that the accumulators fit AVX2's 16 registers."""
    groups = unit // 4

    def typer(typingctx, isa_token, codes, scales, consts, xq, xdu, xsu, n, out, col0):
        sig = types.none(isa_token, codes, scales, consts, xq, xdu, xsu, n, out, col0)
        isa = isa_of(isa_token)
        wide = isa == "avx512_vnni"
        lanes, halves, tokens = (16, 1, TOKENS) if wide else (8, 2, TOKENS_256)
        iv, fv = vec(I32, lanes), vec(F32, lanes)

        def dot4(builder, acc, w, xv):  # acc + per i32 lane the sum of 4 u8 codes x 4 s8 activations
            if wide:
                return _vpdpbusd512(builder, acc, w, xv)
            return builder.add(acc, dot_u8s8(isa, builder, builder.bitcast(w, vec(I8, 32)),
                                             builder.bitcast(xv, vec(I8, 32))))

        def codegen(context, builder, signature, args):
            sa, args = signature.args[1:], args[1:]
            cp, sp, kp, qp, dp, xsp, op = [data_ptr(context, builder, sa[i], args[i]) for i in (0, 1, 2, 3, 4, 5, 7)]
            cp = builder.bitcast(cp, iv.as_pointer())
            sp, kp = (builder.bitcast(p, fv.as_pointer()) for p in (sp, kp))
            qp = builder.bitcast(qp, I32.as_pointer())
            n_pad, k = _shape(context, builder, sa[3], args[3])
            ldo = _shape(context, builder, sa[7], args[7])[1]
            n = context.cast(builder, args[6], sa[6], types.intp)
            col0 = context.cast(builder, args[8], sa[8], types.intp)
            c = lambda v: ir.Constant(k.type, v)  # noqa: E731
            nunits, k_words = builder.sdiv(k, c(unit)), builder.sdiv(k, c(4))
            accs = [cgutils.alloca_once(builder, fv) for _ in range(tokens)]
            for half in range(halves):
                with cgutils.for_range(builder, builder.sdiv(n_pad, c(tokens))) as tloop:
                    t0 = builder.mul(tloop.index, c(tokens))
                    for a in accs:
                        builder.store(ir.Constant(fv, [0.0] * lanes), a)
                    with cgutils.for_range(builder, nunits) as uloop:
                        j = uloop.index
                        isums = [ir.Constant(iv, [0] * lanes)] * tokens
                        for g in range(groups):
                            word = builder.add(builder.mul(j, c(groups)), c(g))
                            line = builder.add(builder.mul(word, c(halves)), c(half))
                            w = builder.load(builder.gep(cp, [line]), align=1)
                            for t in range(tokens):
                                at = builder.add(builder.mul(builder.add(t0, c(t)), k_words), word)
                                xv = splat(builder, builder.load(builder.gep(qp, [at]), align=4), lanes)
                                isums[t] = dot4(builder, isums[t], w, xv)
                        line = builder.add(builder.mul(j, c(halves)), c(half))
                        s = builder.load(builder.gep(sp, [line]), align=4)
                        kc = builder.load(builder.gep(kp, [line]), align=4)
                        for t in range(tokens):
                            at = builder.add(builder.mul(builder.add(t0, c(t)), nunits), j)
                            xd = splat(builder, builder.load(builder.gep(dp, [at])), lanes)
                            xs = splat(builder, builder.load(builder.gep(xsp, [at])), lanes)
                            acc = fma(builder, builder.sitofp(isums[t], fv), builder.fmul(s, xd), builder.load(accs[t]))
                            builder.store(fma(builder, kc, xs, acc), accs[t])
                    for t in range(tokens):
                        row = builder.add(t0, c(t))
                        with builder.if_then(builder.icmp_signed("<", row, n)):
                            col = builder.add(col0, c(lanes * half))
                            dst = builder.gep(op, [builder.add(builder.mul(row, ldo), col)])
                            builder.store(builder.load(accs[t]), builder.bitcast(dst, fv.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"gemm_tile_u{unit}"
    return intrinsic(typer)


gemm_tile_u32 = _make_gemm_tile(32)
gemm_tile_u16 = _make_gemm_tile(16)


@njit
def _pack(fmt, raw2d, r0, nrows, codes, scales, consts):
    if fmt == 0:
        pack_q4_0(raw2d, r0, nrows, codes, scales, consts)
    elif fmt == 1:
        pack_q4_1(raw2d, r0, nrows, codes, scales, consts)
    elif fmt == 2:
        pack_q5_0(raw2d, r0, nrows, codes, scales, consts)
    elif fmt == 3:
        pack_q5_1(raw2d, r0, nrows, codes, scales, consts)
    elif fmt == 4:
        pack_q8_0(raw2d, r0, nrows, codes, scales, consts)
    elif fmt == 7:
        pack_q4_k(raw2d, r0, nrows, codes, scales, consts)
    elif fmt == 8:
        pack_q5_k(raw2d, r0, nrows, codes, scales, consts)
    else:
        pack_q6_k(raw2d, r0, nrows, codes, scales, consts)


def gemm_scratch(n_pad: int, k: int, unit: int) -> tuple[np.ndarray, ...]:
    """Scratch for one ``gemm_q8_rows`` call: packed codes (with slack to align them), scales, consts, part."""
    nunits = k // unit
    return (np.empty(nunits * unit * TILE_ROWS + 64, np.uint8), np.empty(nunits * TILE_ROWS, np.float32),
            np.empty(nunits * TILE_ROWS, np.float32), np.empty((n_pad, TILE_ROWS), np.float32))


@njit(nogil=True, cache=True)
def gemm_q8_rows(isa, fmt, unit, raw2d, r0, r1, xq, xdu, xsu, n, out, codes, scales, consts, part):
    """``out[:n, r0:r1]`` for weight rows r0..r1-1 on the calling thread (GIL released), 16 rows at a time, in
    the instruction set of ``isa``'s type (``isa.token``: 512-bit tiles for AVX-512 VNNI, else 256-bit).

    ``xq`` (n_pad, k) int8 with n_pad a multiple of ``TOKENS`` (zero rows past n); ``xdu``/``xsu`` (n_pad, k/unit).
    Scratch from the caller (``gemm_scratch``): the kernel allocates nothing, so loading it from numba's cache
    does not import numba's array-allocation module (~20-40 ms of a cold start)."""
    k = xq.shape[1]
    nunits = k // unit
    off = (-codes.ctypes.data) % 64  # 64-byte aligned tile: one cache line per vpdpbusd operand
    codes = codes[off : off + nunits * unit * TILE_ROWS]
    for a in range(r0, r1, TILE_ROWS):
        rows = min(TILE_ROWS, r1 - a)
        if rows < TILE_ROWS:  # unused lanes: zero codes and scales
            codes[:] = 0
            scales[:] = 0
            consts[:] = 0
        _pack(fmt, raw2d, a, rows, codes, scales, consts)
        dst, col = (out, a) if rows == TILE_ROWS else (part, 0)
        if unit == 32:
            gemm_tile_u32(isa, codes, scales, consts, xq, xdu, xsu, n, dst, col)
        else:
            gemm_tile_u16(isa, codes, scales, consts, xq, xdu, xsu, n, dst, col)
        if rows < TILE_ROWS:
            for t in range(n):
                for r in range(rows):
                    out[t, a + r] = part[t, r]


@njit(nogil=True, cache=True)
def quantize_activations(x, xq, unit, xdu, xsu, xd, xsum, xqsum):
    """q8 activations ``xq`` (per-32 scales, ``activations.quantize_q8_32``) with the per-unit scale ``xdu`` and
    the unit's sum of the quantized activations ``xsu = xd * sum(xq)`` (as the GEMV). Runs on the calling
    thread (GIL released): the caller splits the activation rows. ``xd``/``xsum``/``xqsum`` (n, k/32): scratch."""
    n, k = x.shape
    nb = k // 32
    quantize_q8_32(x, xq, xd, xsum, xqsum)
    for t in range(n):
        for i in range(nb):
            if unit == 32:
                xdu[t, i] = xd[t, i]
                xsu[t, i] = xsum[t, i]
            else:
                for h in range(2):
                    s = np.int32(0)
                    for j in range(32 * i + 16 * h, 32 * i + 16 * h + 16):
                        s += np.int32(xq[t, j])
                    xdu[t, 2 * i + h] = xd[t, i]
                    xsu[t, 2 * i + h] = xd[t, i] * s
