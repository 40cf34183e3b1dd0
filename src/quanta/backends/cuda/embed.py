"""Embedding lookup on the device: rows ``token_ids`` of a packed quantized matrix, dequantized to float32.

Reuses the GEMM's tile dequantizer (qmatmul._dequant_halves) on a one-row tile; one program per (token, 32·BC
weights). Tested against gguf-py's dequantize of the same rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl

from quanta.backends.cuda.qmatmul import _dequant_halves, _meta, _planes
from quanta.backends.cuda.repack import PackedWeight


@triton.jit
def _embed_kernel(ids_ptr, q_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, y_ptr, K, QS,
                  KIND: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, QOFF: tl.constexpr,
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
    lo, hi = _dequant_halves(q_ptr, d_ptr, sc_ptr, dmin_ptr, mn_ptr, rows, rows >= 0, cg, kj, K, QS,
                             KIND, G, SB, QOFF, HAS_SC, HAS_MIN, HAS_MN, True)
    offs = cg[:, None] * 32 + kj
    mask = (cg[:, None] < K // 32) & (kj < 16)
    tl.store(y_ptr + t * K + offs, tl.reshape(lo, (BC, 16)), mask=mask)
    tl.store(y_ptr + t * K + offs + 16, tl.reshape(hi, (BC, 16)), mask=mask)


def embed(w: PackedWeight, token_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) int32 device ids → (n, k) float32 rows of ``w``."""
    n = token_ids.numel()
    if out is None:
        out = torch.empty((n, w.k), dtype=torch.float32, device=token_ids.device)
    bc = 8
    _embed_kernel[(n, triton.cdiv(w.k // 32, bc))](token_ids, *_planes(w), out, w.k, w.q.stride(0), BC=bc, **_meta(w),
                                                       **pdl.launch())
    return out
