"""Causal attention over the paged KV pool: varlen flash attention for prefill chunks (each sequence's queries
against its cached prefix and themselves, every sequence of the batch in one launch); a decode batch (one query per
sequence) goes to flash_decode.py.

Pool layout: per layer, K and V of ``(n_kv_heads, n_slots, head_dim)``, float32 (exact against the CPU backend) or
float16 (the default mode: half the bytes per key, read by fp16 tensor-core dots); position p of a sequence sits at
slot ``table[p // B] * B + p % B`` of its block table (``AttentionMetadata``). Positions, slots and tables are read
from device memory, so a captured decode step replays for any batch. Query i sees its sequence's positions p with
``p <= pos_i`` and, with a sliding window w > 0, ``p > pos_i - w``. GQA: query head h reads KV head
``h // (H / HKV)``. Scores: ``q·k * scale``, then ``softcap * tanh(s / softcap)`` when softcap > 0.

Tested under TRITON_INTERPRET=1 against a float64 numpy softmax attention (tests/backends/cuda/test_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.base import AttentionMetadata
from quanta.backends.cuda import flash_decode, pdl
from quanta.backends.cuda.activation import _tanh
from quanta.backends.cuda.flash_decode import _NEG, DecodeScratch, _dot, slot_rows
from quanta.backends.cuda.gemm import WordsCopy, store_words
from quanta.backends.cuda.q8gemv import Q8Activation


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, HKV, HD, NSLOTS, BD: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, BD)
    m = d < HD
    src = (t * HKV + h) * HD + d
    dst = (h * NSLOTS + slot).to(tl.int64) * HD + d
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
def _prefill_attention_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, qs_ptr, bt_ptr, BT_STRIDE, o_ptr, ow_ptr, H, HKV, HD,
                              NSLOTS, scale, softcap, window, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
                              DOT: tl.constexpr, WORDS: tl.constexpr, NW: tl.constexpr):
    """Program (i, h, j): query rows i*BM.. of sequence j's chunk (its tokens query_starts[j] ..
    query_starts[j+1] - 1, in position order) for head h, against the sequence's keys through its block table."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    first = tl.load(qs_ptr + j)
    end = tl.load(qs_ptr + j + 1)
    if first + pid_m * BM < end:
        _prefill_tile(q_ptr, kc_ptr, vc_ptr, pos_ptr, bt_ptr + j * BT_STRIDE, o_ptr, ow_ptr, first + pid_m * BM, end,
                      h, H, HKV, HD, NSLOTS, scale, softcap, window, SOFTCAP, WINDOW, BM, BN, BD, BLOCK, DOT, WORDS,
                      NW)


@triton.jit
def _prefill_tile(q_ptr, kc_ptr, vc_ptr, pos_ptr, table, o_ptr, ow_ptr, row0, end, h, H, HKV, HD, NSLOTS, scale,
                  softcap, window, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BD: tl.constexpr, BLOCK: tl.constexpr, DOT: tl.constexpr, WORDS: tl.constexpr, NW: tl.constexpr):
    """Query rows row0 .. row0+BM-1 (those below ``end``) of head h: an online softmax over their keys."""
    hk = h // (H // HKV)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < end
    pos = tl.load(pos_ptr + rows, mask=rmask, other=-1)
    d = tl.arange(0, BD)
    dmask = d < HD
    q = tl.load(q_ptr + (rows[:, None] * H + h) * HD + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    hi = tl.max(pos, axis=0) + 1
    lo = 0
    if WINDOW:
        lo = tl.maximum(tl.min(tl.where(rmask, pos, hi), axis=0) - window + 1, 0)
        lo = (lo // BN) * BN
    m_i = tl.full([BM], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for start in range(lo, hi, BN):
        p = start + tl.arange(0, BN)
        pmask = p < hi
        kvmask = pmask[:, None] & dmask[None, :]
        offs = slot_rows(table, p, pmask, hk, NSLOTS, HD, BLOCK)[:, None] + d[None, :]
        k = tl.load(kc_ptr + offs, mask=kvmask, other=0.0)
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
        v = tl.load(vc_ptr + offs, mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + _dot(pexp, v, DOT)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    omask = rmask[:, None] & dmask[None, :]
    tl.store(o_ptr + rows[:, None] * (H * HD) + h * HD + d[None, :], out, mask=omask)
    if WORDS:  # the bf16 copy for the output projection's GEMM (gemm.py; HD a multiple of 32)
        store_words(ow_ptr + rows[:, None] * (H * HD), (h * HD + d)[None, :], out, omask, NW)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             pdl_on: bool = False) -> None:
    """Store the new tokens' K and V (n, hkv, hd) at their ``slots`` of the (hkv, n_slots, hd) pools."""
    n, hkv, hd = k.shape
    _kv_write_kernel[(n, hkv)](k, v, k_cache, v_cache, slots, hkv, hd, k_cache.shape[1],
                               BD=triton.next_power_of_2(hd), **pdl.launch(pdl_on))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
              scale: float, window: int = 0, softcap: float = 0.0, out: torch.Tensor,
              scratch: DecodeScratch | None = None, exact: bool = False, q8: Q8Activation | None = None,
              words: WordsCopy | None = None, pdl_on: bool = False) -> torch.Tensor:
    """Attention of q (n, H, hd), placed by ``meta``, over the pools → ``out`` (n, H*hd). A decode batch
    (``meta.max_query_len == 1``) given scratch takes split-KV flash decoding (and, with ``q8``, also writes the
    output there as int8 activations: only where :func:`flash_decode.writes_q8`). ``words``: prefill also writes
    the output there as the GEMM's bf16 operand (hd a multiple of 32).

    ``exact``: IEEE fp32 products. Otherwise prefill multiplies on the tensor cores: an fp16 cache (the default
    mode's) in fp16, an fp32 one in tf32 (both round the operands to 10-bit mantissas); decode as its scratch says."""
    tables = meta.block_tables
    if meta.max_query_len == 1 and scratch is not None:
        return flash_decode.decode(q, k_cache, v_cache, meta.positions, meta.token_seq, tables, meta.block_size,
                                   scale=scale, window=window, softcap=softcap, out=out, scratch=scratch, q8=q8,
                                   pdl_on=pdl_on)
    n, h, hd = q.shape
    hkv, n_slots, _ = k_cache.shape
    bd = triton.next_power_of_2(hd)
    flags = dict(SOFTCAP=softcap > 0, WINDOW=window > 0)
    half = k_cache.dtype == torch.float16
    bm, bn, warps, stages = PREFILL_TILES[("fp16" if half else "fp32", "wide" if bd > 128 else "narrow")]
    bm = 16 if meta.max_query_len <= 16 else bm
    ow, word_flags = WordsCopy.kernel_args(words, out)
    grid = (triton.cdiv(meta.max_query_len, bm), h, meta.n_seqs)
    _prefill_attention_kernel[grid](q, k_cache, v_cache, meta.positions, meta.query_starts, tables, tables.stride(0),
                                    out, ow, h, hkv, hd, n_slots, scale, softcap or 1.0, window, BM=bm, BN=bn, BD=bd,
                                    BLOCK=meta.block_size, num_warps=warps, num_stages=stages,
                                    DOT="ieee" if exact else "fp16" if half else "tf32", **flags, **word_flags)
    return out
