"""Prefill GEMM ``y = x @ W.T (+ bias) (+ residual)`` on a packed weight, dequantized on the fly into tensor-core
operands: bf16 operands with fp32 accumulation (fast mode; bf16 keeps float32's range, float16 overflows on some
models' activations) or IEEE fp32 (exact mode).

Layout (see repack.py): chunk ``c`` of a weight row is NW little-endian 32-bit words (NW = 4 for 4-bit codes, 8 for
8-bit codes), slot ``s`` of word ``w`` holding weight ``32c + NW*s + w``; 5- and 6-bit codes are 4-bit words with
1 or 2 words of high bits per chunk, moved in above each slot's nibble (codes.py). A K step of BK weights loads the
[BN, BK/32, NW] words of its rows (16-byte cp.async vectors, pipelined by Triton) and dequantizes each slot with
one LOP3, one FADD and one FFMA per weight (see _slot), scales per (row, group) in fp32. The tile is built in
*word order*: ``tl.join`` puts the NS slots of a word next to each other inside the thread that owns the word,
so column ``32c + NS*w + s`` of the tile is weight ``32c + NW*s + w`` — no shuffles, no layout change of the codes.
x is permuted the same way, by its producer (copies.py) or once per matmul (:func:`word_order`, fused with its bf16
cast), and a dot product does not care about the order of K. Scales are loaded one K step ahead (registers), codes
and x stream through shared memory; the products run on wgmma (bf16) or as fp32 FMAs (exact).

SWAP computes the transposed tile ``W x^T`` (weights as the left operand, straight from registers; x from shared
memory), which lets Triton keep one wgmma in flight while the next tile is dequantized; the epilogue writes the
transposed accumulator. Dense (F16/BF16/F32) weights are read as they are, in weight order.

From DEQUANT_MIN_ROWS activation rows up, a quantized weight is instead dequantized once into a bf16 scratch, in
word order (``dequantize_words``: the same weight tiles, stored), and that is multiplied by dense_gemm.py's kernel
with the x operand in word order: one more pass over 2 bytes per weight, and no dequantizing per activation tile.

Tested under TRITON_INTERPRET=1 and on the GPU against gguf-py's dequantize followed by a float64 matmul
(tests/backends/cuda/test_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from quanta.backends.cuda.codes import high_fields, high_words, slot_value
from quanta.backends.cuda.dense_gemm import _sms, dense_gemm
from quanta.backends.cuda.qmatmul import _Epilogue, _epilogue, _meta, _planes
from quanta.backends.cuda.repack import FusedWeight, PackedWeight

# Tiles per (mode, activation-row class); BM is the activation-row tile, BN the weight-row tile, BK the K step.
# Fast mode: from the H200 sweep of scripts/gpu_gemm.py (SWAP wins for 4-bit codes, and non-swapped 4-bit tiles do
# not compile on triton 3.6), "tiny" (decode batches of up to 16 rows) from GPU run 208; exact mode: fp32 FMA dots,
# tiles small enough not to spill.
GEMM_TILES = {
    ("fast", "huge"): {"BM": 256, "BN": 64, "BK": 64, "SWAP": True, "num_warps": 8, "num_stages": 3},
    ("fast", "large"): {"BM": 128, "BN": 64, "BK": 64, "SWAP": True, "num_warps": 4, "num_stages": 3},
    ("fast", "medium"): {"BM": 64, "BN": 64, "BK": 64, "SWAP": True, "num_warps": 4, "num_stages": 3},
    ("fast", "small"): {"BM": 32, "BN": 64, "BK": 64, "SWAP": True, "num_warps": 4, "num_stages": 3},
    ("fast", "tiny"): {"BM": 16, "BN": 64, "BK": 64, "SWAP": True, "num_warps": 4, "num_stages": 3},
    ("exact", "huge"): {"BM": 32, "BN": 64, "BK": 32, "SWAP": False, "num_warps": 4, "num_stages": 2},
    ("exact", "large"): {"BM": 32, "BN": 64, "BK": 32, "SWAP": False, "num_warps": 4, "num_stages": 2},
    ("exact", "medium"): {"BM": 32, "BN": 64, "BK": 32, "SWAP": False, "num_warps": 4, "num_stages": 2},
    ("exact", "small"): {"BM": 16, "BN": 64, "BK": 32, "SWAP": False, "num_warps": 4, "num_stages": 2},
    ("exact", "tiny"): {"BM": 16, "BN": 64, "BK": 32, "SWAP": False, "num_warps": 4, "num_stages": 2},
}


# From DEQUANT_MIN_ROWS activation rows up (fast mode) a quantized weight is first dequantized into a bf16 scratch
# (dequantize_words) and then multiplied as a dense matrix (dense_gemm.py): the fused kernel dequantizes each
# weight once per BM activation rows and is bound by those instructions; dequantizing and this kernel's dense path
# took 0.6-0.75x its time from 64 to 2,048 rows on the benchmark models' layers (H200, GPU runs 124-125), and
# prefill gained 22-69% (run 126); the TMA kernel since is faster still. Decode batches (more rows than qmatmul's
# int8 GEMV takes, fewer than DEQUANT_MIN_ROWS) read each weight once in the fused kernel, its K split so that a
# batch's few output tiles still fill the multiprocessors (k_splits): the dequantized route writes and reads 4
# more bytes per weight (TinyLlama's decode matmuls: 2.66 ms per step through it at 16-64 rows, 4.23 ms through
# the fused kernel unsplit, GPU runs 205-206). The scratch is sized for the largest layer matrix of up to
# DEQUANT_MAX_WEIGHTS weights (512 MiB of bf16 at most; a 13B model's gate|up fits); larger matrices (an lm head
# scoring every position) keep the fused kernel. A limit of 2^25 left the 7B's Q|K|V, gate|up and down projections
# on the fused kernel; 2^28 took Llama-2-7B's prefill-512 from 17,200 to 25,350 tok/s (H200, GPU runs 309-310)
DEQUANT_MIN_ROWS = 128
DEQUANT_MAX_WEIGHTS = 1 << 28
# the fused GEMM splits K until its programs fill SPLIT_WAVES waves of the multiprocessors: TinyLlama's decode
# matmuls at 16 rows 1.86 ms with 2 waves, 1.80 with 4, 1.87 with 8; with the 16-row tile ("tiny") and 4 waves 1.69
# (64 rows: 2.05 / 2.01 / 2.20 ms; GPU run 208)
SPLIT_WAVES = 4
MIN_SPLIT_STEPS = 4  # K steps per split at least


def row_class(m: int) -> str:
    return "huge" if m >= 1024 else "large" if m >= 256 else "medium" if m >= 64 else "small" if m > 16 else "tiny"


def dequantizes(m: int, w: PackedWeight, exact: bool) -> bool:
    """Whether the GEMM of ``m`` activation rows dequantizes ``w`` first (into a scratch of w.n * w.k bf16)."""
    return not exact and m >= DEQUANT_MIN_ROWS and w.kind != "dense" and w.n * w.k <= DEQUANT_MAX_WEIGHTS


@triton.jit
def _slot(words, hi_words, hws0, hws1, s: tl.constexpr, scale, mn, BITS: tl.constexpr, HB: tl.constexpr,
          QOFF: tl.constexpr, DT: tl.constexpr):
    """Slot ``s`` of every word, dequantized (codes.slot_value): ``scale * (q - QOFF) - mn`` as DT."""
    return (slot_value(words, hi_words, hws0, hws1, s, BITS, HB, QOFF) * scale - mn).to(DT)


@triton.jit
def _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, g, K,
                 G: tl.constexpr, SB: tl.constexpr, HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr,
                 HAS_MN: tl.constexpr):
    """Scale ``d*sc`` and min ``dmin*mn`` of groups ``g`` ([C]) of ``rows`` ([BN]): two [BN, C, 1] fp32 tiles."""
    gi = rows[:, None] * (K // G) + g[None, :]
    sbi = rows[:, None] * (K // SB) + (g // (SB // G))[None, :]
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
def _scales(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, k0, K, KIND: tl.constexpr, G: tl.constexpr, SB: tl.constexpr,
            HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Scales and mins of the low (weights 0..15 of each chunk) and high (16..31) groups of weights k0..k0+BK:
    four [BN, BK/32, 1] tiles (the same two twice when G == 32). Chunks wrap modulo the row, so the prefetch
    past the last step reads valid memory."""
    C: tl.constexpr = BK // 32
    # (if/else rather than early returns: triton 3.6 compiles the code after a constexpr-guarded return)
    if KIND == 2:
        s0 = tl.zeros((BN, C, 1), dtype=tl.float32)
        m0 = s0
        s1 = s0
        m1 = s0
    else:
        c = (k0 // 32 + tl.arange(0, C)) % (K // 32)
        if G == 32:
            s0, m0 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, c, K, G, SB, HAS_SC, HAS_MIN, HAS_MN)
            s1 = s0
            m1 = m0
        else:
            s0, m0 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, 2 * c, K, G, SB, HAS_SC, HAS_MIN, HAS_MN)
            s1, m1 = _group_scale(d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, 2 * c + 1, K, G, SB,
                                  HAS_SC, HAS_MIN, HAS_MN)
    return s0, m0, s1, m1


@triton.jit
def _weight_tile(q_ptr, qh_ptr, rows, k0, K, QS, QHS, s0, m0, s1, m1, KIND: tl.constexpr, HB: tl.constexpr,
                 QOFF: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, DT: tl.constexpr):
    """Weights ``k0 .. k0+BK`` of ``rows`` ([BN], all valid) as a [BN, BK] tile of DT, codes in *word order*
    (column ``32c + NS*w + s`` holds weight ``32c + NW*s + w``; x is permuted alike, see :func:`gemm`), scaled by
    the tiles of :func:`_scales`. QS, QHS: the row strides of the code planes (int32 words for codes, elements
    for dense; dense tiles are in weight order)."""
    if KIND == 2:
        kk = k0 + tl.arange(0, BK)
        p = q_ptr + rows[:, None] * QS + kk[None, :]
        if EVEN_K:
            w = tl.load(p)
        else:
            w = tl.load(p, mask=(kk < K)[None, :], other=0)
        t = w.to(DT)
    else:
        BITS: tl.constexpr = 4 if KIND == 0 else 8
        NW: tl.constexpr = BITS  # words per 32-weight chunk
        NS: tl.constexpr = 32 // BITS  # slots per word; slots below NS // 2 hold weights 0..15 of the chunk
        SHIFT: tl.constexpr = 12 if BITS == 4 else 16
        C: tl.constexpr = BK // 32
        c = k0 // 32 + tl.arange(0, C)
        p = q_ptr + rows[:, None, None] * QS + (c[:, None] * NW + tl.arange(0, NW)[None, :])[None, :, :]
        if EVEN_K:
            words = tl.load(p)
        else:
            words = tl.load(p, mask=(c < K // 32)[None, :, None], other=0)
        hi_words = words >> SHIFT
        h0 = words
        h1 = words
        if HB > 0:  # (rows are all valid: clamped by the caller)
            h0, h1 = high_fields(high_words(qh_ptr, rows, rows >= 0, c, K // 32, QHS, HB, not EVEN_K), HB)
        # join(a, b) appends a minor axis of 2 inside each thread; the tree puts slot s at index s of the last NS
        v0 = _slot(words, hi_words, h0, h1, 0, s0, m0, BITS, HB, QOFF, DT)
        v1 = _slot(words, hi_words, h0, h1, 1, s0, m0, BITS, HB, QOFF, DT)
        if NS == 4:
            v2 = _slot(words, hi_words, h0, h1, 2, s1, m1, BITS, HB, QOFF, DT)
            v3 = _slot(words, hi_words, h0, h1, 3, s1, m1, BITS, HB, QOFF, DT)
            t = tl.join(tl.join(v0, v2), tl.join(v1, v3))
        else:
            v2 = _slot(words, hi_words, h0, h1, 2, s0, m0, BITS, HB, QOFF, DT)
            v3 = _slot(words, hi_words, h0, h1, 3, s0, m0, BITS, HB, QOFF, DT)
            v4 = _slot(words, hi_words, h0, h1, 4, s1, m1, BITS, HB, QOFF, DT)
            v5 = _slot(words, hi_words, h0, h1, 5, s1, m1, BITS, HB, QOFF, DT)
            v6 = _slot(words, hi_words, h0, h1, 6, s1, m1, BITS, HB, QOFF, DT)
            v7 = _slot(words, hi_words, h0, h1, 7, s1, m1, BITS, HB, QOFF, DT)
            t = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        t = tl.reshape(t, (BN, BK))
    return t


@triton.jit(do_not_specialize=["M"])  # one compile for every row count (a prompt's odd tail chunk compiled none)
def _gemm_kernel(x_ptr, q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, res_ptr, b_ptr, y_ptr, y1_ptr, y2_ptr, M, N,
                 N1, N2, K, QS, QHS, stride_x, stride_y, part_ptr, KSPLIT,
                 KIND: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                 HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, HAS_RES: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, EXACT: tl.constexpr,
                 EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PARTIAL: tl.constexpr):
    """One program: the [BM, BN] output tile (activation rows × weight rows) of K range [KSPLIT * z, KSPLIT * (z +
    1)) (z the grid's third index), BK at a time. Out-of-range rows are clamped (modulo) rather than masked, so
    every load is a whole vector; the epilogue masks the stores. PARTIAL: the tile's sum goes to the (z, M, N)
    float32 partials instead, for ``_sum_splits_kernel``."""
    DT: tl.constexpr = tl.float32 if EXACT else tl.bfloat16
    PREC: tl.constexpr = "tf32" if not EXACT and not UPCAST else "ieee"  # (ignored for bf16 operands)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_lo = tl.program_id(2) * KSPLIT
    k_hi = tl.minimum(K, k_lo + KSPLIT)
    mrows = pid_m * BM + tl.arange(0, BM)
    rows = pid_n * BN + tl.arange(0, BN)
    xrow = x_ptr + (mrows % M)[:, None] * stride_x
    wrows = rows % N
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    s0, m0, s1, m1 = _scales(d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, k_lo, K, KIND, G, SB, HAS_SC, HAS_MIN, HAS_MN,
                             BN, BK)
    for k0 in range(k_lo, k_hi, BK):
        # this step's scales were loaded one step ahead (their latency is not hidden by the pipelined loads)
        ns0, nm0, ns1, nm1 = _scales(d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, k0 + BK, K, KIND, G, SB,
                                     HAS_SC, HAS_MIN, HAS_MN, BN, BK)
        kk = k0 + tl.arange(0, BK)
        if EVEN_K:
            xt = tl.load(xrow + kk[None, :]).to(DT)
        else:
            xt = tl.load(xrow + kk[None, :], mask=(kk < K)[None, :], other=0).to(DT)
        wt = _weight_tile(q_ptr, qh_ptr, wrows, k0, K, QS, QHS, s0, m0, s1, m1, KIND, HB, QOFF, BN, BK, EVEN_K, DT)
        if UPCAST:  # the interpreter multiplies bfloat16 tiles as their raw bits: the same products in fp32
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        if SWAP:
            acc = tl.dot(wt, tl.trans(xt), acc, input_precision=PREC)
        else:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
        s0, m0, s1, m1 = ns0, nm0, ns1, nm1
    if SWAP:
        mr, nr = mrows[None, :], rows[:, None]
    else:
        mr, nr = mrows[:, None], rows[None, :]
    mask = (mr < M) & (nr < N)
    if PARTIAL:
        tl.store(part_ptr + (tl.program_id(2) * M + mr) * N + nr, acc, mask=mask)
    else:
        _epilogue(acc, mr, nr, mask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y, HAS_BIAS, HAS_RES,
                  SPLIT)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(part_ptr, res_ptr, b_ptr, y_ptr, y1_ptr, y2_ptr, M, N, N1, N2, stride_y, S,
                       HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK outputs of a split-K GEMM: the S partials summed in order (deterministic), then the epilogue."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for z in range(S):
        acc += tl.load(part_ptr + z * M * N + i, mask=mask, other=0)
    _epilogue(acc, i // N, i % N, mask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2, stride_y, HAS_BIAS,
              HAS_RES, SPLIT)


def k_splits(m: int, n: int, k: int, cfg: dict, exact: bool, sms: int) -> tuple[int, int]:
    """(splits, K per split) of the fused GEMM: fast mode splits K while the output tiles fill fewer than
    SPLIT_WAVES waves of the multiprocessors (a decode batch against a 2,048-row matrix: 32 programs on 132 SMs),
    each split at least MIN_SPLIT_STEPS K steps. Exact mode never splits (a row's sum must not depend on its
    batch)."""
    steps = triton.cdiv(k, cfg["BK"])
    tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    want = 1 if exact else min(triton.cdiv(SPLIT_WAVES * sms, tiles), steps // MIN_SPLIT_STEPS)
    per = triton.cdiv(steps, max(want, 1))
    return triton.cdiv(steps, per), per * cfg["BK"]


_INTERPRETED = isinstance(_gemm_kernel, InterpretedFunction)


@triton.jit
def _dequantize_kernel(q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, out_ptr, N, K, QS, QHS,
                       KIND: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
                       HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, EVEN_K: tl.constexpr):
    """One [BN, BK] tile of the weight as bf16, in word order (the GEMM's own weight tile, stored)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    wrows = rows % N
    s0, m0, s1, m1 = _scales(d_ptr, sc_ptr, dmin_ptr, mn_ptr, wrows, k0, K, KIND, G, SB, HAS_SC, HAS_MIN, HAS_MN,
                             BN, BK)
    t = _weight_tile(q_ptr, qh_ptr, wrows, k0, K, QS, QHS, s0, m0, s1, m1, KIND, HB, QOFF, BN, BK, EVEN_K,
                     tl.bfloat16)
    kk = k0 + tl.arange(0, BK)
    tl.store(out_ptr + rows[:, None] * K + kk[None, :], t, mask=(rows < N)[:, None] & (kk < K)[None, :])


def dequantize_words(w: PackedWeight, out: torch.Tensor) -> torch.Tensor:
    """The quantized ``w`` as a bf16 (n, k) matrix whose rows are in word order (``word_order`` of the dequantized
    rows), written into ``out`` (a bf16 buffer of at least n * k elements) and returned as a view of it."""
    q, qh, *scales = _planes(w, words=True)
    bn, bk = 64, 128
    _dequantize_kernel[(triton.cdiv(w.n, bn), triton.cdiv(w.k, bk))](
        q, qh, *scales, out, w.n, w.k, q.stride(0), qh.stride(0), BN=bn, BK=bk, EVEN_K=w.k % bk == 0, num_warps=4,
        **_meta(w))
    return out[:w.n * w.k].view(w.n, w.k)


@dataclass
class WordsCopy:
    """x as the GEMM's operand, written by x's producer: bf16 (m, k) in the word order of ``kind``'s codes
    (``word_order(x, kind, torch.bfloat16)``)."""

    data: torch.Tensor
    kind: str  # "q4" or "q8"

    @staticmethod
    def kernel_args(words: WordsCopy | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """A producer kernel's pointer and flags for ``store_words``: the copy and its order, or a placeholder
        pointer (never written)."""
        if words is None:
            return placeholder, {"WORDS": False, "NW": 4}
        return words.data, {"WORDS": True, "NW": _words_per_chunk(words.kind)}


def _words_per_chunk(kind: str) -> int:
    """Code words per 32-weight chunk of a quantized kind (repack.py): 4 for 4-bit codes, 8 for 8-bit ones."""
    return 4 if kind == "q4" else 8


@triton.jit
def store_words(base, i, y, mask, NW: tl.constexpr):
    """For producers that write the GEMM's operand themselves (a ``WordsCopy``; ``NW`` from its ``kernel_args``):
    float32 ``y``, columns ``i`` of a row of x starting at ``base``, stored as ``word_order(x, kind, torch.bfloat16)``
    has them: column ``32c + NW*s + w`` at ``32c + (32/NW)*w + s``, rounded to nearest even as torch's cast does
    (on the bits: Triton's interpreter truncates)."""
    e = i % 32
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    tl.store(base + i - e + (32 // NW) * (e % NW) + e // NW, bits.to(tl.float32, bitcast=True).to(tl.bfloat16),
             mask=mask)


def word_order(x: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """x (m, k) with each 32-column chunk permuted into the weight tile's word order (column ``32c + NS*w + s`` is
    x column ``32c + NW*s + w``), as ``dtype``: one copy per matmul, the operand the kernel streams."""
    if kind == "dense":
        return x.to(dtype).contiguous()
    m, k = x.shape
    nw = _words_per_chunk(kind)
    out = torch.empty((m, k // 32, nw, 32 // nw), dtype=dtype, device=x.device)
    # one copy kernel casts and permutes; `.to(dtype).reshape(m, k)` took two (GPU run 89: prefill-512 +2-3.5%)
    out.copy_(x.reshape(m, k // 32, 32 // nw, nw).transpose(2, 3))
    return out.view(m, k)


def gemm(x: torch.Tensor, w: PackedWeight | FusedWeight, ep: _Epilogue, exact: bool, tiles: dict | None = None,
         xw: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> None:
    """``x @ W.T`` through the epilogue ``ep``: x (m, k) float32 with contiguous rows. ``exact``: IEEE fp32
    products, else bf16 operands with fp32 accumulation. ``tiles``: launch parameters to use instead (a GEMM_TILES
    entry, or with ``scratch`` dense_gemm's).
    ``xw``: x already as the operand (``word_order`` of x), written by x's producer. ``scratch`` (fast mode, a
    quantized ``w``; see ``dequantizes``): a bf16 buffer of at least n * k elements to dequantize ``w`` into
    first, the product then taken by ``dense_gemm``."""
    w = w.packed if isinstance(w, FusedWeight) else w
    m, k = x.shape
    if xw is None:
        xw = word_order(x, w.kind, torch.float32 if exact else torch.bfloat16)
    if scratch is not None:  # x stays in the quantized kind's word order, as the dequantized rows are
        assert not exact and w.kind != "dense", (exact, w.kind)
        dense_gemm(xw, dequantize_words(w, scratch), ep, tiles)
        return
    cfg = tiles or GEMM_TILES[("exact" if exact else "fast", row_class(m))]
    q, qh, *scales = _planes(w, words=True)
    splits, ksplit = k_splits(m, w.n, k, cfg, exact, _sms(x.device))
    part = torch.empty((splits, m, w.n), dtype=torch.float32, device=x.device) if splits > 1 else ep.out
    grid = (triton.cdiv(m, cfg["BM"]), triton.cdiv(w.n, cfg["BN"]), splits)
    _gemm_kernel[grid](xw, q, qh, *scales, *ep.args(), m, w.n, *ep.bounds, k, q.stride(0), qh.stride(0), xw.stride(0),
                       ep.out.stride(0), part, ksplit, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], SWAP=cfg["SWAP"],
                       EXACT=exact, EVEN_K=k % cfg["BK"] == 0, UPCAST=_INTERPRETED and not exact,
                       PARTIAL=splits > 1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **ep.flags(),
                       **_meta(w))
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * w.n, block),)](part, *ep.args(), m, w.n, *ep.bounds, ep.out.stride(0),
                                                           splits, BLOCK=block, num_warps=4, **ep.flags())
