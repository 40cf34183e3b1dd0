"""Decode batches (past the int8 GEMV's rows, up to qmatmul's ``MMQ_MAX_ROWS``; fast mode): int8 tensor-core
products of the weight codes with the int8 activations (llama.cpp's MMQ design), the weight read once for every
row.

The int8 GEMV (q8gemv.py) streams the weight once per activation row; the split-K GEMM (gemm.py) reads it once but
turns every code into a bf16 operand first. Here a K step is one 32-weight chunk: its codes become an int8 [BN, 32]
tile in the byte order of the int8 activations (``Q8Activation``: byte ``4j + b`` of a chunk holds element
``8b + j``), a tensor-core dot with the activations' [BM, 32] int8 tile gives each (weight row, activation row) its
exact integer sum, and the chunk's scales apply to that sum as in the int8 GEMV:

    y[r, m] += dx[m, c] * (d*sc[r, g] * (sum_g q·xq - QOFF sum_g xq) - dmin*mn[r, g] * sum_g xq)

Code bytes (repack.py's layout): a 4-bit chunk's 16 bytes hold, in byte ``4w + b``, weight ``8b + w`` (low nibble)
and ``8b + 4 + w`` (high nibble): activation bytes ``4w + b`` and ``16 + 4w + b``. 5- and 6-bit codes take their
high bits from the ``qh`` words (codes.py's layout) by a shift per byte position; 8-bit codes (stored ``q + 128``)
are their bytes with the top bit flipped. Groups of 16 (Q6_K, Q3_K, Q2_K) are activation bytes with ``b < 2``
(weights 0..15 of the chunk) and the rest: two dots per chunk against the activations masked to each group.

The grid splits K (``k_splits`` as the GEMM's) while the output tiles fill few waves of the multiprocessors; the
partials are summed in order by gemm.py's second kernel (deterministic). Tested under TRITON_INTERPRET=1 against
gguf-py's dequantization and a numpy quantization of x (tests/backends/cuda/test_mmq.py).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl
from quanta.backends.cuda.dense_gemm import _sms
from quanta.backends.cuda.gemm import _sum_splits_kernel
from quanta.backends.cuda.qmatmul import _epilogue, _meta, _planes
from quanta.backends.cuda.repack import PackedWeight

# tiles per activation-row class: BM activation rows x BN weight rows per program, CH chunks of 32 weights per K
# step (one batched dot of CH products)
MMQ_TILES = {
    "tiny": {"BM": 16, "BN": 64, "CH": 8, "num_warps": 4, "num_stages": 2},
    "small": {"BM": 32, "BN": 64, "CH": 8, "num_warps": 4, "num_stages": 2},
    "medium": {"BM": 64, "BN": 64, "CH": 8, "num_warps": 4, "num_stages": 2},
}
SPLIT_WAVES = 4  # K is split while the output tiles fill fewer waves of the multiprocessors than this
MIN_SPLIT_CHUNKS = 16  # chunks (of 32 weights) per split at least


def row_class(m: int) -> str:
    return "tiny" if m <= 16 else "small" if m <= 32 else "medium"


@triton.jit
def _codes(q_ptr, qh_ptr, wrows, c, QS, QHS, BITS: tl.constexpr, HB: tl.constexpr):
    """Chunks ``c`` ([CH], valid) of weight rows ``wrows`` ([BN], valid) as an int8 [CH, BN, 32] tile of codes in
    the activations' byte order (QS: bytes per row of the code plane, QHS: words per row of the high-bit plane)."""
    BN: tl.constexpr = wrows.shape[0]
    CH: tl.constexpr = c.shape[0]
    base = wrows[None, :, None] * QS
    if BITS == 8:
        t = tl.load(q_ptr + base + c[:, None, None] * 32 + tl.arange(0, 32)[None, None, :]) ^ 0x80  # signed bits
    else:
        b = tl.load(q_ptr + base + c[:, None, None] * 16 + tl.arange(0, 16)[None, None, :])
        lo = b & 0x0F  # byte 4w + b: weight 8b + w, activation byte 4w + b
        hi = b >> 4  # weight 8b + 4 + w, activation byte 16 + 4w + b
        if HB > 0:
            p = tl.arange(0, 16)[None, None, :]
            at = 8 * (p % 4) + HB * (p // 4)  # the bit of weight 8b + w in its high-bit word
            hmask: tl.constexpr = (1 << HB) - 1
            hp = qh_ptr + wrows[None, :] * QHS + c[:, None] * HB
            if HB == 2:  # weight 8b + j: word j // 4, bits 8b + 2(j % 4)
                h0 = tl.load(hp)[:, :, None]
                h1 = tl.load(hp + 1)[:, :, None]
                hl = (h0 >> at) & hmask
                hh = (h1 >> at) & hmask
            else:  # one word: bit 8b + j
                h = tl.load(hp)[:, :, None]
                hl = (h >> at) & hmask
                hh = (h >> (at + 4)) & hmask
            lo = lo | (hl << 4).to(tl.uint8)
            hi = hi | (hh << 4).to(tl.uint8)
        t = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), [CH, BN, 32])
    return t.to(tl.int8, bitcast=True)


@triton.jit
def _weight_scales(d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, g, K, G: tl.constexpr, SB: tl.constexpr,
                   HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr):
    """Scale ``d*sc`` and min ``dmin*mn`` of groups ``g`` ([CH]) of ``wrows`` ([BN]): two [CH, BN, 1] tiles."""
    gi = wrows[None, :] * (K // G) + g[:, None]
    sbi = wrows[None, :] * (K // SB) + (g // (SB // G))[:, None]
    scale = tl.load(d_ptr + sbi).to(tl.float32)
    if HAS_SC:
        scale = scale * tl.load(sc_ptr + gi).to(tl.float32)
    mn = tl.zeros_like(scale)
    if HAS_MIN:
        mn = tl.load(dmin_ptr + sbi).to(tl.float32)
        if HAS_MN:
            mn = mn * tl.load(mn_ptr + gi).to(tl.float32)
    return scale[:, :, None], mn[:, :, None]


@triton.jit
def _group(w, x, dx, s, mn, QOFF: tl.constexpr, HAS_MIN: tl.constexpr):
    """One group per chunk, scaled: weights ``w`` (int8 [CH, BN, 32]) against activations ``x`` (int8 [CH, BM, 32],
    zero outside the group) with activation scales ``dx`` [CH, 1, BM], weight scales ``s`` and mins ``mn``
    [CH, BN, 1]; summed over the chunks: [BN, BM]."""
    xs = tl.sum(x.to(tl.int32), axis=2)[:, None, :]
    r = tl.dot(w, tl.permute(x, (0, 2, 1)), out_dtype=tl.int32)
    if QOFF != 0:
        r = r - QOFF * xs
    y = s * (r.to(tl.float32) * dx)
    if HAS_MIN:
        y -= mn * (xs.to(tl.float32) * dx)
    return tl.sum(y, axis=0)


@triton.jit
def _step(q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, c, K, QS, QHS, BITS: tl.constexpr,
          HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr,
          HAS_MN: tl.constexpr):
    """The weight reads of one K step (chunks ``c``): codes, and the scales and mins of the low (weights 0..15)
    and high (16..31) groups of each chunk (the same tiles twice when G == 32)."""
    w = _codes(q_ptr, qh_ptr, wrows, c, QS, QHS, BITS, HB)
    if G == 32:
        s0, m0 = _weight_scales(d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, c, K, G, SB, HAS_SC, HAS_MIN, HAS_MN)
        s1, m1 = s0, m0
    else:
        s0, m0 = _weight_scales(d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, 2 * c, K, G, SB, HAS_SC, HAS_MIN, HAS_MN)
        s1, m1 = _weight_scales(d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, 2 * c + 1, K, G, SB, HAS_SC, HAS_MIN,
                                HAS_MN)
    return w, s0, m0, s1, m1


@triton.jit
def _chunks(acc, w, s0, m0, s1, m1, xq_ptr, xd_ptr, xrows, c, valid, K, G: tl.constexpr, QOFF: tl.constexpr,
            HAS_MIN: tl.constexpr):
    """acc [BN, BM] += chunks ``c`` ([CH]; ``valid``: those inside the program's K range, the rest count 0):
    codes ``w`` and their groups' scales against the int8 activations of rows ``xrows``."""
    x = tl.load(xq_ptr + xrows[None, :, None] * K + c[:, None, None] * 32 + tl.arange(0, 32)[None, None, :])
    dx = tl.load(xd_ptr + xrows[None, :] * (K // 32) + c[:, None])
    dx = tl.where(valid[:, None], dx, 0.0)[:, None, :]
    if G == 32:
        acc += _group(w, x, dx, s0, m0, QOFF, HAS_MIN)
    else:
        first = (tl.arange(0, 32) % 4 < 2)[None, None, :]  # bytes 0-1 of each word: weights 0..15
        zero = tl.zeros_like(x)
        acc += _group(w, tl.where(first, x, zero), dx, s0, m0, QOFF, HAS_MIN)
        acc += _group(w, tl.where(first, zero, x), dx, s1, m1, QOFF, HAS_MIN)
    return acc


@triton.jit(do_not_specialize=["M"])  # one compile for every batch size
def _mmq_kernel(xq_ptr, xd_ptr, q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, res_ptr, b_ptr, y_ptr, y1_ptr,
                y2_ptr, M, N, N1, N2, K, QS, QHS, stride_y, part_ptr, KSPLIT,
                BITS: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, HAS_RES: tl.constexpr,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                CH: tl.constexpr, PARTIAL: tl.constexpr, PDL: tl.constexpr):
    """One program: the [BN, BM] output tile (weight rows × activation rows) of chunks [KSPLIT * z, KSPLIT * (z +
    1)) (z the grid's third index), CH chunks per K step. Rows past M or N are clamped (modulo), the stores masked;
    chunks past the range are read wrapped and count zero. The first step's codes and scales are loaded before
    waiting for the kernel that writes x (PDL). PARTIAL: the tile goes to the (z, M, N) float32 partials for
    gemm.py's ``_sum_splits_kernel``."""
    pdl.allow_next(PDL)
    OFF: tl.constexpr = 0 if BITS == 8 else QOFF  # 8-bit codes are read as signed values
    NC = K // 32
    c_lo = tl.program_id(2) * KSPLIT
    c_hi = tl.minimum(NC, c_lo + KSPLIT)
    xrows = (tl.program_id(0) * BM + tl.arange(0, BM)) % M
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    wrows = rows % N
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    c = c_lo + tl.arange(0, CH)
    w, s0, m0, s1, m1 = _step(q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, c % NC, K, QS, QHS, BITS, HB,
                              G, SB, HAS_SC, HAS_MIN, HAS_MN)
    pdl.wait_prev(PDL)
    acc = _chunks(acc, w, s0, m0, s1, m1, xq_ptr, xd_ptr, xrows, c % NC, c < c_hi, K, G, OFF, HAS_MIN)
    for c0 in range(c_lo + CH, c_hi, CH):
        c = c0 + tl.arange(0, CH)
        w, s0, m0, s1, m1 = _step(q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, c % NC, K, QS, QHS, BITS,
                                  HB, G, SB, HAS_SC, HAS_MIN, HAS_MN)
        acc = _chunks(acc, w, s0, m0, s1, m1, xq_ptr, xd_ptr, xrows, c % NC, c < c_hi, K, G, OFF, HAS_MIN)
    mr = (tl.program_id(0) * BM + tl.arange(0, BM))[None, :]
    nr = rows[:, None]
    mask = (mr < M) & (nr < N)
    if PARTIAL:
        tl.store(part_ptr + (tl.program_id(2) * M + mr) * N + nr, acc, mask=mask)
    else:
        _epilogue(acc, mr, nr, mask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y, HAS_BIAS, HAS_RES,
                  SPLIT)


def k_splits(m: int, n: int, k: int, cfg: dict, sms: int, waves: int = SPLIT_WAVES) -> tuple[int, int]:
    """(splits, chunks per split): K is split while the output tiles fill fewer than ``waves`` waves of the
    multiprocessors, each split at least MIN_SPLIT_CHUNKS chunks and a whole number of K steps."""
    chunks = k // 32
    tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    want = max(1, min(triton.cdiv(waves * sms, tiles), chunks // MIN_SPLIT_CHUNKS))
    per = triton.cdiv(triton.cdiv(chunks, want), cfg["CH"]) * cfg["CH"]
    return triton.cdiv(chunks, per), per


def mmq(xq: Any, w: PackedWeight, ep: Any, pdl_on: bool = False, tiles: dict | None = None,
        waves: int = SPLIT_WAVES) -> None:
    """``x @ W.T`` through qmatmul's epilogue ``ep``, x given as its int8 copy ``xq`` (a ``Q8Activation`` of (m, k)).
    ``tiles``: launch parameters to use instead of MMQ_TILES'; ``waves``: the split-K target."""
    m, k = xq.q.shape
    cfg = tiles or MMQ_TILES[row_class(m)]
    q, qh, *scales = _planes(w)
    if w.high_bits:
        qh = qh.view(torch.int32)
    splits, per = k_splits(m, w.n, k, cfg, _sms(xq.q.device), waves)
    part = torch.empty((splits, m, w.n), dtype=torch.float32, device=q.device) if splits > 1 else ep.out
    meta = _meta(w)
    del meta["KIND"]
    grid = (triton.cdiv(m, cfg["BM"]), triton.cdiv(w.n, cfg["BN"]), splits)
    _mmq_kernel[grid](xq.q, xq.d, q, qh, *scales, *ep.args(), m, w.n, *ep.bounds, k, q.stride(0), qh.stride(0),
                      ep.out.stride(0), part, per, BITS=4 if w.kind == "q4" else 8, BM=cfg["BM"], BN=cfg["BN"],
                      CH=cfg["CH"], PARTIAL=splits > 1, num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"], **ep.flags(), **meta, **pdl.launch(pdl_on))
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * w.n, block),)](part, *ep.args(), m, w.n, *ep.bounds, ep.out.stride(0),
                                                           splits, BLOCK=block, num_warps=4, **ep.flags())
