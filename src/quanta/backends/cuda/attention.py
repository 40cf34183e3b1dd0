"""Causal attention over the paged KV pool: varlen flash attention for prefill chunks (each sequence's queries
against its cached prefix and themselves, every sequence of the batch in one launch); a decode batch (one query per
sequence) goes to flash_decode.py.

Pool layout: per layer, K and V of ``(n_kv_heads, n_slots, head_dim)``, float32 (exact against the CPU backend) or
float16 (the default mode: half the bytes per key, read by fp16 tensor-core dots), or int8 codes with scales
(``--kv-type q8``: dequantized into fp16 tiles; kv_q8.py); position p of a sequence sits at
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
from quanta.backends.cuda import flash_decode, kv_q8, pdl
from quanta.backends.cuda.activation import _tanh
from quanta.backends.cuda.flash_decode import _NEG, DecodeScratch, _dot, pool_rows, slot_index
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
def _prefill_attention_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, r_ptr, pos_ptr, qs_ptr, bt_ptr, BT_STRIDE, o_ptr,
                              ow_ptr, H, HKV, HD, NSLOTS, scale, softcap, window, SOFTCAP: tl.constexpr,
                              WINDOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                              BLOCK: tl.constexpr, DOT: tl.constexpr, WORDS: tl.constexpr, NW: tl.constexpr,
                              KV8: tl.constexpr):
    """Program (i, h, j): query rows i*BM.. of sequence j's chunk (its tokens query_starts[j] ..
    query_starts[j+1] - 1, in position order) for head h, against the sequence's keys through its block table."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    first = tl.load(qs_ptr + j)
    end = tl.load(qs_ptr + j + 1)
    if first + pid_m * BM < end:
        _prefill_tile(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, r_ptr, pos_ptr, bt_ptr + j * BT_STRIDE, o_ptr, ow_ptr,
                      first + pid_m * BM, end, h, H, HKV, HD, NSLOTS, scale, softcap, window, SOFTCAP, WINDOW, BM, BN,
                      BD, BLOCK, DOT, WORDS, NW, KV8)


@triton.jit
def _prefill_tile(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, r_ptr, pos_ptr, table, o_ptr, ow_ptr, row0, end, h, H, HKV,
                  HD, NSLOTS, scale, softcap, window, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, DOT: tl.constexpr, WORDS: tl.constexpr,
                  NW: tl.constexpr, KV8: tl.constexpr):
    """Query rows row0 .. row0+BM-1 (those below ``end``) of head h: an online softmax over their keys (KV8: the
    int8 pool's, q rotated, the output rotated back; kv_q8.py)."""
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
        slots = slot_index(table, p, pmask, hk, NSLOTS, BLOCK)
        k = pool_rows(kc_ptr, ks_ptr, slots, kvmask, d, HD, KV8, False, DOT)
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
        v = pool_rows(vc_ptr, vs_ptr, slots, kvmask, d, HD, KV8, False, DOT)
        acc = acc * alpha[:, None] + _dot(pexp, v, DOT)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV8:
        e = tl.arange(0, 32)
        for c in tl.static_range(0, BD, 32):
            _store_rows(kv_q8.unrotated(out, r_ptr, c, BD, DOT == "half"), rows, h * HD + c + e, rmask[:, None], o_ptr,
                        ow_ptr, H, HD, WORDS, NW)
    else:
        _store_rows(out, rows, h * HD + d, rmask[:, None] & dmask[None, :], o_ptr, ow_ptr, H, HD, WORDS, NW)


@triton.jit
def _store_rows(out, rows, cols, mask, o_ptr, ow_ptr, H, HD, WORDS: tl.constexpr, NW: tl.constexpr):
    """Columns ``cols`` of the output ``rows``; WORDS: also the bf16 copy for the output projection's GEMM (gemm.py;
    HD a multiple of 32)."""
    tl.store(o_ptr + rows[:, None] * (H * HD) + cols[None, :], out, mask=mask)
    if WORDS:
        store_words(ow_ptr + rows[:, None] * (H * HD), cols[None, :], out, mask, NW)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             pdl_on: bool = False) -> None:
    """Store the new tokens' K and V (n, hkv, hd) at their ``slots`` of the (hkv, n_slots, hd) pools."""
    n, hkv, hd = k.shape
    _kv_write_kernel[(n, hkv)](k, v, k_cache, v_cache, slots, hkv, hd, k_cache.shape[1],
                               BD=triton.next_power_of_2(hd), **pdl.launch(pdl_on))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
              scale: float, window: int = 0, softcap: float = 0.0, out: torch.Tensor,
              scratch: DecodeScratch | None = None, exact: bool = False, q8: Q8Activation | None = None,
              words: WordsCopy | None = None, int8: kv_q8.Int8Layer | None = None,
              pdl_on: bool = False) -> torch.Tensor:
    """Attention of q (n, H, hd), placed by ``meta``, over the pools → ``out`` (n, H*hd) (``int8``: the pools are
    that int8 layer's codes, and q is rotated: kv_q8.write). A decode batch (``meta.max_query_len == 1``: token i
    is sequence i) given scratch takes split-KV flash decoding (and, with ``q8``, also writes the output there as
    int8 activations: only where :func:`flash_decode.writes_q8`). ``words``: prefill also writes
    the output there as the GEMM's bf16 operand (hd a multiple of 32).

    ``exact``: IEEE fp32 products. Otherwise prefill multiplies on the tensor cores: an fp16 cache (the default
    mode's) in fp16, an fp32 one in tf32 (both round the operands to 10-bit mantissas); decode as its scratch says."""
    tables = meta.block_tables
    if meta.max_query_len == 1 and scratch is not None:
        return flash_decode.decode(q, k_cache, v_cache, meta.positions, tables, meta.block_size,
                                   scale=scale, window=window, softcap=softcap, out=out, scratch=scratch, q8=q8,
                                   int8=int8, pdl_on=pdl_on, fresh=meta.fresh)
    n, h, hd = q.shape
    hkv, n_slots, _ = k_cache.shape
    bd = triton.next_power_of_2(hd)
    flags = dict(SOFTCAP=softcap > 0, WINDOW=window > 0)
    half = k_cache.dtype in (torch.float16, torch.int8)  # int8 codes are dequantized into fp16 tiles
    bm, bn, warps, stages = PREFILL_TILES[("fp16" if half else "fp32", "wide" if bd > 128 else "narrow")]
    bm = 16 if meta.max_query_len <= 16 else bm
    ow, word_flags = WordsCopy.kernel_args(words, out)
    grid = (triton.cdiv(meta.max_query_len, bm), h, meta.n_seqs)
    extra = (int8.k_scale, int8.v_scale, int8.rotation) if int8 is not None else (k_cache, k_cache, k_cache)
    _prefill_attention_kernel[grid](q, k_cache, v_cache, *extra, meta.positions, meta.query_starts, tables,
                                    tables.stride(0), out, ow, h, hkv, hd, n_slots, scale, softcap or 1.0, window,
                                    BM=bm, BN=bn, BD=bd, BLOCK=meta.block_size, num_warps=warps, num_stages=stages,
                                    DOT="ieee" if exact else "half" if half else "tf32", KV8=int8 is not None,
                                    **flags, **word_flags)
    return out
