"""Prefill's dense GEMM ``y = x @ W.T`` on bf16 operands: a quantized weight dequantized once into a scratch
(``gemm.dequantize_words``) times x in the same word order, fp32 accumulation, the GEMMs' epilogue (bias,
residual, split outputs).

Both operand tiles arrive through tensor descriptors: on Hopper a TMA bulk copy per tile into shared memory, no
address arithmetic or masks in the program (rows and columns past the matrix read as zeros), pipelined by Triton
across K steps. Programs take the weight tiles GROUP at a time for each x tile, so the weight tiles in flight are
read by every x tile from L2 at about the same time. On the H200 a layer of the benchmark models takes 0.88-0.96x
the time of session 15's pointer-based dense path (gemm.py's dense tiles) at 512 and 2,048 rows (GPU run 140).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from quanta.backends.cuda.qmatmul import _Epilogue, _epilogue

# (BM activation rows, BN weight rows, warps, stages, relative cost per output element): from 128 activation rows,
# tile_for takes the tile whose waves of programs over the SMs cost least, the larger tile on ties; below, the
# product is bound by the weight stream, and the smallest tile (the most programs) streams it fastest. Chosen from
# the per-shape times of GPU runs 139-140 (scripts/gpu_dense.py).
TILES = ((128, 256, 8, 3, 1.0), (128, 128, 8, 4, 1.0), (64, 128, 4, 4, 1.35))
SMALL_TILE = (64, 64, 4, 4)
BK = 64
GROUP = 8


@functools.cache
def _sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (an H200's 132 for CPU tensors under the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def tile_for(m: int, n: int, sms: int) -> dict:
    """Launch parameters for ``m`` activation rows and ``n`` weight rows on ``sms`` multiprocessors."""
    def cost(tile: tuple) -> float:
        bm, bn, _, _, rel = tile
        return -(-triton.cdiv(m, bm) * triton.cdiv(n, bn) // sms) * bm * bn * rel
    bm, bn, warps, stages = SMALL_TILE if m < 128 else min(TILES, key=cost)[:4]
    return {"BM": bm, "BN": bn, "num_warps": warps, "num_stages": stages}


@triton.jit
def _dense_kernel(x_desc, w_desc, res_ptr, b_ptr, y_ptr, y1_ptr, y2_ptr, M, N, N1, N2, K, stride_y,
                  HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr,
                  UPCAST: tl.constexpr):
    """One program: the [BM, BN] output tile (activation rows × weight rows). The tile loop runs once; written as a
    loop, the kernel compiles to one up to 1.4x faster with 128 x 128 tiles on triton 3.6 (GPU runs 139-140)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    tiles = num_m * num_n
    per_group = GROUP * num_m
    for tile in range(tl.program_id(0), tiles, tiles):
        n0 = tile // per_group * GROUP
        width = tl.minimum(num_n - n0, GROUP)
        pid_n = n0 + tile % per_group % width
        pid_m = tile % per_group // width
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            xt = x_desc.load([pid_m * BM, k0])
            wt = w_desc.load([pid_n * BN, k0])
            if UPCAST:  # the interpreter multiplies bfloat16 tiles as their raw bits: the same products in fp32
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(xt, wt.T, acc)
        mrows = pid_m * BM + tl.arange(0, BM)
        rows = pid_n * BN + tl.arange(0, BN)
        mask = (mrows < M)[:, None] & (rows < N)[None, :]
        _epilogue(acc, mrows[:, None], rows[None, :], mask, b_ptr, res_ptr, y_ptr, y1_ptr, y2_ptr, N, N1, N2,
                  stride_y, HAS_BIAS, HAS_RES, SPLIT)


_INTERPRETED = isinstance(_dense_kernel, InterpretedFunction)


def dense_gemm(xw: torch.Tensor, w: torch.Tensor, ep: _Epilogue, tiles: dict | None = None) -> None:
    """``xw @ w.T`` through the epilogue ``ep``: xw (m, k) and w (n, k) bf16 with contiguous rows, their row
    strides and base addresses multiples of 16 bytes (TMA). ``tiles``: launch parameters instead of ``tile_for``'s
    (BM, BN, num_warps, num_stages; other keys are not read)."""
    m, k = xw.shape
    n = w.shape[0]
    cfg = tiles or tile_for(m, n, _sms(xw.device))
    bm, bn = cfg["BM"], cfg["BN"]
    x_desc = TensorDescriptor.from_tensor(xw, [bm, BK])
    w_desc = TensorDescriptor.from_tensor(w, [bn, BK])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _dense_kernel[grid](x_desc, w_desc, *ep.args(), m, n, *ep.bounds, k, ep.out.stride(0), BM=bm, BN=bn, BK=BK,
                        STAGES=cfg["num_stages"], GROUP=GROUP, UPCAST=_INTERPRETED, num_warps=cfg["num_warps"],
                        **ep.flags())
