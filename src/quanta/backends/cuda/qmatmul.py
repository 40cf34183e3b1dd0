"""``y = x @ W.T (+ residual)`` on a packed quantized weight: a fused-dequant GEMV for few rows (decode) and a
fused-dequant GEMM through ``tl.dot`` for many rows (prefill).

Layout (see repack.py): a row of W is read as chunks of 32 weights; chunk ``j`` is 16 bytes of 4-bit codes
(low nibble = weight ``32j + i``, high nibble = ``32j + 16 + i``), or two runs of 16 signed bytes (8-bit codes),
or two runs of 16 floats (dense). The GEMM and the embedding see tiles ``[rows, chunks, 16]`` for the "low" and
the "high" half of each chunk; the GEMV cuts each chunk into quads of 4 bytes (see _gemv_kernel). Group scales
apply per chunk (G = 32) or per half chunk (G = 16):

    y[r] = sum_g  d*sc * (sum_{c in g} q_c x_c  -  QOFF * sum_{c in g} x_c)  -  dmin*mn * sum_{c in g} x_c

Tested under TRITON_INTERPRET=1 against gguf-py's dequantize followed by a float64 matmul
(tests/backends/cuda/test_qmatmul.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda.repack import PackedWeight

_GEMV_MAX_ROWS = 4  # up to this many activation rows the weight is streamed once per row (decode)
# tile configs, chosen on the H200 by scripts/gpu_tune.py (docs/PERF_gpu.md)
GEMV_CONFIG = {"BN": 2, "BC": 8, "num_warps": 1}


@triton.jit
def _byte_to_f32(v):
    """An int32 in [0, 255] as float32, exactly, without the slow integer→float conversion (1/4 rate on Hopper):
    the bits 0x4B000000 | v are the float 2^23 + v."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _load_halves(q_ptr, rows, rmask, kc, kj, QS, kmask, KIND: tl.constexpr, MASKED: tl.constexpr):
    """Codes of the low and high half of each chunk: two [R, C, 16] float32 tiles (QS: the code row stride).

    Unmasked loads (MASKED=False: the tile lies inside the matrix) let each thread read 16 contiguous bytes."""
    if KIND == 0:  # 4-bit: (n, k/2) bytes
        lo_ptr = q_ptr + rows[:, None, None] * QS + (kc * 16 + kj)[None, :, :]
        hi_ptr = lo_ptr
    else:  # 8-bit codes or dense floats: (n, k)
        lo_ptr = q_ptr + rows[:, None, None] * QS + (kc * 32 + kj)[None, :, :]
        hi_ptr = lo_ptr + 16
    if MASKED:
        m = rmask[:, None, None] & kmask[None, :, :]
        a = tl.load(lo_ptr, mask=m, other=0)
        b = tl.load(hi_ptr, mask=m, other=0)
    else:
        a = tl.load(lo_ptr)
        b = a
        if KIND != 0:
            b = tl.load(hi_ptr)
    if KIND == 0:
        a = a.to(tl.int32)
        lo = _byte_to_f32(a & 15)
        hi = _byte_to_f32(a >> 4)
    elif KIND == 1:
        lo = _byte_to_f32(a.to(tl.int32) + 128) - 128.0
        hi = _byte_to_f32(b.to(tl.int32) + 128) - 128.0
    else:
        lo = a.to(tl.float32)
        hi = b.to(tl.float32)
    return lo, hi


@triton.jit
def _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, g, gmask, NG, NSB,
                 G: tl.constexpr, SB: tl.constexpr, HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr,
                 HAS_MN: tl.constexpr):
    """Scale and min of groups ``g`` ([C]) for ``rows`` ([R]): two [R, C] float32 tiles."""
    m2 = rmask[:, None] & gmask[None, :]
    sbi = rows[:, None] * NSB + (g // (SB // G))[None, :]
    gi = rows[:, None] * NG + g[None, :]
    scale = tl.load(d_ptr + sbi, mask=m2, other=0).to(tl.float32)
    if HAS_SC:
        scale = scale * tl.load(sc_ptr + gi, mask=m2, other=0).to(tl.float32)
    mn = tl.zeros_like(scale)
    if HAS_MIN:
        mn = tl.load(dmin_ptr + sbi, mask=m2, other=0).to(tl.float32)
        if HAS_MN:
            mn = mn * tl.load(mn_ptr + gi, mask=m2, other=0).to(tl.float32)
    return scale, mn


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, res_ptr, y_ptr, N, K, QS, stride_x, stride_y,
                  KIND: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                  HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, HAS_RES: tl.constexpr,
                  BN: tl.constexpr, BC: tl.constexpr, MASKED: tl.constexpr):
    """One program: BN output features of one activation row; K walked in BC chunks of 32 weights, each seen as
    4 quads of 4 bytes (4-bit: 8 weights; 8-bit: 4 low + 4 high). Tiles are [BN, 4*BC, 4] so codes and x share
    one 4-wide register layout: Triton then needs no shared-memory shuffles inside the loop (a [.., 16] tile cost
    ~20 barriers per iteration). Code·x products are summed per quad, then scaled once per quad and group."""
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    BQ: tl.constexpr = 4 * BC
    qd = tl.arange(0, BQ)
    j = tl.arange(0, 4)
    NG = K // G
    NSB = K // SB
    acc = tl.zeros([BN, BQ], dtype=tl.float32)
    xrow = x_ptr + m * stride_x
    for q0 in range(0, K // 8, BQ):
        qq = q0 + qd
        c = qq // 4
        cmask = c < K // 32
        klo = (c * 32 + (qq % 4) * 4)[:, None] + j[None, :]  # [BQ, 4] weight index of the low half
        km = tl.broadcast_to(cmask[:, None], (BQ, 4))
        if MASKED:
            xlo = tl.load(xrow + klo, mask=km, other=0)
            xhi = tl.load(xrow + klo + 16, mask=km, other=0)
        else:
            xlo = tl.load(xrow + klo)
            xhi = tl.load(xrow + klo + 16)
        if KIND == 0:
            ptr_lo = q_ptr + rows[:, None, None] * QS + (qq * 4)[None, :, None] + j[None, None, :]
        else:
            ptr_lo = q_ptr + rows[:, None, None] * QS + klo[None, :, :]
        if MASKED:
            m3 = rmask[:, None, None] & km[None, :, :]
            a = tl.load(ptr_lo, mask=m3, other=0)
            b = a
            if KIND != 0:
                b = tl.load(ptr_lo + 16, mask=m3, other=0)
        else:
            a = tl.load(ptr_lo)
            b = a
            if KIND != 0:
                b = tl.load(ptr_lo + 16)
        if KIND == 0:
            a = a.to(tl.int32)
            lo = _byte_to_f32(a & 15)
            hi = _byte_to_f32(a >> 4)
        elif KIND == 1:
            lo = _byte_to_f32(a.to(tl.int32) + 128) - 128.0
            hi = _byte_to_f32(b.to(tl.int32) + 128) - 128.0
        else:
            lo = a.to(tl.float32)
            hi = b.to(tl.float32)
        slo = tl.sum(lo * xlo[None, :, :], axis=2)  # [BN, BQ]
        shi = tl.sum(hi * xhi[None, :, :], axis=2)
        if KIND == 2:
            acc += slo + shi
        else:
            xslo = tl.sum(xlo, axis=1)[None, :]
            xshi = tl.sum(xhi, axis=1)[None, :]
            if G == 32:
                s0, m0 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, c, cmask, NG, NSB,
                                      G, SB, HAS_SC, HAS_MIN, HAS_MN)
                xs = xslo + xshi
                acc += s0 * (slo + shi - QOFF * xs) - m0 * xs
            else:
                s0, m0 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, 2 * c, cmask, NG, NSB,
                                      G, SB, HAS_SC, HAS_MIN, HAS_MN)
                s1, m1 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, 2 * c + 1, cmask, NG, NSB,
                                      G, SB, HAS_SC, HAS_MIN, HAS_MN)
                acc += s0 * (slo - QOFF * xslo) - m0 * xslo + s1 * (shi - QOFF * xshi) - m1 * xshi
    y = tl.sum(acc, axis=1)
    if HAS_RES:
        y += tl.load(res_ptr + m * stride_y + rows, mask=rmask, other=0)
    tl.store(y_ptr + m * stride_y + rows, y, mask=rmask)


@triton.jit
def _dequant_halves(q_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, cg, kj, K, QS,
                    KIND: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                    HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, MASKED: tl.constexpr):
    """Dequantized weights of the low and high chunk halves: two [R, C, 16] float32 tiles."""
    kc = cg[:, None]
    cmask = cg < K // 32
    lo, hi = _load_halves(q_ptr, rows, rmask, kc, kj, QS, tl.broadcast_to(kc < K // 32, (kc.shape[0], 16)),
                          KIND, MASKED)
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
def _gemm_kernel(x_ptr, q_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, res_ptr, y_ptr, M, N, K, QS, stride_x, stride_y,
                 KIND: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                 HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, HAS_RES: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, PRECISION: tl.constexpr):
    """One program: a [BM, BN] output tile; weights dequantized per [BN, BC*32] tile, products on tensor cores
    (tf32: float32 range, since activations of some models overflow float16)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    mrows = pid_m * BM + tl.arange(0, BM)
    mmask = mrows < M
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    cj = tl.arange(0, BC)
    kj = tl.arange(0, 16)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for c0 in range(0, K // 32, BC):
        kc = (c0 + cj)[:, None]
        kmask = tl.broadcast_to(kc < K // 32, (BC, 16))
        xo = mrows[:, None, None] * stride_x + (kc * 32 + kj)[None, :, :]
        xm = mmask[:, None, None] & kmask[None, :, :]
        xlo = tl.reshape(tl.load(x_ptr + xo, mask=xm, other=0), (BM, BC * 16))
        xhi = tl.reshape(tl.load(x_ptr + xo + 16, mask=xm, other=0), (BM, BC * 16))
        lo, hi = _dequant_halves(q_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, c0 + cj, kj, K, QS,
                                 KIND, G, SB, QOFF, HAS_SC, HAS_MIN, HAS_MN, True)
        acc = tl.dot(xlo, tl.trans(tl.reshape(lo, (BN, BC * 16))), acc, input_precision=PRECISION)
        acc = tl.dot(xhi, tl.trans(tl.reshape(hi, (BN, BC * 16))), acc, input_precision=PRECISION)
    out = mrows[:, None] * stride_y + rows[None, :]
    omask = mmask[:, None] & rmask[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + out, mask=omask, other=0)
    tl.store(y_ptr + out, acc, mask=omask)


def _meta(w: PackedWeight) -> dict:
    kind = {"q4": 0, "q8": 1, "dense": 2}[w.kind]
    return dict(KIND=kind, G=w.group, SB=w.super_block, QOFF=w.qoff, HAS_SC=w.sc is not None,
                HAS_MIN=w.dmin is not None, HAS_MN=w.mn is not None)


def _planes(w: PackedWeight) -> tuple[torch.Tensor, ...]:
    """The five plane pointers; absent planes alias the code plane (never read: their flag is off)."""
    return tuple(p if p is not None else w.q for p in (w.q, w.d, w.sc, w.dmin, w.mn))


def qmatmul(x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, exact: bool = False) -> torch.Tensor:
    """``x @ W.T (+ residual)``: x (m, k) float32 contiguous rows → (m, n) float32 (written into ``out``).

    ``exact``: the prefill GEMM multiplies in IEEE fp32 instead of tf32."""
    m, k = x.shape
    assert k == w.k and x.stride(1) == 1, (x.shape, w.k)
    if out is None:
        out = torch.empty((m, w.n), dtype=torch.float32, device=x.device)
    res = residual if residual is not None else out
    assert res.stride(0) == out.stride(0)
    meta = _meta(w)
    if m <= _GEMV_MAX_ROWS:
        bn, bc = GEMV_CONFIG["BN"], GEMV_CONFIG["BC"]
        grid = (triton.cdiv(w.n, bn), m)
        _gemv_kernel[grid](x, *_planes(w), res, out, w.n, k, w.q.stride(0), x.stride(0), out.stride(0),
                           HAS_RES=residual is not None, BN=bn, BC=bc, MASKED=bool(k % (32 * bc) or w.n % bn),
                           num_warps=GEMV_CONFIG["num_warps"], **meta)
    else:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m < 256 else 128
        bn = 64
        grid = (triton.cdiv(m, bm), triton.cdiv(w.n, bn))
        _gemm_kernel[grid](x, *_planes(w), res, out, m, w.n, k, w.q.stride(0), x.stride(0), out.stride(0),
                           HAS_RES=residual is not None, BM=bm, BN=bn, BC=1, num_warps=8 if bm == 128 else 4,
                           num_stages=3, PRECISION="ieee" if exact else "tf32", **meta)
    return out
