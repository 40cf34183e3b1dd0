"""The fast-mode decode GEMV: int8 activations and ``dp4a`` (4 int8 products and a sum in one instruction).

The float GEMV (qmatmul.py) spends 4.5–7 instructions per weight turning codes into floats; on the H200 that is
more issue time than the weight stream takes (docs/PERF.md, GPU journal). Here the activations are quantized once
per row to int8 with a float scale per 32 (like llama.cpp's q8_1 and the CPU backend's fast mode), and the codes
are used as they are stored: a 4-bit word's low nibbles are ``word & 0x0F0F0F0F``, its high nibbles 16× of
``word & 0xF0F0F0F0`` (exact: ``dp4a`` of the latter is divided by 16 at the end), an 8-bit word is its 4 bytes.

Activation layout (``Q8Activation``): int8 ``q`` of (m, k) and float32 ``d`` of (m, k/32); within each chunk of 32,
byte ``4j + b`` holds element ``8b + j``, so int32 word ``j`` of the chunk pairs with the code layout of repack.py:
8-bit code word ``w`` (weights ``8s + w``) with x word ``w``; 4-bit code word ``w`` (weights ``4s + w``): its low
nibbles (weights ``8b + w``) with x word ``w``, its high nibbles (``8b + 4 + w``) with x word ``4 + w``. 5- and 6-bit
codes: the nibbles with their high bits moved in above them (codes.py), each byte a whole code, as 8-bit words.
Groups of 16 (Q6_K, Q3_K, Q2_K) are bytes 0–1 / 2–3 of every word: the x words are masked per group.

    y[r] = sum_g  dx * (d*sc * (sum_g q·xq - QOFF sum_g xq) - dmin*mn * sum_g xq)

Producers (rms_norm, the gated activations) write the int8 copy with ``store_q8`` next to their float output.
Under the Triton interpreter (CI) ``dp4a`` is emulated with shifts; tested against the float64 matmul of gguf-py's
dequantization and a numpy quantization of x (tests/backends/cuda/test_q8gemv.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl
from quanta.backends.cuda.codes import high_fields
from quanta.backends.cuda.qmatmul import (_gemv_epilogue, _gemv_program, _gemv_tile, _planes, gemv_grid, gemv_launch,
                                          tile_key)
from quanta.backends.cuda.repack import PackedWeight

# tiles per (code width, class) as in qmatmul.GEMV_CONFIG, chosen on the H200 by scripts/gpu_tune.py q8 (GPU journal,
# session 3 run 1) and in the decode loop (session 6, runs 45-48: "PRE", the K steps loaded before the wait, and
# the 4-bit "base", "head" and the "long" tiles); (8, "base") has no benchmark shape: a copy of (8, "small")
Q8_CONFIG = {
    (4, "small"): {"BN": 1, "BJ": 64, "num_warps": 2, "PRE": 2},
    (4, "base"): {"BN": 4, "BJ": 64, "num_warps": 1, "PRE": 2},
    (4, "long"): {"BN": 1, "BJ": 256, "num_warps": 4, "PRE": 2},
    (4, "head"): {"BN": 4, "BJ": 64, "num_warps": 1, "PRE": 2},
    (8, "small"): {"BN": 2, "BJ": 128, "num_warps": 4, "PRE": 2},
    (8, "base"): {"BN": 2, "BJ": 128, "num_warps": 4, "PRE": 2},
    (8, "long"): {"BN": 1, "BJ": 256, "num_warps": 4, "PRE": 2},
    (8, "head"): {"BN": 2, "BJ": 32, "num_warps": 1, "PRE": 2},
    # 4-bit codes with high bits (Q6_K, Q5_*): at first the 4-bit tiles (GPU run 97); "small" (k and v
    # projections) with an even BN, as the rope epilogue needs (CUDABackend.qkv_rope)
    (6, "small"): {"BN": 2, "BJ": 64, "num_warps": 2, "PRE": 2},
    (6, "base"): {"BN": 4, "BJ": 64, "num_warps": 1, "PRE": 2},
    (6, "long"): {"BN": 1, "BJ": 256, "num_warps": 4, "PRE": 2},
    (6, "head"): {"BN": 4, "BJ": 64, "num_warps": 1, "PRE": 2},
    # Llama-2-7B's Q4_K and Q6_K matrices of rows of 4096 (GPU run 226, each class's 16-32 launches in one graph):
    # 1.7-2.5 TB/s on the "long"/"head" tiles they had, 2.0-3.1 TB/s on these; Q8_0 not measured (its "base" tile)
    (4, "wide"): {"BN": 2, "BJ": 64, "num_warps": 1, "PRE": 2},
    (6, "wide"): {"BN": 2, "BJ": 64, "num_warps": 1, "PRE": 2},
    (8, "wide"): {"BN": 2, "BJ": 128, "num_warps": 4, "PRE": 2},
}


@dataclass
class Q8Activation:
    """int8 activations (m, k) in the dp4a chunk order of the module docstring and their scales (m, k/32)."""

    q: torch.Tensor
    d: torch.Tensor

    @classmethod
    def empty(cls, m: int, k: int, device: torch.device) -> Q8Activation:
        return cls(torch.empty((m, k), dtype=torch.int8, device=device),
                   torch.empty((m, k // 32), dtype=torch.float32, device=device))


@triton.jit
def round_codes(y2):
    """int8 codes of the chunks ``y2`` ([R, 32] float32; scale max|y| / 127, round half away from zero) in their
    order, and each chunk's max|y| ([R]). Also the int8 KV cache's (``kv_q8.py``)."""
    amax = tl.max(tl.abs(y2), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    t = y2 * inv[:, None]
    return tl.where(t >= 0, t + 0.5, t - 0.5).to(tl.int8), amax


@triton.jit
def _chunk_codes(y2):
    """int8 codes of the chunks ``y2`` ([R, 32] float32; round half away from zero) in the dp4a byte order, and
    their scales ([R])."""
    R: tl.constexpr = y2.shape[0]
    q, amax = round_codes(y2)
    # element 8b + j of a chunk goes to byte 4j + b: a transpose in registers
    return tl.reshape(tl.permute(tl.reshape(q, [R, 4, 8]), (0, 2, 1)), [R, 32]), amax / 127.0


@triton.jit
def store_q8(y, start, n_valid, q_ptr, d_ptr, BLOCK: tl.constexpr):
    """Quantize ``y`` ([BLOCK] float32: elements start .. start+BLOCK-1 of a flat (m, k) array, ``start`` a
    multiple of 32, the first ``n_valid`` real) to int8 with one scale per 32 (round half away from zero)."""
    q, d = _chunk_codes(tl.reshape(y, [BLOCK // 32, 32]))
    i = tl.arange(0, BLOCK)
    tl.store(q_ptr + start + i, tl.reshape(q, [BLOCK]), mask=i < n_valid)  # contiguous (vector) stores
    c = tl.arange(0, BLOCK // 32)
    tl.store(d_ptr + start // 32 + c, d, mask=c * 32 < n_valid)


@triton.jit
def store_q8_rows(y2, chunks, valid, q_ptr, d_ptr):
    """store_q8 of whole chunks: the rows of ``y2`` ([R, 32] float32) are chunks ``chunks`` ([R]) of the flat
    array (``valid``: the rows to store)."""
    q, d = _chunk_codes(y2)
    tl.store(q_ptr + chunks[:, None] * 32 + tl.arange(0, 32)[None, :], q, mask=valid[:, None])
    tl.store(d_ptr + chunks, d, mask=valid)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, d_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    start = tl.program_id(0) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
    store_q8(x, start, N - start, q_ptr, d_ptr, BLOCK)


def quantize(x: torch.Tensor, out: Q8Activation | None = None, pdl_on: bool = False) -> Q8Activation:
    """int8 copy of contiguous float32 rows ``x`` (m, k), k a multiple of 32."""
    m, k = x.shape
    assert x.is_contiguous() and k % 32 == 0, (x.shape, x.stride())
    out = out or Q8Activation.empty(m, k, x.device)
    block = 1024
    _quantize_kernel[(triton.cdiv(m * k, block),)](x, out.q, out.d, m * k, BLOCK=block, **pdl.launch(pdl_on))
    return out


@triton.jit
def _dp4a(a, b, c, EMULATE: tl.constexpr):
    """c + sum of the 4 products of a's unsigned bytes with b's signed bytes (int32 in, int32 out)."""
    if EMULATE:
        for i in tl.static_range(4):
            c += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _quads(t):
    """The four [R, C] slices t[:, :, w] of an [R, C, 4] tensor (each thread holds all four: no data moves)."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, a1, b0, b1


@triton.jit
def _chain(codes, xw, acc, EMULATE: tl.constexpr):
    """acc + sum over the 4 words of dp4a(codes [R, C, 4], x words [1, C, 4]): one dp4a per word."""
    c0, c1, c2, c3 = _quads(codes)
    x0, x1, x2, x3 = _quads(xw)
    acc = _dp4a(c0, x0, acc, EMULATE)
    acc = _dp4a(c1, x1, acc, EMULATE)
    acc = _dp4a(c2, x2, acc, EMULATE)
    return _dp4a(c3, x3, acc, EMULATE)


@triton.jit
def _q8_step(acc, words, hw, s0, m0, s1, m1, xq_ptr, xd_ptr, j, NU, BITS: tl.constexpr, HB: tl.constexpr,
             G: tl.constexpr, QOFF: tl.constexpr, HAS_MIN: tl.constexpr, MASKED: tl.constexpr,
             EMULATE: tl.constexpr):
    """acc [BN, BJ] += the scaled integer dot products of units ``j`` (and their high bits ``hw``) with the int8 x
    (int32 words at xq_ptr)."""
    UPC: tl.constexpr = BITS // 4
    LO: tl.constexpr = 0xFFFF  # bytes 0-1 of an x word: weights 0..15 of the chunk
    HI: tl.constexpr = -65536  # 0xFFFF0000: weights 16..31
    jmask = j < NU
    c = j // UPC
    kw = (c * 8 + (j % UPC) * 4)[:, None] + tl.arange(0, 4)[None, :]  # the unit's x words (4-bit: low nibbles')
    if MASKED:
        xa = tl.load(xq_ptr + kw, mask=jmask[:, None], other=0)[None, :, :]
        dx = tl.load(xd_ptr + c, mask=jmask, other=0.0)[None, :]
    else:
        xa = tl.load(xq_ptr + kw)[None, :, :]
        dx = tl.load(xd_ptr + c)[None, :]
    ones = tl.full(xa.shape, 0x01010101, tl.int32)
    zr = tl.zeros(words.shape[:2], tl.int32)
    zx = tl.zeros(dx.shape, tl.int32)
    if BITS == 4:
        if MASKED:
            xb = tl.load(xq_ptr + kw + 4, mask=jmask[:, None], other=0)[None, :, :]
        else:
            xb = tl.load(xq_ptr + kw + 4)[None, :, :]
        lo = words & 0x0F0F0F0F
        if HB > 0:  # whole 5- or 6-bit codes per byte: the nibbles and their high bits
            HMASK: tl.constexpr = ((1 << HB) - 1) * 0x01010101
            hws0, hws1 = high_fields(hw, HB)
            lo = lo | ((hws0 & HMASK) << 4)
            hi = ((words >> 4) & 0x0F0F0F0F) | ((hws1 & HMASK) << 4)
        else:
            hi = words & -252645136  # 0xF0F0F0F0: the high nibbles times 16
        UP: tl.constexpr = 0 if HB > 0 else 4  # hi's dot products are 16x too large without high bits
        if G == 16:
            d0 = _chain(lo, xa & LO, zr, EMULATE) + (_chain(hi, xb & LO, zr, EMULATE) >> UP)
            d1 = _chain(lo, xa & HI, zr, EMULATE) + (_chain(hi, xb & HI, zr, EMULATE) >> UP)
            x0 = _chain(ones, xb & LO, _chain(ones, xa & LO, zx, EMULATE), EMULATE)
            x1 = _chain(ones, xb & HI, _chain(ones, xa & HI, zx, EMULATE), EMULATE)
        else:
            d0 = _chain(lo, xa, zr, EMULATE) + (_chain(hi, xb, zr, EMULATE) >> UP)
            x0 = _chain(ones, xb, _chain(ones, xa, zx, EMULATE), EMULATE)
    else:
        if G == 16:
            d0 = _chain(words, xa & LO, zr, EMULATE)
            d1 = _chain(words, xa & HI, zr, EMULATE)
            x0 = _chain(ones, xa & LO, zx, EMULATE)
            x1 = _chain(ones, xa & HI, zx, EMULATE)
        else:
            d0 = _chain(words, xa, zr, EMULATE)
            x0 = _chain(ones, xa, zx, EMULATE)
    acc += s0 * (d0 - QOFF * x0).to(tl.float32) * dx
    if HAS_MIN:
        acc -= m0 * (x0.to(tl.float32) * dx)
    if G == 16:
        acc += s1 * (d1 - QOFF * x1).to(tl.float32) * dx
        if HAS_MIN:
            acc -= m1 * (x1.to(tl.float32) * dx)
    return acc


@triton.jit
def _gemv_q8_kernel(xq_ptr, xd_ptr, q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, res_ptr, b_ptr, y_ptr, y1_ptr,
                    y2_ptr, M, N, N1, N2, K, QW, QHW, stride_y, pos_ptr, slot_ptr, cos_ptr, sin_ptr, ROW0, HD, HALF,
                    NSLOTS,
                    BITS: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                    HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, HAS_RES: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ROPE: tl.constexpr, NEOX: tl.constexpr,
                    BN: tl.constexpr, BJ: tl.constexpr, MASKED: tl.constexpr, EMULATE: tl.constexpr,
                    PRE2: tl.constexpr, PDL: tl.constexpr, TILE_MAJOR: tl.constexpr):
    """One program: BN output features of one activation row (the float GEMV's tiling: [BN, BJ, 4] code words,
    the first K step (PRE2: the first two) loaded before waiting for the kernel that writes x; its output side,
    with ROPE too)."""
    UPC: tl.constexpr = BITS // 4
    m, rows, rmask, jj, NU, NG, NSB = _gemv_program(M, N, K, N2, ROW0, HD, HALF, UPC, G, SB, ROPE, NEOX, BN, BJ,
                                                    PDL, TILE_MAJOR)
    xq_row = xq_ptr + m * (K // 4)
    xd_row = xd_ptr + m * (K // 32)
    qrow = q_ptr + rows[:, None, None] * QW
    words, hw, s0, m0, s1, m1 = _gemv_tile(qrow, qh_ptr, QHW, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, jj, NU,
                                           NG, NSB, UPC, HB, G, SB, HAS_SC, HAS_MIN, HAS_MN, MASKED)
    if PRE2:  # the second K step too, before waiting
        words2, hw2, t0, n0, t1, n1 = _gemv_tile(qrow, qh_ptr, QHW, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask,
                                                 BJ + jj, NU, NG, NSB, UPC, HB, G, SB, HAS_SC, HAS_MIN, HAS_MN,
                                                 MASKED)
    pdl.wait_prev(PDL)
    acc = _q8_step(tl.zeros([BN, BJ], dtype=tl.float32), words, hw, s0, m0, s1, m1, xq_row, xd_row, jj, NU,
                   BITS, HB, G, QOFF, HAS_MIN, MASKED, EMULATE)
    if PRE2:
        acc = _q8_step(acc, words2, hw2, t0, n0, t1, n1, xq_row, xd_row, BJ + jj, NU, BITS, HB, G, QOFF, HAS_MIN,
                       MASKED, EMULATE)
    for j0 in range((1 + PRE2) * BJ, NU, BJ):
        j = j0 + jj
        words, hw, s0, m0, s1, m1 = _gemv_tile(qrow, qh_ptr, QHW, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, j,
                                               NU, NG, NSB, UPC, HB, G, SB, HAS_SC, HAS_MIN, HAS_MN, MASKED)
        acc = _q8_step(acc, words, hw, s0, m0, s1, m1, xq_row, xd_row, j, NU, BITS, HB, G, QOFF, HAS_MIN, MASKED,
                       EMULATE)
    _gemv_epilogue(tl.sum(acc, axis=1), m, rows, rmask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y,
                   pos_ptr, slot_ptr, cos_ptr, sin_ptr, ROW0, HD, HALF, NSLOTS, HAS_BIAS, HAS_RES, SPLIT, ROPE, NEOX,
                   BN)


def gemv_q8(xq: Q8Activation, w: PackedWeight, ep: Any, pdl_on: bool = False) -> None:
    """Launch the int8 GEMV of (m, k) activations ``xq`` against a quantized ``w`` with the output side ``ep``
    (qmatmul's epilogue)."""
    m, k = xq.q.shape
    bn, kw = gemv_launch(Q8_CONFIG, w, pdl_on)
    cfg = Q8_CONFIG[tile_key(w)]
    pre2 = cfg.get("PRE", 1) == 2 and w.k // 32 * (kw["BITS"] // 4) > kw["BJ"]  # "PRE": K steps before the wait
    words, qh, *scales = _planes(w, words=True)
    grid, order = gemv_grid(w, bn, m)
    _gemv_q8_kernel[grid](
        xq.q.view(torch.int32), xq.d, words, qh, *scales, *ep.args(), m, w.n, *ep.bounds, k, words.stride(0),
        qh.stride(0), ep.out.stride(0), *ep.gemv_args(), EMULATE=xq.q.device.type != "cuda", PRE2=pre2,
        **ep.gemv_flags(), **order, **kw)
