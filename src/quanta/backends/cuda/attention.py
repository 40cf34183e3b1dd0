"""Causal attention over the KV cache: flash attention for prefill; one token goes to flash_decode.py.

Cache layout: per layer, K and V of ``(n_kv_heads, n_ctx, head_dim)``, float32 (exact against the CPU backend) or
float16 (the default mode: half the bytes per key, read by fp16 tensor-core dots in decode).
Positions are read from device memory, so a captured decode step replays at any position. Query i sees cached
positions p with ``p <= pos_i`` and, with a sliding window w > 0, ``p > pos_i - w``. GQA: query head h reads KV
head ``h // (H / HKV)``. Scores: ``q·k * scale``, then ``softcap * tanh(s / softcap)`` when softcap > 0.

Tested under TRITON_INTERPRET=1 against a float64 numpy softmax attention (tests/backends/cuda/test_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import flash_decode
from quanta.backends.cuda.activation import _tanh
from quanta.backends.cuda.flash_decode import _NEG, DecodeScratch, _dot
from quanta.backends.cuda.gemm import WordsCopy, store_words
from quanta.backends.cuda.q8gemv import Q8Activation


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, HKV, HD, NCTX, BD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BD)
    m = d < HD
    src = (t * HKV + h) * HD + d
    dst = (h * NCTX + pos) * HD + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + src, mask=m), mask=m)
    tl.store(vc_ptr + dst, tl.load(v_ptr + src, mask=m), mask=m)


# prefill tiles (BM query rows, BN keys, warps, pipeline stages) per (operands, head width): fp32 tiles for the
# exact mode's fp32 cache (wide heads, gemma's 256, get smaller ones to fit shared memory); fp16 ones for the
# default mode's fp16 cache, multiplied on fp16 tensor cores as in decode: 0.3-0.6x the time of tf32 dots on
# upcast tiles at 512 and 2,048 tokens (GPU run 129, scripts/gpu_prefill_attn.py, which chose these tiles)
PREFILL_TILES = {
    ("fp32", "narrow"): (64, 64, 4, 2), ("fp32", "wide"): (32, 32, 4, 2),
    ("fp16", "narrow"): (64, 64, 4, 3), ("fp16", "wide"): (64, 32, 4, 2),
}


@triton.jit
def _prefill_attention_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, ow_ptr, N, H, HKV, HD, NCTX, scale, softcap,
                              window, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr, BD: tl.constexpr, DOT: tl.constexpr, WORDS: tl.constexpr,
                              NW: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (H // HKV)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < N
    pos = tl.load(pos_ptr + rows, mask=rmask, other=-1)
    d = tl.arange(0, BD)
    dmask = d < HD
    q = tl.load(q_ptr + (rows[:, None] * H + h) * HD + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    hi = tl.max(pos, axis=0) + 1
    lo = 0
    if WINDOW:
        lo = tl.maximum(tl.min(tl.where(rmask, pos, NCTX), axis=0) - window + 1, 0)
        lo = (lo // BN) * BN
    m_i = tl.full([BM], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    kbase = kc_ptr + hk * NCTX * HD
    vbase = vc_ptr + hk * NCTX * HD
    for start in range(lo, hi, BN):
        p = start + tl.arange(0, BN)
        pmask = p < hi
        kvmask = pmask[:, None] & dmask[None, :]
        k = tl.load(kbase + p[:, None] * HD + d[None, :], mask=kvmask, other=0.0)
        s = _dot(q, tl.trans(k), DOT) * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        valid = (p[None, :] <= pos[:, None]) & pmask[None, :]
        if WINDOW:
            valid = valid & (p[None, :] > pos[:, None] - window)
        s = tl.where(valid, s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        pexp = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        v = tl.load(vbase + p[:, None] * HD + d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + _dot(pexp, v, DOT)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    omask = rmask[:, None] & dmask[None, :]
    tl.store(o_ptr + rows[:, None] * (H * HD) + h * HD + d[None, :], out, mask=omask)
    if WORDS:  # the bf16 copy for the output projection's GEMM (gemm.py; HD a multiple of 32)
        store_words(ow_ptr + rows[:, None] * (H * HD), (h * HD + d)[None, :], out, omask, NW)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             positions: torch.Tensor) -> None:
    """Store the new tokens' K and V (n, hkv, hd) at their positions of the (hkv, n_ctx, hd) caches."""
    n, hkv, hd = k.shape
    _kv_write_kernel[(n, hkv)](k, v, k_cache, v_cache, positions, hkv, hd, k_cache.shape[1],
                               BD=triton.next_power_of_2(hd))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, *,
              scale: float, window: int = 0, softcap: float = 0.0, out: torch.Tensor,
              scratch: DecodeScratch | None = None, exact: bool = False,
              q8: Q8Activation | None = None, words: WordsCopy | None = None) -> torch.Tensor:
    """Attention of q (n, H, hd) over the caches → ``out`` (n, H*hd); one token uses split-KV when given scratch
    (and, with ``q8``, also writes the output there as int8 activations: only where
    :func:`flash_decode.writes_q8`). ``words``: prefill also writes the output there as the GEMM's bf16 operand
    (hd a multiple of 32).

    ``exact``: IEEE fp32 products. Otherwise prefill multiplies on the tensor cores: an fp16 cache (the default
    mode's) in fp16, an fp32 one in tf32 (both round the operands to 10-bit mantissas); decode as its scratch says."""
    if q.shape[0] == 1 and scratch is not None:
        return flash_decode.decode(q, k_cache, v_cache, positions, scale=scale, window=window, softcap=softcap,
                                   out=out, scratch=scratch, q8=q8)
    n, h, hd = q.shape
    hkv, n_ctx, _ = k_cache.shape
    bd = triton.next_power_of_2(hd)
    flags = dict(SOFTCAP=softcap > 0, WINDOW=window > 0)
    half = k_cache.dtype == torch.float16
    bm, bn, warps, stages = PREFILL_TILES[("fp16" if half else "fp32", "wide" if bd > 128 else "narrow")]
    bm = 16 if n <= 16 else bm
    ow, word_flags = WordsCopy.kernel_args(words, out)
    _prefill_attention_kernel[(triton.cdiv(n, bm), h)](q, k_cache, v_cache, positions, out, ow, n, h, hkv, hd,
                                                       n_ctx, scale, softcap or 1.0, window, BM=bm, BN=bn, BD=bd,
                                                       num_warps=warps, num_stages=stages,
                                                       DOT="ieee" if exact else "fp16" if half else "tf32",
                                                       **flags, **word_flags)
    return out
