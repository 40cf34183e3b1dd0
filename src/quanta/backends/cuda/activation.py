"""Gated activations ``act(gate) * up`` and the small in-place elementwise ops (bias add, scale, soft-capping).

Flat float32 arrays, one program per 1024 elements. Tested against numpy (tanh-approximate GELU, as llama.cpp and
HF ``gelu_pytorch_tanh``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl
from quanta.backends.cuda.gemm import WordsCopy, store_words
from quanta.backends.cuda.q8gemv import Q8Activation, store_q8

_BLOCK = 1024


@triton.jit
def _tanh(x):
    # tanh via exp, stable for large |x| (tl.math.tanh is not available in every Triton version)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _gated_activation_kernel(g_ptr, u_ptr, y_ptr, q_ptr, qd_ptr, yw_ptr, N, GELU: tl.constexpr, Q8: tl.constexpr,
                             WORDS: tl.constexpr, NW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    if GELU:
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = g / (1.0 + tl.exp(-g))
    y = a * u
    tl.store(y_ptr + offs, y, mask=mask)
    if Q8:  # the int8 copy for the decode GEMV (q8gemv.py); rows are multiples of 32 long
        store_q8(y, tl.program_id(0) * BLOCK, N - tl.program_id(0) * BLOCK, q_ptr, qd_ptr, BLOCK)
    if WORDS:  # the bf16 copy for the prefill GEMM (gemm.py); rows are multiples of 32 long
        store_words(yw_ptr, offs, y, mask, NW)


@triton.jit
def _inplace_elementwise_kernel(x_ptr, b_ptr, N, B, s, OP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """OP 0: x += b[i % B] (row-broadcast add); 1: x *= s; 2: x = s * tanh(x / s)."""
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if OP == 0:
        x += tl.load(b_ptr + offs % B, mask=mask, other=0.0)
    elif OP == 1:
        x *= s
    else:
        x = s * _tanh(x / s)
    tl.store(x_ptr + offs, x, mask=mask)


def _gated(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None, gelu: bool,
           q8: Q8Activation | None, words: WordsCopy | None, pdl_on: bool) -> torch.Tensor:
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    if out is None:
        out = torch.empty_like(gate)
    n = gate.numel()
    qargs = (q8.q, q8.d) if q8 is not None else (out, out)
    yw, word_flags = WordsCopy.kernel_args(words, out)
    _gated_activation_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, out, *qargs, yw, n, GELU=gelu, Q8=q8 is not None,
                                                        BLOCK=_BLOCK, **word_flags, **pdl.launch(pdl_on))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
             q8: Q8Activation | None = None, words: WordsCopy | None = None, pdl_on: bool = False) -> torch.Tensor:
    """``silu(gate) * up``; ``q8``: also written there as int8 activations; ``words``: as the GEMM's bf16
    operand."""
    return _gated(gate, up, out, False, q8, words, pdl_on)


def gelu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
             q8: Q8Activation | None = None, words: WordsCopy | None = None, pdl_on: bool = False) -> torch.Tensor:
    """``gelu_tanh(gate) * up``; ``q8``: also written there as int8 activations; ``words``: as the GEMM's bf16
    operand."""
    return _gated(gate, up, out, True, q8, words, pdl_on)


def _inplace(x: torch.Tensor, b: torch.Tensor | None, s: float, op: int, pdl_on: bool) -> torch.Tensor:
    assert x.is_contiguous()
    n = x.numel()
    _inplace_elementwise_kernel[(triton.cdiv(n, _BLOCK),)](x, b if b is not None else x, n,
                                                           b.numel() if b is not None else 1, s, OP=op,
                                                           BLOCK=_BLOCK, **pdl.launch(pdl_on))
    return x


def add_(x: torch.Tensor, b: torch.Tensor, pdl_on: bool = False) -> torch.Tensor:
    """``x += b`` in place; ``b`` has x's shape or broadcasts over x's rows."""
    return _inplace(x, b.contiguous(), 1.0, 0, pdl_on)


def scale_(x: torch.Tensor, s: float, pdl_on: bool = False) -> torch.Tensor:
    return _inplace(x, None, float(s), 1, pdl_on)


def softcap_(x: torch.Tensor, cap: float, pdl_on: bool = False) -> torch.Tensor:
    return _inplace(x, None, float(cap), 2, pdl_on)
