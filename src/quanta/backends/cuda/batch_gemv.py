"""The int8 GEMV of a small decode batch (2 to qmatmul's ``INT8_MAX_ROWS`` rows): the weight streamed once for all
rows.

q8gemv.py's kernel streams a weight once per activation row. Here a program loads its BN weight rows once (codes,
high bits and scales, the whole row when the tile table allows: ``BJ`` ≥ the row's units), waits for the kernel
that wrote x (PDL), and then runs BM activation rows against those registers one after another (an unrolled loop:
their x loads are independent), each row's dot products and epilogue (bias, residual, split outputs, or the rope
GEMVs' rotate-and-store) as the one-row kernel computes them (``_q8_step``, ``_gemv_epilogue``). Row groups are the
grid's fastest index, so the programs that read the same weight tile run side by side and all but the first read
it from L2. Weight rows longer than the tile's BJ units are walked in further K steps per activation row (from L2).

Tested under TRITON_INTERPRET=1 against the float64 matmul of gguf-py's dequantization and a numpy quantization of
x (tests/backends/cuda/test_batch_gemv.py).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl
from quanta.backends.cuda.q8gemv import Q8Activation, _q8_step
from quanta.backends.cuda.qmatmul import _gemv_epilogue, _gemv_tile, _meta, _planes
from quanta.backends.cuda.repack import PackedWeight
from quanta.backends.cuda.rope import gemv_rows

MAX_UNITS = 512  # a tile's K width in 16-byte units (8 KB of codes per weight row); longer rows take K steps
WORDS_PER_THREAD = 32  # the code words a thread holds (the tile's register budget)
MIN_PROGRAMS = 256  # weight-row tiles per launch at least (about two per multiprocessor): BN shrinks to reach it,
# down to 2
MAX_GROUP = 8  # activation rows per program


@triton.jit
def _batch_q8_kernel(xq_ptr, xd_ptr, q_ptr, qh_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, res_ptr, b_ptr, y_ptr, y1_ptr,
                     y2_ptr, M, N, N1, N2, K, QW, QHW, stride_y, pos_ptr, slot_ptr, cos_ptr, sin_ptr, ROW0, HD, HALF,
                     NSLOTS, BITS: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, SB: tl.constexpr,
                     QOFF: tl.constexpr, HAS_SC: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MN: tl.constexpr,
                     HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ROPE: tl.constexpr,
                     NEOX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr,
                     MASKED: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    """Program g + t * groups: activation rows [g*BM, (g+1)*BM) against weight-row tile t (see the module
    docstring; a 1-D grid: a large vocabulary has more row tiles than a grid's second axis holds)."""
    UPC: tl.constexpr = BITS // 4
    pdl.allow_next(PDL)
    groups = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    rows = gemv_rows(pid // groups, BN, ROW0, N2, HD, HALF, ROPE, NEOX)
    rmask = rows < N
    jj = tl.arange(0, BJ)
    NU = K // 32 * UPC
    NG = K // G
    NSB = K // SB
    qrow = q_ptr + rows[:, None, None] * QW
    words, hw, s0, m0, s1, m1 = _gemv_tile(qrow, qh_ptr, QHW, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask, jj, NU,
                                           NG, NSB, UPC, HB, G, SB, HAS_SC, HAS_MIN, HAS_MN, MASKED)
    pdl.wait_prev(PDL)
    first = pid % groups * BM
    for r in tl.static_range(BM):
        m = first + r
        if m < M:
            xq_row = xq_ptr + m * (K // 4)
            xd_row = xd_ptr + m * (K // 32)
            acc = _q8_step(tl.zeros([BN, BJ], dtype=tl.float32), words, hw, s0, m0, s1, m1, xq_row, xd_row, jj, NU,
                           BITS, HB, G, QOFF, HAS_MIN, MASKED, EMULATE)
            for j0 in range(BJ, NU, BJ):  # rows longer than the tile: further K steps (weights from L2)
                j = j0 + jj
                w2, h2, t0, n0, t1, n1 = _gemv_tile(qrow, qh_ptr, QHW, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rmask,
                                                    j, NU, NG, NSB, UPC, HB, G, SB, HAS_SC, HAS_MIN, HAS_MN, MASKED)
                acc = _q8_step(acc, w2, h2, t0, n0, t1, n1, xq_row, xd_row, j, NU, BITS, HB, G, QOFF, HAS_MIN,
                               MASKED, EMULATE)
            _gemv_epilogue(tl.sum(acc, axis=1), m, rows, rmask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2,
                           stride_y, pos_ptr, slot_ptr, cos_ptr, sin_ptr, ROW0, HD, HALF, NSLOTS, HAS_BIAS, HAS_RES,
                           SPLIT, ROPE, NEOX, BN)


def _tile(n: int, units: int, high_bits: int, m: int) -> dict:
    bj = min(triton.next_power_of_2(units), MAX_UNITS)
    warps = 4 if bj >= 128 else 2 if bj >= 64 else 1
    words = 4 + high_bits  # code and high-bit words per unit
    budget = WORDS_PER_THREAD * 32 * warps
    bn = 2 if 2 * bj * words <= budget else 1  # even where it fits: the rope epilogue rotates pairs of rows
    while 2 * bn * bj * words <= budget and triton.cdiv(n, 2 * bn) >= MIN_PROGRAMS:
        bn *= 2
    return {"BM": min(triton.next_power_of_2(m), MAX_GROUP), "BN": bn, "BJ": bj, "num_warps": warps}


def batch_tile(w: PackedWeight, m: int) -> dict:
    """The launch tile of ``m`` activation rows against ``w``: BM rows per program, BN weight rows, BJ units per K
    step, warps."""
    bits = 4 if w.kind == "q4" else 8
    return _tile(w.n, w.k // 32 * (bits // 4), w.high_bits, m)


def batch_gemv_q8(xq: Q8Activation, w: PackedWeight, ep: Any, pdl_on: bool = False, tile: dict | None = None) -> None:
    """The batched int8 GEMV of (m, k) activations ``xq`` against a quantized ``w`` through qmatmul's output side
    ``ep``; ``tile``: launch parameters instead of ``batch_tile``'s."""
    m, k = xq.q.shape
    cfg = tile or batch_tile(w, m)
    bits = 4 if w.kind == "q4" else 8
    units = k // 32 * (bits // 4)
    bm, bn, bj = cfg["BM"], cfg["BN"], cfg["BJ"]
    meta = _meta(w)
    del meta["KIND"]
    words, qh, *scales = _planes(w, words=True)
    _batch_q8_kernel[(triton.cdiv(m, bm) * triton.cdiv(w.n, bn),)](
        xq.q.view(torch.int32), xq.d, words, qh, *scales, *ep.args(), m, w.n, *ep.bounds, k, words.stride(0),
        qh.stride(0), ep.out.stride(0), *ep.gemv_args(), BITS=bits, BM=bm, BN=bn, BJ=bj,
        MASKED=bool(units % bj or w.n % bn), EMULATE=xq.q.device.type != "cuda", num_warps=cfg["num_warps"],
        **ep.gemv_flags(), **meta, **pdl.launch(pdl_on))
