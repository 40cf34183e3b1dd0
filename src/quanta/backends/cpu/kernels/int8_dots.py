"""The u8 x s8 integer dot products of the fast-mode kernels, in each instruction set of ``isa.py``.

``vpdpbusd`` (VNNI): u8 x s8, four products summed into each i32 lane, added to an accumulator. AVX2:
``vpmaddubsw`` (pairs of products into saturating i16) then ``vpmaddwd`` by ones (pairs of i16 into i32). The
codes ``u`` are the weights' unsigned codes, the ``x`` int8 activations in [-127, 127]. ``dot_scaled``: the pair
sums weighted by i16 scales before they are added (``vpmaddubsw``, then ``vpdpwssd`` or ``vpmaddwd``), as
llama.cpp's K-quant dots apply their sub-block scales.
"""

from __future__ import annotations

from llvmlite import ir

from quanta.backends.cpu.kernels.simd import I8, I16, I32, call, const_vec, vec

_V8 = vec(I32, 8)


def _pairs(builder, u, x):  # AVX2: u*x summed in pairs, <16 x i16> (saturating)
    return call(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), u, x)


def _quads(builder, pairs):  # AVX2: i16 pairs summed into <8 x i32>
    return call(builder, "llvm.x86.avx2.pmadd.wd", _V8, pairs, const_vec(I16, [1] * 16))


def dot_u8s8(isa: str, builder, u, x, start=None):
    """``start`` (<8 x i32>, default 0) plus the sums of four products ``u * x`` per i32 lane of two <32 x i8>
    (u unsigned; with AVX2 each pair must fit an i16: u <= 128 for any x, as all codes but Q8_0's +128 ones are)."""
    if isa in ("avx512_vnni", "avx_vnni"):
        return call(builder, "llvm.x86.avx512.vpdpbusd.256", _V8, ir.Constant(_V8, [0] * 8) if start is None else start,
                    builder.bitcast(u, _V8), builder.bitcast(x, _V8))
    if isa == "portable":  # widen, multiply, add each lane's four products
        p = builder.mul(builder.zext(u, vec(I32, 32)), builder.sext(x, vec(I32, 32)))
        quarters = [builder.shuffle_vector(p, p, const_vec(I32, range(j, 32, 4))) for j in range(4)]
        s = builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3]))
    else:
        s = _quads(builder, _pairs(builder, u, x))
    return s if start is None else builder.add(start, s)


def madd_i16(isa: str, builder, a, b):
    """<8 x i32>: ``a[2l] * b[2l] + a[2l+1] * b[2l+1]`` of two <16 x i16> (``vpmaddwd``)."""
    if isa == "portable":
        p = builder.mul(builder.sext(a, vec(I32, 16)), builder.sext(b, vec(I32, 16)))
        return builder.add(*(builder.shuffle_vector(p, p, const_vec(I32, range(j, 16, 2))) for j in (0, 1)))
    return call(builder, "llvm.x86.avx2.pmadd.wd", _V8, a, b)


def dot_scaled(isa: str, builder, acc, u, x, scales):
    """``acc`` (<8 x i32>) plus, per i32 lane l, ``p[2l] * scales[2l] + p[2l+1] * scales[2l+1]`` where ``p``
    (<16 x i16>) holds the pair sums ``u[2i] * x[2i] + u[2i+1] * x[2i+1]`` of two <32 x i8> (u unsigned, every pair
    sum within an i16: u <= 63 for any x)."""
    if isa == "portable":
        p = builder.mul(builder.zext(u, vec(I32, 32)), builder.sext(x, vec(I32, 32)))
        p = builder.trunc(builder.add(*(builder.shuffle_vector(p, p, const_vec(I32, range(j, 32, 2))) for j in (0, 1))),
                          vec(I16, 16))
        return builder.add(acc, madd_i16(isa, builder, p, scales))
    p = _pairs(builder, u, x)
    if isa == "avx2":
        return builder.add(acc, call(builder, "llvm.x86.avx2.pmadd.wd", _V8, p, scales))
    return call(builder, "llvm.x86.avx512.vpdpwssd.256", _V8, acc, builder.bitcast(p, _V8), builder.bitcast(scales, _V8))


def dot_s8s8(isa: str, builder, q, x, start=None):
    """``dot_u8s8`` for signed codes ``q``: ``|q|`` against ``x`` with q's sign (``vpsignb``), llama.cpp's trick."""
    magnitude = call(builder, "llvm.abs.v32i8", vec(I8, 32), q, ir.Constant(ir.IntType(1), 0))
    return dot_u8s8(isa, builder, magnitude, call(builder, "llvm.x86.avx2.psign.b", vec(I8, 32), x, q), start)


def dot2_u8s8(isa: str, builder, a, xa, b, xb, start=None, small: bool = False):
    """``dot_u8s8(a, xa) + dot_u8s8(b, xb)`` (+ ``start``), each i32 lane summing the same lanes of both. ``small``
    (codes <= 63): with AVX2 the two i16 pair sums are added before widening (|sum| <= 2 * 2 * 63 * 127 < 2^15)."""
    if isa == "avx2" and small:
        s = _quads(builder, builder.add(_pairs(builder, a, xa), _pairs(builder, b, xb)))
        return s if start is None else builder.add(start, s)
    return dot_u8s8(isa, builder, b, xb, dot_u8s8(isa, builder, a, xa, start))
