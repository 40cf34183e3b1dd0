"""Embedding lookup on the device: rows ``token_ids`` of a packed quantized matrix, dequantized to float32.

A row's chunks are gathered as "low" (weights 0..15) and "high" (16..31) halves, [1, chunks, 16] tiles; one
program per (token, 32·BC weights). Tested against gguf-py's dequantize of the same rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl

from quanta.backends.cuda.qmatmul import _group_scale, _meta, _planes
from quanta.backends.cuda.repack import PackedWeight


@triton.jit
def _byte_to_f32(v):
    """An int32 in [0, 255] as float32, exactly, without the slow integer→float conversion (1/4 rate on Hopper):
    the bits 0x4B000000 | v are the float 2^23 + v."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _high_bits(qh_ptr, rows, kc, kj, QHS, mask, HB: tl.constexpr, MASKED: tl.constexpr):
    """The high bits of weights ``kj`` ([1, 16]) of chunks ``kc`` ([C, 1]), times 16 ([R, C, 16] int32; codes.py):
    weight 8b + j is in byte b of word j // F, at bit HB * (j % F), F = 8 // HB."""
    F: tl.constexpr = 8 // HB
    j = kj % 8
    p = qh_ptr + rows[:, None, None] * QHS + (kc * (4 * HB) + 4 * (j // F) + kj // 8)[None, :, :]
    if MASKED:
        h = tl.load(p, mask=mask, other=0)
    else:
        h = tl.load(p)
    return ((h.to(tl.int32) >> (HB * (j % F))[None, :, :]) & ((1 << HB) - 1)) << 4


@triton.jit
def _load_halves(q_ptr, qh_ptr, rows, rmask, kc, kj, QS, QHS, kmask, KIND: tl.constexpr, HB: tl.constexpr,
                 MASKED: tl.constexpr):
    """Unsigned codes of the low and high half of each chunk in weight order: two [R, C, 16] float32 tiles
    (QS, QHS: the code planes' row strides in bytes, kc: [C, 1] chunk indices, kj: [1, 16])."""
    if KIND == 0:  # weight 4s + w: byte 4w + s//2, nibble s % 2
        lo_ptr = q_ptr + rows[:, None, None] * QS + (kc * 16 + 4 * (kj % 4) + kj // 8)[None, :, :]
        hi_ptr = lo_ptr + 2
        shift = (4 * ((kj // 4) % 2))[None, :, :]
    elif KIND == 1:  # weight 8s + w: byte 4w + s
        lo_ptr = q_ptr + rows[:, None, None] * QS + (kc * 32 + 4 * (kj % 8) + kj // 8)[None, :, :]
        hi_ptr = lo_ptr + 2
    else:  # dense floats
        lo_ptr = q_ptr + rows[:, None, None] * QS + (kc * 32 + kj)[None, :, :]
        hi_ptr = lo_ptr + 16
    mask = rmask[:, None, None] & kmask[None, :, :]
    if MASKED:
        a = tl.load(lo_ptr, mask=mask, other=0)
        b = tl.load(hi_ptr, mask=mask, other=0)
    else:
        a = tl.load(lo_ptr)
        b = tl.load(hi_ptr)
    if KIND == 0:
        a = (a.to(tl.int32) >> shift) & 15
        b = (b.to(tl.int32) >> shift) & 15
        if HB > 0:
            a = a | _high_bits(qh_ptr, rows, kc, kj, QHS, mask, HB, MASKED)
            b = b | _high_bits(qh_ptr, rows, kc, kj + 16, QHS, mask, HB, MASKED)
        lo = _byte_to_f32(a)
        hi = _byte_to_f32(b)
    elif KIND == 1:
        lo = _byte_to_f32(a.to(tl.int32))
        hi = _byte_to_f32(b.to(tl.int32))
    else:
        lo = a.to(tl.float32)
        hi = b.to(tl.float32)
    return lo, hi


@triton.jit
def _dequant_halves(q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, cg, kj, K, QS, QHS,
                    KIND: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                    HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, MASKED: tl.constexpr):
    """Dequantized weights of the low and high chunk halves: two [R, C, 16] float32 tiles."""
    kc = cg[:, None]
    cmask = cg < K // 32
    lo, hi = _load_halves(q_ptr, qh_ptr, rows, rmask, kc, kj, QS, QHS,
                          tl.broadcast_to(kc < K // 32, (kc.shape[0], 16)), KIND, HB, MASKED)
    if KIND != 2:
        NG = K // G
        NSB = K // SB
        if G == 32:
            s, mn = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, cg, cmask, NG, NSB,
                                 G, SB, HAS_SC, HAS_MIN, HAS_MN)
            lo = (lo - QOFF) * s[:, :, None] - mn[:, :, None]
            hi = (hi - QOFF) * s[:, :, None] - mn[:, :, None]
        else:
            s0, m0 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, 2 * cg, cmask, NG, NSB,
                                  G, SB, HAS_SC, HAS_MIN, HAS_MN)
            s1, m1 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, 2 * cg + 1, cmask, NG, NSB,
                                  G, SB, HAS_SC, HAS_MIN, HAS_MN)
            lo = (lo - QOFF) * s0[:, :, None] - m0[:, :, None]
            hi = (hi - QOFF) * s1[:, :, None] - m1[:, :, None]
    return lo, hi



@triton.jit
def _embed_kernel(ids_ptr, q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, y_ptr, K, QS, QHS,
                  KIND: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                  HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, BC: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    t = tl.program_id(0)
    c0 = tl.program_id(1) * BC
    row = tl.load(ids_ptr + t).to(tl.int64)
    rows = row + tl.arange(0, 1)
    cg = c0 + tl.arange(0, BC)
    kj = tl.arange(0, 16)[None, :]
    lo, hi = _dequant_halves(q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rows >= 0, cg, kj, K, QS, QHS,
                             KIND, HB, G, SB, QOFF, HAS_SC, HAS_MIN, HAS_MN, True)
    offs = cg[:, None] * 32 + kj
    mask = (cg[:, None] < K // 32) & (kj < 16)
    tl.store(y_ptr + t * K + offs, tl.reshape(lo, (BC, 16)), mask=mask)
    tl.store(y_ptr + t * K + offs + 16, tl.reshape(hi, (BC, 16)), mask=mask)


def embed(w: PackedWeight, token_ids: torch.Tensor, out: torch.Tensor | None = None,
          pdl_on: bool = False) -> torch.Tensor:
    """(n,) int32 device ids → (n, k) float32 rows of ``w``."""
    n = token_ids.numel()
    if out is None:
        out = torch.empty((n, w.k), dtype=torch.float32, device=token_ids.device)
    bc = 8
    q, qh, *scales = _planes(w)
    _embed_kernel[(n, triton.cdiv(w.k // 32, bc))](token_ids, q, qh, *scales, out, w.k, q.stride(0), qh.stride(0),
                                                       BC=bc, **_meta(w), **pdl.launch(pdl_on))
    return out
