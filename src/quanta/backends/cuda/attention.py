"""Causal attention over the KV cache: flash attention for prefill, split-KV flash-decoding for one token.

Cache layout: per layer, K and V of ``(n_kv_heads, n_ctx, head_dim)`` float32 (exact against the CPU backend).
Positions are read from device memory, so a captured decode step replays at any position. Query i sees cached
positions p with ``p <= pos_i`` and, with a sliding window w > 0, ``p > pos_i - w``. GQA: query head h reads KV
head ``h // (H / HKV)``; the decode kernel processes all query heads of one KV head together so each K/V tile is
loaded once. Scores: ``q·k * scale``, then ``softcap * tanh(s / softcap)`` when softcap > 0. Decode is one
launch: every split program stores its partial softmax, and the last one of each KV head to finish (an atomic
ticket counter in ``DecodeScratch``) combines them.

Tested under TRITON_INTERPRET=1 against a float64 numpy softmax attention (tests/backends/cuda/test_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


from quanta.backends.cuda.activation import _tanh

_NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity": keeps exp(m_old - m_new) free of inf - inf


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


@triton.jit
def _scores(q, k, scale, softcap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, N, H, HKV, HD, NCTX, scale, softcap, window,
                    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BD: tl.constexpr, PRECISION: tl.constexpr):
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
        s = _scores(q, k, scale, softcap, SOFTCAP, PRECISION)
        valid = (p[None, :] <= pos[:, None]) & pmask[None, :]
        if WINDOW:
            valid = valid & (p[None, :] > pos[:, None] - window)
        s = tl.where(valid, s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        pexp = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        v = tl.load(vbase + p[:, None] * HD + d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pexp, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * (H * HD) + h * HD + d[None, :], out, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, H, HKV, HD, NCTX, NSPLIT,
                   scale, softcap, window, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, GQ: tl.constexpr,
                   GG: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
    """One program: the query heads of KV head ``hk`` against cached positions [sp*SPLIT, (sp+1)*SPLIT).

    Only live splits (those holding a key the query sees) work: each stores its partial (m, l, acc), then draws a
    ticket from the KV head's counter; the one that draws the last ticket combines them all into the output and
    sets the counter back to 0 for the next call. Dead splits exit at once and draw no ticket.
    Launched without programmatic dependent launch: on the H200 it was faster so (docs/PERF.md, GPU run 13)."""
    hk = tl.program_id(0)
    sp = tl.program_id(1)
    group = H // HKV
    pos = tl.load(pos_ptr)
    first = 0
    if WINDOW:
        first = tl.maximum(pos - window + 1, 0) // SPLIT
    last = pos // SPLIT
    if (sp >= first) & (sp <= last):
        gi = tl.arange(0, GQ)
        gmask = gi < group
        h = hk * group + gi
        d = tl.arange(0, BD)
        dmask = d < HD
        q = tl.load(q_ptr + h[:, None] * HD + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        start = sp * SPLIT
        end = tl.minimum(start + SPLIT, pos + 1)
        lo = start
        if WINDOW:
            lo = tl.maximum(start, ((pos - window + 1) // BN) * BN)
        m_i = tl.full([GQ], _NEG, dtype=tl.float32)
        l_i = tl.zeros([GQ], dtype=tl.float32)
        acc = tl.zeros([GQ, BD], dtype=tl.float32)
        kbase = kc_ptr + hk * NCTX * HD
        vbase = vc_ptr + hk * NCTX * HD
        for b in range(lo, end, BN):
            p = b + tl.arange(0, BN)
            valid = p < end
            if WINDOW:
                valid = valid & (p > pos - window)
            kvmask = valid[:, None] & dmask[None, :]
            k = tl.load(kbase + p[:, None] * HD + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(vbase + p[:, None] * HD + d[None, :], mask=kvmask, other=0.0)  # in flight with k
            s = tl.where(valid[None, :], _scores(q, k, scale, softcap, SOFTCAP, "ieee"), _NEG)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            pexp = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(pexp, axis=1)
            acc = acc * alpha[:, None] + tl.dot(pexp, v, input_precision="ieee")
            m_i = m_new
        tl.store(pm_ptr + h * NSPLIT + sp, m_i, mask=gmask)
        tl.store(pl_ptr + h * NSPLIT + sp, l_i, mask=gmask)
        tl.store(po_ptr + (h[:, None] * NSPLIT + sp) * BD + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
        # every thread's partial is written before the ticket (one thread draws it; release at gpu scope)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + hk, 1, sem="acq_rel", scope="gpu")
        if ticket == last - first:
            tl.store(cnt_ptr + hk, 0)
            _combine_splits(po_ptr, pm_ptr, pl_ptr, o_ptr, hk * group, group, first, last, HD, NSPLIT, GG, BS, BD)


@triton.jit
def _combine_splits(po_ptr, pm_ptr, pl_ptr, o_ptr, h0, group, first, last, HD, NSPLIT, GG: tl.constexpr,
                    BS: tl.constexpr, BD: tl.constexpr):
    """Heads [h0, h0 + group): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over splits [first, last].

    The partials come from other programs of this launch: loads bypass L1 (``.cg``), which is not coherent."""
    g = tl.arange(0, GG)
    h = h0 + g
    hmask = g < group
    d = tl.arange(0, BD)
    dmask = d < HD
    m_run = tl.full([GG], _NEG, dtype=tl.float32)
    l_run = tl.zeros([GG], dtype=tl.float32)
    acc = tl.zeros([GG, BD], dtype=tl.float32)
    for s0 in range(first, last + 1, BS):
        s = s0 + tl.arange(0, BS)
        mask = hmask[:, None] & (s <= last)[None, :]
        idx = h[:, None] * NSPLIT + s[None, :]
        m = tl.load(pm_ptr + idx, mask=mask, other=_NEG, cache_modifier=".cg")
        l = tl.load(pl_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg")
        o = tl.load(po_ptr + idx[:, :, None] * BD + d[None, None, :], mask=mask[:, :, None] & dmask[None, None, :],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, axis=1))
        alpha = tl.exp(m_run - m_new)
        w = tl.where(mask, tl.exp(m - m_new[:, None]), 0.0)
        l_run = l_run * alpha + tl.sum(w * l, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(o_ptr + h[:, None] * HD + d[None, :], out, mask=hmask[:, None] & dmask[None, :])


class DecodeScratch:
    """Partial results of the split-KV decode kernel for one (heads, n_ctx, head_dim), allocated once, and one
    ticket counter per head (zero between calls: the kernel's last program of each KV head resets its own)."""

    def __init__(self, n_heads: int, n_ctx: int, head_dim: int, device: torch.device):
        self.split = 64 * max(1, n_ctx // 8192)
        self.nsplit = triton.cdiv(n_ctx, self.split)
        bd = triton.next_power_of_2(head_dim)
        self.o = torch.empty((n_heads, self.nsplit, bd), dtype=torch.float32, device=device)
        self.m = torch.empty((n_heads, self.nsplit), dtype=torch.float32, device=device)
        self.l = torch.empty((n_heads, self.nsplit), dtype=torch.float32, device=device)
        self.count = torch.zeros(n_heads, dtype=torch.int32, device=device)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             positions: torch.Tensor) -> None:
    """Store the new tokens' K and V (n, hkv, hd) at their positions of the (hkv, n_ctx, hd) caches."""
    n, hkv, hd = k.shape
    _kv_write_kernel[(n, hkv)](k, v, k_cache, v_cache, positions, hkv, hd, k_cache.shape[1],
                               BD=triton.next_power_of_2(hd))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, *,
              scale: float, window: int = 0, softcap: float = 0.0, out: torch.Tensor,
              scratch: DecodeScratch | None = None, exact: bool = False) -> torch.Tensor:
    """Attention of q (n, H, hd) over the caches → ``out`` (n, H*hd); one token uses split-KV when given scratch.

    Decode multiplies in IEEE fp32; prefill on tf32 tensor cores unless ``exact``."""
    n, h, hd = q.shape
    hkv, n_ctx, _ = k_cache.shape
    bd = triton.next_power_of_2(hd)
    flags = dict(SOFTCAP=softcap > 0, WINDOW=window > 0)
    if n == 1 and scratch is not None:
        group = triton.next_power_of_2(h // hkv)
        bs = max(1, min(16, 4096 // (group * bd)))  # splits per combine step: a [group, bs, bd] tile
        _decode_kernel[(hkv, scratch.nsplit)](
            q, k_cache, v_cache, positions, out, scratch.o, scratch.m, scratch.l, scratch.count, h, hkv, hd, n_ctx,
            scratch.nsplit, scale, softcap or 1.0, window, GQ=max(16, group), GG=group, SPLIT=scratch.split,
            BN=min(64 if bd <= 128 else 32, scratch.split), BS=bs, BD=bd, num_warps=4, num_stages=2, **flags)
        return out
    # fp32 tiles: wide heads (gemma's 256) get smaller tiles and a 2-deep pipeline to fit shared memory
    bm = 16 if n <= 16 else 64 if bd <= 128 else 32
    bn = 32 if bd > 128 else 64
    _prefill_kernel[(triton.cdiv(n, bm), h)](q, k_cache, v_cache, positions, out, n, h, hkv, hd, n_ctx, scale,
                                             softcap or 1.0, window, BM=bm, BN=bn, BD=bd, num_warps=4,
                                             num_stages=2, PRECISION="ieee" if exact else "tf32", **flags)
    return out
