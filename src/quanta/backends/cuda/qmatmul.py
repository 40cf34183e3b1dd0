"""``y = x @ W.T (+ bias) (+ residual)`` on a packed quantized weight: a fused-dequant GEMV for few rows (decode); the
int8 GEMV of q8gemv.py (up to ``INT8_MAX_ROWS`` rows, the weight streamed once per row) on int8 activations; more
rows (decode batches and prefill) go to the tensor-core GEMM of gemm.py.

Layout (see repack.py): a row of W is read as chunks of 32 weights; chunk ``c`` is 4 (4-bit) or 8 (8-bit) 32-bit
words whose slot ``s`` of word ``w`` holds weight ``32c + NW*s + w`` (NW = words per chunk), or 32 floats (dense);
5- and 6-bit codes are 4-bit words plus 1 or 2 words of high bits per chunk (codes.py).
The GEMV gives each thread whole 16-byte units (a 4-bit chunk, half an 8-bit chunk): one vector load per row and
unit, and for each slot a contiguous 4-float slice of x, so the inner loop is one LOP3 (mask | exponent), one FADD
and one FFMA per weight (the code becomes a float by an exponent trick, see codes.slot_value, with the format's offset
folded into the FADD). The prefill GEMM (tensor cores) is gemm.py.
Group scales apply per chunk (G = 32) or per half chunk (G = 16):

    y[r] = sum_g  d*sc * sum_{c in g} (q_c - QOFF) x_c  -  dmin*mn * sum_{c in g} x_c

Split outputs: a weight fused from up to three matrices (Q|K|V, gate|up: rows stacked at load time, see
``fuse``) writes its column blocks to three separate contiguous outputs in the epilogue, so the model gets q, k
and v as its own arrays from one launch that reads x once.

Tested under TRITON_INTERPRET=1 against gguf-py's dequantize followed by a float64 matmul
(tests/backends/cuda/test_qmatmul.py).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl
from quanta.backends.cuda.codes import high_fields, high_words, slot_value
from quanta.backends.cuda.repack import PackedWeight
from quanta.backends.cuda.rope import RopeStore, gemv_rows, rope_store

GEMV_MAX_ROWS = 3  # up to this many activation rows the float GEMV streams the weight once per row
# up to this many rows the int8 GEMV, one pass over the weight per row: TinyLlama's decode matmuls of one step took
# 0.35 / 0.55 / 0.99 / 1.84 ms at 1 / 2 / 4 / 8 rows, the split-K tensor-core GEMM (gemm.py) 1.85-2.08 ms at any
# row count from 4 to 64, and a whole decode step of 8 sequences 2.09 ms through the GEMV against 1.78 ms for 16
# through the GEMM (GPU run 206)
INT8_MAX_ROWS = 6
# GEMV tiles (BN rows x BJ 16-byte units per program) per code width (6: 4-bit codes with high bits, see tile_key)
# and matrix class, chosen on the H200 by scripts/gpu_tune.py (docs/PERF.md, GPU journal, run 8); BJ shrinks to the
# row's unit count for short rows. (4, "head") and (8, "base") have no benchmark shape: copies of their neighbours;
# the float GEMV (exact mode) runs 5- and 6-bit codes on the 4-bit tiles.
GEMV_CONFIG = {
    (4, "small"): {"BN": 1, "BJ": 64, "num_warps": 2},
    (4, "base"): {"BN": 8, "BJ": 64, "num_warps": 4},
    (4, "long"): {"BN": 4, "BJ": 128, "num_warps": 4},
    (4, "head"): {"BN": 4, "BJ": 64, "num_warps": 2},
    (8, "small"): {"BN": 2, "BJ": 128, "num_warps": 4},
    (8, "base"): {"BN": 2, "BJ": 128, "num_warps": 4},
    (8, "long"): {"BN": 4, "BJ": 128, "num_warps": 4},
    (8, "head"): {"BN": 2, "BJ": 32, "num_warps": 1},
}
GEMV_CONFIG.update({(bits, "wide"): GEMV_CONFIG[(bits, "base")] for bits in (4, 8)})  # not tuned for exact mode
GEMV_CONFIG.update({(6, cls): GEMV_CONFIG[(4, cls)] for cls in ("base", "long", "head", "wide")})
GEMV_CONFIG[(6, "small")] = GEMV_CONFIG[(8, "small")]  # an even BN, as the rope epilogue needs (CUDABackend.qkv_rope)
TILE_MAJOR_BYTES = 16 << 20  # a GEMV's weight past this: its programs tiles outermost (gemv_grid)
WIDE_K = 4096  # rows of this length and more in a matrix at least as tall: the 7B class's projections


def gemv_class(n: int, k: int) -> str:
    """The tile class of an (n, k) matrix for the GEMV: a wide matrix (the Q/K/V, output, gate/up projections and
    lm head of a 7B-class model: k >= 4096, n >= k), an lm head, a long-row (down) projection, a small (k/v)
    projection, or the rest."""
    if k >= WIDE_K and n >= k:
        return "wide"
    return "head" if n >= 16384 else "long" if k >= 4096 else "small" if n < 1024 else "base"


@triton.jit
def _epilogue(y, m, rows, rmask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr):
    """Add the bias and the residual to output rows ``rows`` of activation row(s) ``m`` (a scalar and a vector, or
    a [BM, 1] column and a [1, BN] row), then store: into one (M, N) output, or (SPLIT) rows [0, N1) / [N1, N2) /
    [N2, N) into three contiguous outputs of those widths."""
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0)
    if HAS_RES:
        y += tl.load(res_ptr + m * stride_y + rows, mask=rmask, other=0)
    if SPLIT:
        tl.store(y_ptr + m * N1 + rows, y, mask=rmask & (rows < N1))
        tl.store(y1_ptr + m * (N2 - N1) + (rows - N1), y, mask=rmask & (rows >= N1) & (rows < N2))
        tl.store(y2_ptr + m * (N - N2) + (rows - N2), y, mask=rmask & (rows >= N2))
    else:
        tl.store(y_ptr + m * stride_y + rows, y, mask=rmask)


@triton.jit
def _gemv_epilogue(y, m, rows, rmask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y, pos_ptr, slot_ptr,
                   cos_ptr, sin_ptr, ROW0, HD, HALF, NSLOTS, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                   SPLIT: tl.constexpr, ROPE: tl.constexpr, NEOX: tl.constexpr, BN: tl.constexpr):
    """The GEMVs' output side for activation row ``m``: ``_epilogue``, or (ROPE) the bias, then rope and the KV
    store (rope.py; N1, N2: the Q and Q+K row counts, y_ptr/y1_ptr/y2_ptr: q and the K and V pools)."""
    if ROPE:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0)
        rope_store(y, m, rows, rmask, y_ptr, y1_ptr, y2_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, ROW0, N1, N2, HD,
                   HALF, NSLOTS, NEOX, BN)
    else:
        _epilogue(y, m, rows, rmask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y, HAS_BIAS, HAS_RES,
                  SPLIT)


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
def _gemv_program(M, N, K, N2, ROW0, HD, HALF, UPC: tl.constexpr, G: tl.constexpr, SB: tl.constexpr,
                  ROPE: tl.constexpr, NEOX: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr, PDL: tl.constexpr,
                  TILE_MAJOR: tl.constexpr):
    """The GEMVs' first lines: let the next kernel launch (PDL); then this program's activation row, its output
    rows and their mask, the unit offsets of a K step, and the units, groups and super-blocks per weight row."""
    pdl.allow_next(PDL)
    tile, m = _tile_and_row(M, TILE_MAJOR)
    rows = gemv_rows(tile, BN, ROW0, N2, HD, HALF, ROPE, NEOX)
    return m, rows, rows < N, tl.arange(0, BJ), K // 32 * UPC, K // G, K // SB


@triton.jit
def _tile_and_row(M, TILE_MAJOR: tl.constexpr):
    """A GEMV program's weight-row tile and activation row (of M), from the grid ``gemv_grid`` chose."""
    if TILE_MAJOR:
        pid = tl.program_id(0)
        return pid // M, pid % M
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _gemv_tile(qrow, qh_ptr, QHW, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, j, NU, NG, NSB, UPC: tl.constexpr,
               HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr,
               HAS_MN: tl.constexpr, MASKED: tl.constexpr):
    """The HBM reads of one K step: the [BN, BJ, 4] code words of units ``j``, their [BN, BJ, HB] high-bit words
    (HB > 0; else the code words again, unused), and the scales and mins of their low (weights 0..15) and high
    (16..31) groups ([BN, BJ] each; the same tiles twice when G == 32)."""
    jmask = j < NU
    c = j // UPC
    qp = qrow + (j * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
    if MASKED:
        words = tl.load(qp, mask=rmask[:, None, None] & jmask[None, :, None], other=0)
    else:
        words = tl.load(qp)
    if HB > 0:
        hw = high_words(qh_ptr, rows, rmask, j, NU, QHW, HB, MASKED)
    else:
        hw = words
    if G == 32:
        s0, m0 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, c, jmask, NG, NSB,
                              G, SB, HAS_SC, HAS_MIN, HAS_MN)
        s1 = s0
        m1 = m0
    else:
        s0, m0 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, 2 * c, jmask, NG, NSB,
                              G, SB, HAS_SC, HAS_MIN, HAS_MN)
        s1, m1 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, 2 * c + 1, jmask, NG, NSB,
                              G, SB, HAS_SC, HAS_MIN, HAS_MN)
    return words, hw, s0, m0, s1, m1


@triton.jit
def _gemv_step(acc, words, hw, s0, m0, s1, m1, xrow, j, NU, BITS: tl.constexpr, HB: tl.constexpr, G: tl.constexpr,
               QOFF: tl.constexpr, HAS_MIN: tl.constexpr, MASKED: tl.constexpr):
    """acc [BN, BJ] += the products of units ``j`` (codes ``words`` [BN, BJ, 4] and their high bits ``hw``, scales
    of their low and high groups) with x; x is read as [BJ, 4] tiles in the register layout of the codes (no
    shuffles)."""
    UPC: tl.constexpr = BITS // 4  # units per 32-weight chunk
    NS: tl.constexpr = 32 // BITS  # slots per word
    HALF: tl.constexpr = NS // 2  # slots below HALF hold weights 0..15 of the chunk
    SHIFT: tl.constexpr = 12 if BITS == 4 else 16
    jmask = j < NU
    c = j // UPC
    ko = (c * 32 + (j % UPC) * 4)[:, None] + tl.arange(0, 4)[None, :]  # + 4*UPC*s: weight NW*s + w of the chunk
    xp = xrow + ko
    hi_words = words >> SHIFT
    hws0 = words
    hws1 = words
    if HB > 0:
        hws0, hws1 = high_fields(hw, HB)
    dot0 = tl.zeros(words.shape, dtype=tl.float32)  # weights 0..15 (G == 16) or all 32
    dot1 = tl.zeros(words.shape, dtype=tl.float32)  # weights 16..31 (G == 16 only)
    xs0 = tl.zeros(xp.shape, dtype=tl.float32)
    xs1 = tl.zeros(xp.shape, dtype=tl.float32)
    for s in tl.static_range(NS):
        if MASKED:
            xv = tl.load(xp + 4 * UPC * s, mask=jmask[:, None], other=0.0)
        else:
            xv = tl.load(xp + 4 * UPC * s)
        wv = slot_value(words, hi_words, hws0, hws1, s, BITS, HB, QOFF)
        if G == 16 and s >= HALF:
            dot1 += wv * xv[None, :, :]
            if HAS_MIN:
                xs1 += xv
        else:
            dot0 += wv * xv[None, :, :]
            if HAS_MIN:
                xs0 += xv
    acc += s0 * tl.sum(dot0, axis=2)
    if G == 16:
        acc += s1 * tl.sum(dot1, axis=2)
    if HAS_MIN:
        acc -= m0 * tl.sum(xs0, axis=1)[None, :]
        if G == 16:
            acc -= m1 * tl.sum(xs1, axis=1)[None, :]
    return acc


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, res_ptr, b_ptr, y_ptr, y1_ptr, y2_ptr,
                 M, N, N1, N2, K, QW, QHW, stride_x, stride_y, pos_ptr, slot_ptr, cos_ptr, sin_ptr, ROW0, HD, HALF,
                 NSLOTS, BITS: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                 HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, HAS_RES: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ROPE: tl.constexpr, NEOX: tl.constexpr,
                 BN: tl.constexpr, BJ: tl.constexpr, MASKED: tl.constexpr, PDL: tl.constexpr,
                 TILE_MAJOR: tl.constexpr):
    """One program: BN output features of one activation row, K walked BJ units at a time. A unit is 4 words
    (16 bytes: a 4-bit chunk, or half an 8-bit chunk); codes are a [BN, BJ, 4] int32 tile (QW: words per row),
    so each thread owns whole units: one vector load per row, and for each slot a [BJ, 4] tile of x in the same
    register layout (no shuffles, no cross-thread sums in the loop). Masks depend on the unit and row only, which
    keeps the loads vectorised. The first step's codes and scales are loaded before waiting for the previous
    kernel (PDL): most decode matrices are one or two steps long, so their weights stream during its tail.
    ROPE: a decode Q/K/V projection that rotates and stores into the KV cache (rope.py's ``rope_store``)."""
    UPC: tl.constexpr = BITS // 4
    m, rows, rmask, jj, NU, NG, NSB = _gemv_program(M, N, K, N2, ROW0, HD, HALF, UPC, G, SB, ROPE, NEOX, BN, BJ,
                                                    PDL, TILE_MAJOR)
    xrow = x_ptr + m * stride_x
    qrow = q_ptr + rows[:, None, None] * QW
    words, hw, s0, m0, s1, m1 = _gemv_tile(qrow, qh_ptr, QHW, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, jj, NU,
                                           NG, NSB, UPC, HB, G, SB, HAS_SC, HAS_MIN, HAS_MN, MASKED)
    pdl.wait_prev(PDL)
    acc = _gemv_step(tl.zeros([BN, BJ], dtype=tl.float32), words, hw, s0, m0, s1, m1, xrow, jj, NU,
                     BITS, HB, G, QOFF, HAS_MIN, MASKED)
    for j0 in range(BJ, NU, BJ):
        j = j0 + jj
        words, hw, s0, m0, s1, m1 = _gemv_tile(qrow, qh_ptr, QHW, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, j,
                                               NU, NG, NSB, UPC, HB, G, SB, HAS_SC, HAS_MIN, HAS_MN, MASKED)
        acc = _gemv_step(acc, words, hw, s0, m0, s1, m1, xrow, j, NU, BITS, HB, G, QOFF, HAS_MIN, MASKED)
    _gemv_epilogue(tl.sum(acc, axis=1), m, rows, rmask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y,
                   pos_ptr, slot_ptr, cos_ptr, sin_ptr, ROW0, HD, HALF, NSLOTS, HAS_BIAS, HAS_RES, SPLIT, ROPE, NEOX,
                   BN)


@triton.jit
def _gemv_dense_kernel(x_ptr, w_ptr, res_ptr, b_ptr, y_ptr, y1_ptr, y2_ptr, M, N, N1, N2, K, WS, stride_x,
                       stride_y,
                       HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, TILE_MAJOR: tl.constexpr):
    """One program: BN features of one row of x against a float16/bfloat16/float32 matrix."""
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    tile, m = _tile_and_row(M, TILE_MAJOR)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < N
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        w = tl.load(w_ptr + rows[:, None] * WS + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0)
        x = tl.load(x_ptr + m * stride_x + kk, mask=kmask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    _epilogue(y, m, rows, rmask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y, HAS_BIAS, HAS_RES, SPLIT)


def _meta(w: PackedWeight) -> dict:
    kind = {"q4": 0, "q8": 1, "dense": 2}[w.kind]
    return dict(KIND=kind, HB=w.high_bits, G=w.group, SB=w.super_block, QOFF=w.qoff, HAS_SC=w.sc is not None,
                HAS_MIN=w.dmin is not None, HAS_MN=w.mn is not None)


def _planes(w: PackedWeight, words: bool = False) -> tuple[torch.Tensor, ...]:
    """The six plane pointers (codes, high bits, scales); absent planes alias the code plane (never read: their
    flag is off). ``words``: the two code planes as int32 words (the GEMV and GEMM read words, the gather bytes)."""
    q, qh = w.q, w.qh if w.qh is not None else w.q
    if words and w.kind != "dense":
        q, qh = q.view(torch.int32), qh.view(torch.int32)
    return tuple(p if p is not None else w.q for p in (q, qh, w.d, w.sc, w.dmin, w.mn))


class _Epilogue:
    """Kernel arguments of the output side: residual, bias and the (possibly split) outputs; or (``rope``, decode
    GEMVs only) q and the KV cache, rotated and stored by the epilogue."""

    def __init__(self, out: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor | None,
                 outs: list[torch.Tensor] | None, n: int, rope: RopeStore | None = None):
        self.out, self.residual, self.bias, self.rope = out, residual, bias, rope
        if rope is not None:
            self.split, self.bounds, self.ys = False, (rope.nq, rope.nq + rope.nk), [rope.q, *rope.cache]
            return
        ys = list(outs) if outs else [out]
        widths = [y.shape[-1] for y in ys]
        assert sum(widths) == n and len(ys) <= 3 and all(y.is_contiguous() for y in ys), (widths, n)
        self.split = len(ys) > 1
        self.bounds = (widths[0], widths[0] + (widths[1] if len(ys) > 1 else 0))
        self.ys = ys + [ys[0]] * (3 - len(ys))  # unused outputs alias the first (never written: masked off)

    def args(self) -> tuple:
        res = self.residual if self.residual is not None else self.out
        return (res, self.bias if self.bias is not None else self.out, *self.ys)

    def flags(self) -> dict:
        return dict(HAS_RES=self.residual is not None, HAS_BIAS=self.bias is not None, SPLIT=self.split)

    def gemv_args(self) -> tuple:
        """The GEMVs' trailing rope arguments (``RopeStore.args``; placeholders without rope)."""
        return self.rope.args() if self.rope else (self.out, self.out, self.out, self.out, 0, 1, 1, 0)

    def gemv_flags(self) -> dict:
        return dict(**self.flags(), ROPE=self.rope is not None, NEOX=bool(self.rope and self.rope.neox))


def _gemv(x: torch.Tensor, w: PackedWeight, ep: _Epilogue, pdl_on: bool) -> None:
    m, k = x.shape
    stride_y = ep.out.stride(0)
    if w.kind == "dense":
        bn = 4
        grid, order = gemv_grid(w, bn, m)
        _gemv_dense_kernel[grid](x, w.q, *ep.args(), m, w.n, *ep.bounds, k, w.q.stride(0), x.stride(0), stride_y,
                                 BN=bn, BK=256, num_warps=4, **order, **ep.flags(), **pdl.launch(pdl_on))
        return
    bn, kw = gemv_launch(GEMV_CONFIG, w, pdl_on)
    words, qh, *scales = _planes(w, words=True)
    grid, order = gemv_grid(w, bn, m)
    _gemv_kernel[grid](x, words, qh, *scales, *ep.args(), m, w.n, *ep.bounds, k, words.stride(0), qh.stride(0),
                       x.stride(0), stride_y, *ep.gemv_args(), **ep.gemv_flags(), **order, **kw)


def tile_key(w: PackedWeight) -> tuple[int, str]:
    """A quantized weight's entry in the GEMV tile tables: its code width (4; 6 for 4-bit codes with high bits;
    8) and its class (gemv_class)."""
    return 8 if w.kind == "q8" else 6 if w.high_bits else 4, gemv_class(w.n, w.k)


def gemv_launch(table: dict, w: PackedWeight, pdl_on: bool = False) -> tuple[int, dict]:
    """The row tile (BN) and the kernel keywords of a quantized weight's GEMV, from the tile ``table``
    (GEMV_CONFIG, or q8gemv.Q8_CONFIG for the int8 GEMV): format constants, tile, masking, warps, PDL."""
    bits = 4 if w.kind == "q4" else 8
    cfg = table[tile_key(w)]
    units = w.k // 32 * (bits // 4)
    bn, bj = cfg["BN"], min(cfg["BJ"], triton.next_power_of_2(units))
    meta = _meta(w)
    del meta["KIND"]
    return bn, dict(BITS=bits, BN=bn, BJ=bj, MASKED=bool(units % bj or w.n % bn), num_warps=cfg["num_warps"],
                    **meta, **pdl.launch(pdl_on))


def gemv_grid(w: PackedWeight, bn: int, m: int) -> tuple[tuple[int, ...], dict]:
    """The launch grid of a GEMV of ``m`` rows in tiles of ``bn`` weight rows, and its order flag. Tiles outermost
    (a tile's m programs consecutive) for a weight past TILE_MAJOR_BYTES: it would otherwise come from DRAM once
    per row, not once a step. Rows outermost for the others: m programs at once on one tile would cut the DRAM
    reads in flight m-fold (TinyLlama at 4 rows, all tiles outermost: -6%, the 7B +5%; GPU runs 321-322)."""
    tiles = triton.cdiv(w.n, bn)
    if m > 1 and w.nbytes > TILE_MAJOR_BYTES:
        return (tiles * m,), {"TILE_MAJOR": True}
    return (tiles, m), {"TILE_MAJOR": False}


def routes_int8(m: int, w: PackedWeight) -> bool:
    """Whether ``m`` activation rows against ``w`` take an int8 GEMV (given an int8 copy of x)."""
    return m <= INT8_MAX_ROWS and w.kind != "dense"


def rope_fits(m: int, w: PackedWeight, int8: bool) -> bool:
    """Whether the GEMV that ``m`` rows against a quantized ``w`` take can rotate and store in its epilogue (a row
    tile of even BN: rotated pairs in one program)."""
    from quanta.backends.cuda.q8gemv import Q8_CONFIG  # q8gemv.py imports this module's pieces

    if w.kind == "dense" or m > (INT8_MAX_ROWS if int8 else GEMV_MAX_ROWS):
        return False
    return gemv_launch(Q8_CONFIG if int8 else GEMV_CONFIG, w)[0] % 2 == 0


def qmatmul(x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, exact: bool = False, bias: torch.Tensor | None = None,
            outs: list[torch.Tensor] | None = None, xq: Any = None, rope: RopeStore | None = None,
            xw: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
            pdl_on: bool = False) -> torch.Tensor:
    """``x @ W.T (+ bias) (+ residual)``: x (m, k) float32 contiguous rows → (m, n) float32 (written into ``out``;
    ``residual`` may be ``out``). ``outs``: instead, column blocks into these contiguous (m, n_i) arrays (≤ 3).

    ``exact``: the GEMM multiplies in IEEE fp32 instead of bf16. ``xq``: x as int8 (a ``Q8Activation``): a
    quantized weight then takes the int8 GEMV (q8gemv.py) for up to INT8_MAX_ROWS rows.
    ``xw``: x as the GEMM's operand (more rows, fast mode; gemm.py's ``word_order``), written by x's producer.
    ``rope``: rows through a quantized weight whose GEMV has an even row tile (``rope_fits``): rotated and stored
    as ``rope`` says. ``scratch``: for a GEMM (more rows), a bf16 buffer the weight is dequantized into first
    (gemm.py's ``dequantizes`` says when). ``pdl_on``: launch with programmatic dependent launch (pdl.py)."""
    m, k = x.shape
    assert k == w.k and x.stride(1) == 1, (x.shape, w.k)
    if rope is not None:
        assert rope_fits(m, w, xq is not None) and residual is None and not outs
        out = rope.q
    elif outs:
        out = outs[0]
        assert residual is None
    elif out is None:
        out = torch.empty((m, w.n), dtype=torch.float32, device=x.device)
    assert residual is None or residual.stride(0) == out.stride(0)
    ep = _Epilogue(out, residual, bias, outs, w.n, rope)
    if xq is not None and routes_int8(m, w):
        from quanta.backends.cuda.q8gemv import gemv_q8  # q8gemv.py imports this module's tiles

        gemv_q8(xq, w, ep, pdl_on)
    elif m <= GEMV_MAX_ROWS:
        _gemv(x, w, ep, pdl_on)
    else:
        from quanta.backends.cuda.gemm import gemm  # gemm.py imports this module's epilogue

        gemm(x, w, ep, exact, xw=xw, scratch=scratch)
    return out
