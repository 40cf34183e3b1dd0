"""RMSNorm over the last axis, optionally fused with the residual add that precedes it.

Layout: rows of ``d`` contiguous float32; one program per row. Tested against a float64 numpy RMSNorm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl
from quanta.backends.cuda.gemm import WordsCopy, store_words
from quanta.backends.cuda.q8gemv import Q8Activation, store_q8


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, q_ptr, qd_ptr, yw_ptr, D, eps, BLOCK: tl.constexpr,
                     ADD_RES: tl.constexpr, Q8: tl.constexpr, WORDS: tl.constexpr, NW: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.allow_next(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # a weight: read before waiting for the kernel before
    pdl.wait_prev(PDL)
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)
    if ADD_RES:  # x += residual, stored back: the residual stream and its norm in one pass
        x += tl.load(res_ptr + row * D + cols, mask=mask, other=0.0)
        tl.store(x_ptr + row * D + cols, x, mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * inv * w
    tl.store(y_ptr + row * D + cols, y, mask=mask)
    if Q8:  # the int8 copy for the decode GEMV (q8gemv.py)
        store_q8(y, row * D, D, q_ptr, qd_ptr, BLOCK)
    if WORDS:  # the bf16 copy for the prefill GEMM (gemm.py)
        store_words(yw_ptr + row * D, cols, y, mask, NW)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, q8: Q8Activation | None = None,
             words: WordsCopy | None = None, pdl_on: bool = False) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` per row; with ``residual``, first ``x += residual`` (in place).
    ``q8``: also write the output as int8 activations there; ``words``: as the GEMM's bf16 operand (rows a
    multiple of 32 long)."""
    d = weight.shape[-1]
    assert x.is_contiguous() and x.shape[-1] == d
    if out is None:
        out = torch.empty_like(x)
    rows = x.numel() // d
    yw, word_flags = WordsCopy.kernel_args(words, out)
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out,
                              *((q8.q, q8.d) if q8 is not None else (out, out)), yw, d, eps,
                              BLOCK=triton.next_power_of_2(d), ADD_RES=residual is not None, Q8=q8 is not None,
                              num_warps=4 if d <= 4096 else 8, **word_flags, **pdl.launch(pdl_on))
    return out
