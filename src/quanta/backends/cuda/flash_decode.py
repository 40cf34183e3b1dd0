"""Split-KV flash-decoding over the paged KV pool: attention of a batch of new tokens, one per sequence (a decode
batch), over each one's sequence, in one launch.

A fixed grid of chunk programs per (token, KV head). A position up to one chunk deep is one program per KV head that
writes the output itself; deeper, every live chunk stores its partial softmax, and one program per (token, KV head)
combines them: either the last to finish (an atomic ticket counter in ``DecodeScratch``, after a release fence), or
the program of the last chunk, which polls the partial slots until none holds the NaN they are reset to (no fence,
no atomic). The K/V rows of a tile of BN positions are gathered through the token's block table (position p at slot
``table[p // B] * B + p % B``); the more tokens a batch has, the fewer chunk programs each gets (``DecodeScratch``).

Tested under TRITON_INTERPRET=1 against a float64 numpy softmax attention (tests/backends/cuda/test_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import kv_q8, pdl
from quanta.backends.cuda.activation import _tanh
from quanta.backends.cuda.q8gemv import Q8Activation, store_q8, store_q8_rows

_NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity": keeps exp(m_old - m_new) free of inf - inf
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b accumulated in fp32: "ieee" on the FMA units (exact fp32), "tf32" or "half" (fp16) on the tensor
    cores (both round the operands to 10-bit mantissas; "half" reads an fp16 cache without a conversion). Not
    "fp16": Triton's kernel preloading reads a string constexpr that names a dtype as that dtype
    (compile_ahead.py)."""
    if DOT == "half":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT)


@triton.jit
def pool_row(blk, p, hk, NSLOTS, BLOCK: tl.constexpr):
    """Row indices (int64) in a (hkv, n_slots, ·) pool of positions ``p`` ([BN]) in blocks ``blk`` (their block
    table entries), for KV head ``hk``."""
    return (hk * NSLOTS + blk * BLOCK + p % BLOCK).to(tl.int64)


@triton.jit
def slot_index(table, p, valid, hk, NSLOTS, BLOCK: tl.constexpr):
    """Row indices (int64) in a (hkv, n_slots, ·) pool of positions ``p`` ([BN]) of the sequence whose block table
    starts at ``table``, for KV head ``hk`` (``valid``: the positions to look up)."""
    return pool_row(tl.load(table + p // BLOCK, mask=valid, other=0), p, hk, NSLOTS, BLOCK)


@triton.jit
def pool_rows(c_ptr, s_ptr, rows, mask, d, HD, KV8: tl.constexpr, CG: tl.constexpr, DOT: tl.constexpr):
    """The pool rows ``rows`` ([BN] int64) as a [BN, BD] tile (``mask``ed: 0): as stored, or with KV8 the int8
    pool's codes times their scales (at ``s_ptr``; kv_q8.py; in fp16 for fp16 dots). CG: loads past L1 (``.cg``)."""
    if KV8:
        x = kv_q8.dequantized(c_ptr, s_ptr, rows, d, mask, HD, CG, DOT == "half")
    elif CG:
        x = tl.load(c_ptr + rows[:, None] * HD + d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(c_ptr + rows[:, None] * HD + d[None, :], mask=mask, other=0.0)
    return x


@triton.jit
def kv_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, rows, mask, d, HD, KV8: tl.constexpr, CG: tl.constexpr,
            DOT: tl.constexpr):
    """The K and V pool rows ``rows`` as [BN, BD] tiles (pool_rows)."""
    return (pool_rows(kc_ptr, ks_ptr, rows, mask, d, HD, KV8, CG, DOT),
            pool_rows(vc_ptr, vs_ptr, rows, mask, d, HD, KV8, CG, DOT))


@triton.jit
def _kv_tile(kc_ptr, vc_ptr, ks_ptr, vs_ptr, table, hk, NSLOTS, p, pos, lo, d, dmask, HD, BLOCK: tl.constexpr,
             KV8: tl.constexpr, DOT: tl.constexpr):
    """The K and V rows of positions ``p`` ([BN]; masked outside [lo, pos]) as [BN, BD] tiles."""
    valid = (p <= pos) & (p >= lo)
    rows = slot_index(table, p, valid, hk, NSLOTS, BLOCK)
    return kv_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, rows, valid[:, None] & dmask[None, :], d, HD, KV8, False, DOT)


@triton.jit
def _with_new_row(k, v, kc_ptr, vc_ptr, ks_ptr, vs_ptr, rows, p, pos, d, dmask, HD, KV8: tl.constexpr,
                  DOT: tl.constexpr, FRESH: tl.constexpr = 1):
    """The tiles ``k``, ``v`` (pool rows ``rows`` of positions ``p``) with the rows of the ``FRESH`` positions up to
    ``pos`` read again: the kernel before this one may just have written them (read past L1, which may still hold
    what this program read before its wait). FRESH > 1: a verify step's rows as decode rows, each reading the keys
    its drafts before it stored."""
    if FRESH == 1:
        new = p == pos
    else:
        new = (p <= pos) & (p > pos - FRESH)
    rmask = new[:, None] & dmask[None, :]
    nk, nv = kv_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, rows, rmask, d, HD, KV8, True, DOT)
    return tl.where(rmask, nk, k), tl.where(rmask, nv, v)


@triton.jit
def _attend_tile(q, k, v, p, pos, lo, m_i, l_i, acc, softcap, SOFTCAP: tl.constexpr, DOT: tl.constexpr):
    """One online-softmax step of q against the K/V tile of positions ``p`` (scores in log2 units)."""
    s = _dot(q, tl.trans(k), DOT)
    if SOFTCAP:
        s = (softcap * _LOG2E) * _tanh(s / softcap)
    s = tl.where(((p <= pos) & (p >= lo))[None, :], s, _NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # every tile holds a visible key, so m_new > _NEG
    alpha = tl.exp2(m_i - m_new)
    pexp = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(pexp, axis=1), acc * alpha[:, None] + _dot(pexp, v, DOT)


@triton.jit
def _decode_attention_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, r_ptr, pos_ptr, bt_ptr, BT_STRIDE,
                             o_ptr, oq_ptr, od_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, H, HKV, HD, NSLOTS,
                             NSPLIT: tl.constexpr, NPROG, scale, softcap, window, SOFTCAP: tl.constexpr,
                             WINDOW: tl.constexpr, G: tl.constexpr, GC: tl.constexpr, MINB: tl.constexpr,
                             SOLO: tl.constexpr, BN: tl.constexpr,
                             NS: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
                             SKIP: tl.constexpr, Q8: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr,
                             POLL: tl.constexpr, KV8: tl.constexpr, FRESH: tl.constexpr):
    """Program (hk, c, t): the G query heads of KV head ``hk`` of token t (G = the group rounded up to a power of
    two, and to 16 for tensor-core dots) against chunk c of its visible keys, in BN-key tiles. Token t is sequence t
    (row t of the block tables).

    The visible keys [lo, pos] (lo > 0 only with a window) are cut into ``nlive`` chunks of ``per`` tiles, per =
    max(MINB, ceil(tiles / NPROG)), or all of them up to SOLO tiles: shallow positions get one chunk per KV head,
    which writes the output directly (no partials, no ticket); deeper ones spread over up to NPROG programs, whose
    partials the last to draw a ticket combines, or with POLL the last chunk's program (GC: the group rounded up to
    a power of two, and to 16 with KV8). KV8: the pools are int8 codes with scales at ``ks_ptr``/``vs_ptr`` and q
    is rotated; outputs are rotated back by the matrix at ``r_ptr`` (kv_q8.py). Scores and the stored partial
    maxima are in log2 units (scale * log2(e) folded into q) so the softmax uses exp2. Programs past ``nlive`` exit
    at once.

    POLL needs no signal between programs: the last chunk's program waits for the others without deadlock because
    they never wait (programs are dispatched in order of c, and under PDL the next kernel launches only once every
    program of this one has started).

    PDL: the next kernel (the output projection) may launch at once and load its weights while this one runs; and this
    one, launched early, loads the position, the block table and its chunk's first K/V tile before it waits for the
    Q/K/V projection (the first tile's block numbers beside the position, for the tile where the chunk starts at shallow
    positions, read again only if the position puts the start elsewhere): keys before ``pos`` come from earlier
    forwards, finished (every forward starts after the host→device copy of its inputs, which waits for all work queued
    before it, also when the engine queues a step before reading the last one's tokens), so only the row at ``pos`` (the
    key the projection just stored) is read again after the wait, not its whole tile (GPU run 174: +0.4 to +3.2% at
    depth 1,024); q too. FRESH > 1: the last FRESH rows up to ``pos`` are read again (verify steps replayed as decode
    rows, whose rows read the keys stored by the rows of their drafts before them in the same forward)."""
    pdl.allow_next(PDL)
    hk = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.program_id(2)
    group = H // HKV
    gi = tl.arange(0, G)
    gmask = gi < group
    h = hk * group + gi
    d = tl.arange(0, BD)
    dmask = d < HD
    pos = tl.load(pos_ptr + t)  # the metadata is written by the host before the step: safe before waiting
    table = bt_ptr + t * BT_STRIDE
    guess = c * MINB * BN  # where the chunk starts while per == MINB and lo == 0
    p = guess + tl.arange(0, BN)
    blk = tl.load(table + p // BLOCK, mask=p < BT_STRIDE * BLOCK, other=0)
    lo = 0
    if WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    tiles = pos // BN + 1 - lo // BN
    per = tl.maximum(MINB, tl.cdiv(tiles, NPROG))
    if tiles <= SOLO:
        per = tiles
    nlive = tl.cdiv(tiles, per)
    if c < nlive:
        start = (lo // BN + c * per) * BN
        end = tl.minimum(start + per * BN, pos + 1)
        m_i = tl.full([G], _NEG, dtype=tl.float32)
        l_i = tl.zeros([G], dtype=tl.float32)
        acc = tl.zeros([G, BD], dtype=tl.float32)
        p = start + tl.arange(0, BN)
        valid = (p <= pos) & (p >= lo)
        if start != guess:
            blk = tl.load(table + p // BLOCK, mask=valid, other=0)
        rows = pool_row(blk, p, hk, NSLOTS, BLOCK)
        k, v = kv_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, rows, valid[:, None] & dmask[None, :], d, HD, KV8, False, DOT)
        pdl.wait_prev(PDL)
        if FRESH == 1:
            fresh_tile = start + BN > pos
        else:
            fresh_tile = start + BN > pos - (FRESH - 1)
        if fresh_tile:
            k, v = _with_new_row(k, v, kc_ptr, vc_ptr, ks_ptr, vs_ptr, rows, p, pos, d, dmask, HD, KV8, DOT, FRESH)
        q = tl.load(q_ptr + (t * H + h)[:, None] * HD + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        if SOFTCAP:
            q = q * scale
        else:
            q = q * (scale * _LOG2E)
        m_i, l_i, acc = _attend_tile(q, k, v, p, pos, lo, m_i, l_i, acc, softcap, SOFTCAP, DOT)
        for b in range(start + BN, end, BN):
            p = b + tl.arange(0, BN)
            k, v = _kv_tile(kc_ptr, vc_ptr, ks_ptr, vs_ptr, table, hk, NSLOTS, p, pos, lo, d, dmask, HD, BLOCK, KV8,
                            DOT)
            m_i, l_i, acc = _attend_tile(q, k, v, p, pos, lo, m_i, l_i, acc, softcap, SOFTCAP, DOT)
        h0 = t * H + hk * group  # the first head's row in the (tokens x heads) output and partials
        if nlive == 1:
            _store_out(acc / l_i[:, None], o_ptr, oq_ptr, od_ptr, r_ptr, h0, group, HD, G, BD, Q8, KV8)
        else:
            hp = h0 + gi
            tl.store(pm_ptr + hp * NSPLIT + c, m_i, mask=gmask)
            tl.store(pl_ptr + hp * NSPLIT + c, l_i, mask=gmask)
            tl.store(po_ptr + (hp[:, None] * NSPLIT + c) * BD + d[None, :], acc,
                     mask=gmask[:, None] & dmask[None, :])
            if POLL:
                if c == nlive - 1:
                    _combine_poll(po_ptr, pm_ptr, pl_ptr, o_ptr, oq_ptr, od_ptr, r_ptr, h0, group, nlive, HD,
                                  NSPLIT, GC, NS, BD, Q8, KV8)
            else:
                # every thread's partial is written before the ticket (one thread draws it; release at gpu scope)
                tl.debug_barrier()
                counter = cnt_ptr + t * HKV + hk
                ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if ticket == nlive - 1:
                    tl.store(counter, 0)
                    _combine_splits(po_ptr, pm_ptr, pl_ptr, o_ptr, oq_ptr, od_ptr, r_ptr, h0, group, nlive - 1,
                                    HD, NSPLIT, GC, NS, BS, BD, SKIP, Q8, KV8)


@triton.jit
def _combine_splits(po_ptr, pm_ptr, pl_ptr, o_ptr, oq_ptr, od_ptr, r_ptr, h0, group, last, HD, NSPLIT,
                    GG: tl.constexpr, NS: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, SKIP: tl.constexpr,
                    Q8: tl.constexpr, KV8: tl.constexpr):
    """Heads [h0, h0 + group): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over splits [0, last].

    M (the maximum of the partial maxima) comes first, so the NS / BS steps of the sum are independent (unrolled);
    SKIP: steps past the live splits are skipped (a runtime branch). The partials come from other programs of this
    launch: loads bypass L1 (``.cg``), which is not coherent."""
    g = tl.arange(0, GG)
    h = h0 + g
    hmask = g < group
    d = tl.arange(0, BD)
    dmask = d < HD
    s = tl.arange(0, NS)
    mask = hmask[:, None] & (s <= last)[None, :]
    m_max = tl.max(tl.load(pm_ptr + h[:, None] * NSPLIT + s[None, :], mask=mask, other=_NEG, cache_modifier=".cg"),
                   axis=1)
    l_sum, acc = _combine_step(po_ptr, pm_ptr, pl_ptr, h, hmask, d, dmask, m_max, last, 0, NSPLIT, BS, BD)
    for s0 in tl.static_range(BS, NS, BS):
        live = True  # SKIP: a step past the live splits is skipped, not run with every load masked
        if SKIP:
            live = s0 <= last
        if live:
            dl, da = _combine_step(po_ptr, pm_ptr, pl_ptr, h, hmask, d, dmask, m_max, last, s0, NSPLIT, BS, BD)
            l_sum += dl
            acc += da
    _store_out(acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None], o_ptr, oq_ptr, od_ptr, r_ptr, h0, group, HD, GG, BD,
               Q8, KV8)


@triton.jit
def _combine_poll(po_ptr, pm_ptr, pl_ptr, o_ptr, oq_ptr, od_ptr, r_ptr, h0, group, nlive, HD, NSPLIT: tl.constexpr,
                  GG: tl.constexpr, NS: tl.constexpr, BD: tl.constexpr, Q8: tl.constexpr, KV8: tl.constexpr):
    """_combine_splits in one step, without a fence: the partial slots hold NaN until their program's stores land
    (the scratch starts so, and this resets the slots it read), so the sums come out NaN until every live partial
    is in: read again. Triton may load m once per layout it is used in, each copy at its own moment, so its maximum
    keeps NaN: a copy that missed a partial makes the sums NaN instead of scaling them by another maximum. At most
    1,000 reads: partials NaN by themselves (an inf in the cache) give a NaN output, not a hang."""
    g = tl.arange(0, GG)
    s = tl.arange(0, NS)
    d = tl.arange(0, BD)
    hmask = g < group
    dmask = d < HD
    live = hmask[:, None] & (s < nlive)[None, :]
    idx = (h0 + g)[:, None] * NSPLIT + s[None, :]
    omask = live[:, :, None] & dmask[None, None, :]
    acc = tl.zeros([GG, BD], dtype=tl.float32)
    l_sum = tl.zeros([GG], dtype=tl.float32)
    missing = 1
    tries = 0
    while (missing > 0) & (tries < 1000):
        m = tl.load(pm_ptr + idx, mask=live, other=_NEG, volatile=True)
        ls = tl.load(pl_ptr + idx, mask=live, other=0.0, volatile=True)
        o = tl.load(po_ptr + idx[:, :, None] * BD + d[None, None, :], mask=omask, other=0.0, volatile=True)
        w = tl.exp2(m - tl.reduce(m, 1, _max_keep_nan)[:, None])
        l_sum = tl.sum(w * ls, axis=1)
        acc = tl.sum(w[:, :, None] * o, axis=1)
        missing = (tl.sum(tl.where(hmask[:, None] & dmask[None, :] & _is_nan(acc), 1, 0))
                   + tl.sum(tl.where(hmask & _is_nan(l_sum), 1, 0)))
        tries += 1
    _store_out(acc / l_sum[:, None], o_ptr, oq_ptr, od_ptr, r_ptr, h0, group, HD, GG, BD, Q8, KV8)
    tl.debug_barrier()  # every thread has read the partials before they are reset
    nan = float("nan")
    tl.store(pm_ptr + idx, tl.full([GG, NS], nan, tl.float32), mask=live)
    tl.store(pl_ptr + idx, tl.full([GG, NS], nan, tl.float32), mask=live)
    tl.store(po_ptr + idx[:, :, None] * BD + d[None, None, :], tl.full([GG, NS, BD], nan, tl.float32), mask=omask)


@triton.jit
def _max_keep_nan(a, b):
    """max that returns NaN if either operand is (tl.max drops NaN)."""
    return tl.where(_is_nan(a) | (a > b), a, b)


@triton.jit
def _is_nan(x):
    return x != x  # noqa: PLR0124 (the NaN test; Triton's core language has no isnan)


@triton.jit
def _combine_step(po_ptr, pm_ptr, pl_ptr, h, hmask, d, dmask, m_max, last, s0, NSPLIT, BS: tl.constexpr,
                  BD: tl.constexpr):
    """Splits s0 .. s0+BS-1 of the combine: their sum of 2^(m_s - M) l_s ([GG]) and of 2^(m_s - M) acc_s ([GG, BD])."""
    sb = s0 + tl.arange(0, BS)
    mask = hmask[:, None] & (sb <= last)[None, :]
    idx = h[:, None] * NSPLIT + sb[None, :]
    m = tl.load(pm_ptr + idx, mask=mask, other=_NEG, cache_modifier=".cg")
    ls = tl.load(pl_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg")
    o = tl.load(po_ptr + idx[:, :, None] * BD + d[None, None, :], mask=mask[:, :, None] & dmask[None, None, :],
                other=0.0, cache_modifier=".cg")
    w = tl.where(mask, tl.exp2(m - m_max[:, None]), 0.0)
    return tl.sum(w * ls, axis=1), tl.sum(w[:, :, None] * o, axis=1)


@triton.jit
def _store_out(out, o_ptr, oq_ptr, od_ptr, r_ptr, h0, group, HD, G: tl.constexpr, BD: tl.constexpr, Q8: tl.constexpr,
               KV8: tl.constexpr):
    """Store the [G, BD] outputs of heads h0 .. h0+group-1 (rows of the flat (tokens x heads, hd) output; rows past
    ``group`` are padding); Q8: also as int8 activations for the output projection (q8gemv.py; needs BD == HD, so
    the heads are one contiguous run). KV8: ``out`` is in the int8 pool's rotated basis, rotated back by the matrix
    at ``r_ptr`` 32 columns at a time (kv_q8.py; G >= 16, BD == HD; 1: in IEEE fp32, 2: on tf32 tensor cores)."""
    g = tl.arange(0, G)
    if KV8:
        e = tl.arange(0, 32)
        for c in tl.static_range(0, BD, 32):
            oc = kv_q8.unrotated(out, r_ptr, c, BD, KV8 == 2)
            tl.store(o_ptr + (h0 + g)[:, None] * HD + c + e[None, :], oc, mask=(g < group)[:, None])
            if Q8:
                store_q8_rows(oc, ((h0 + g) * HD + c) // 32, g < group, oq_ptr, od_ptr)
    else:
        d = tl.arange(0, BD)
        tl.store(o_ptr + (h0 + g)[:, None] * HD + d[None, :], out, mask=(g < group)[:, None] & (d < HD)[None, :])
        if Q8:
            store_q8(tl.reshape(out, [G * BD]), h0 * HD, group * HD, oq_ptr, od_ptr, G * BD)


def writes_q8(head_dim: int) -> bool:
    """Whether the decode kernel can also write its output as int8 activations (``attention(q8=...)``)."""
    return head_dim % 32 == 0 and head_dim == triton.next_power_of_2(head_dim)


PROGRAMS = 512  # chunk programs a decode launch aims at (about four per multiprocessor): fewer per token in batches


class DecodeScratch:
    """Partial results of the decode kernel for up to ``n_tokens`` tokens of ``n_heads`` heads, allocated once, and
    one ticket counter per (token, KV head) (zero between calls: the kernel's last program of each resets its own);
    with the kernel's configuration.

    At least ``chunk`` keys per program, and positions up to ``solo`` keys deep in one program (no combine); at
    most ``max_programs`` programs per (token, KV head), fewer in batches (about PROGRAMS in all), and no more than
    ``max_keys`` (the longest sequence) needs (deeper positions get longer chunks, so the combine stays short);
    ``warps`` warps each; K and V tiles of ``tile_kb`` KB each; ``dot``: how scores and p·V are multiplied
    (``_dot``); ``poll``: the last chunk combines, polling (``_combine_poll``; the partials start as NaN), instead
    of the last to draw a ticket. Defaults from the H200 sweeps of scripts/gpu_attn.py and the decode loop: chunk
    64 keys at head dim 64, 32 above; on tensor cores, 8 warps and solo 128 at head dim 128 (and polling there),
    8 warps at 256."""

    def __init__(self, n_tokens: int, n_heads: int, n_kv_heads: int, max_keys: int, head_dim: int,
                 device: torch.device, *, chunk: int | None = None, max_programs: int = 32, warps: int | None = None,
                 solo: int | None = None, dot: str = "ieee", tile_kb: int = 16, poll: bool | None = None):
        self.tile_kb = tile_kb
        tensor_cores = dot != "ieee"
        self.chunk = chunk or (64 if head_dim <= 64 else 32)
        self.solo = (128 if tensor_cores and head_dim == 128 else 0) if solo is None else solo
        self.warps = warps or (8 if tensor_cores and head_dim > 64 else 4)
        # the combine skips its dead steps with 4 warps; at 8 (head dim 128) the branch cut the kernel from 171 to
        # 128 registers and decode at depth 1,024 lost 10% (GPU journal, run 48)
        self.skip = self.warps == 4
        self.dot = dot
        # programs and partial slots rounded up to a power of two: (hkv, 19) -> (hkv, 32) at the bench's n_ctx of
        # 1,160 made depth 1,024 1.7 / 0.8% faster on TinyLlama / Llama-3.2 (GPU run 193; dead programs exit at once)
        share = max(1, 1 << max(0, (PROGRAMS // (n_tokens * n_kv_heads)).bit_length() - 1))
        self.nprog = min(triton.next_power_of_2(triton.cdiv(max_keys, self.chunk)), max_programs, share)
        # polling: Qwen2.5 at depth 1,024 1,115 -> 1,165 tok/s (GPU run 66); slower per call at head dims 64 and 256
        self.poll = tensor_cores and head_dim == 128 if poll is None else poll
        bd = max(16, triton.next_power_of_2(head_dim))
        rows = n_tokens * n_heads
        self.n_tokens = n_tokens
        self.o = torch.full((rows, self.nprog, bd), float("nan"), dtype=torch.float32, device=device)
        self.m = torch.full((rows, self.nprog), float("nan"), dtype=torch.float32, device=device)
        self.l = torch.full((rows, self.nprog), float("nan"), dtype=torch.float32, device=device)
        self.count = torch.zeros(n_tokens * n_kv_heads, dtype=torch.int32, device=device)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
           block_tables: torch.Tensor, block_size: int, *, scale: float, window: int,
           softcap: float, out: torch.Tensor, scratch: DecodeScratch, q8: Q8Activation | None,
           int8: kv_q8.Int8Layer | None = None, pdl_on: bool = False, fresh: int = 1) -> torch.Tensor:
    """Attention of n tokens' q (n, H, hd), token i at ``positions[i]`` of sequence i (row i of ``block_tables``), over
    the pools (hkv, n_slots, hd) → ``out`` (n, H*hd), and its int8 copy into ``q8``. ``int8``: the pools are that int8
    layer's codes (q already rotated: kv_q8.write). ``fresh``: how many of each token's last positions the same forward
    stored (AttentionMetadata.fresh)."""
    n, h, hd = q.shape
    hkv, n_slots, _ = k_cache.shape
    assert n <= scratch.n_tokens and block_tables.stride(1) == 1
    group = triton.next_power_of_2(h // hkv)
    bd = max(16, triton.next_power_of_2(hd))
    # keys per K (or V) tile; int8 codes are dequantized into tiles as large as fp16 ones
    bn = max(16, scratch.tile_kb * 1024 // (bd * max(2, k_cache.element_size())))
    assert q8 is None or writes_q8(hd)
    qargs = (q8.q, q8.d) if q8 is not None else (out, out)
    nsplit = scratch.m.shape[1]
    ns = triton.next_power_of_2(nsplit)
    gc = max(16, group) if int8 is not None else group  # the combine's rows (rotated back by a dot: 16 or more)
    # splits per combine step (unrolled): 2 steps, or more where a step would hold > 64 values per thread
    bs = min(ns, max(4096 // (gc * bd), ns // 2), 2048 * scratch.warps // (gc * bd))
    extra = (int8.k_scale, int8.v_scale, int8.rotation) if int8 is not None else (k_cache, k_cache, k_cache)
    _decode_attention_kernel[(hkv, scratch.nprog, n)](
        q, k_cache, v_cache, *extra, positions, block_tables, block_tables.stride(0), out, *qargs, scratch.o,
        scratch.m, scratch.l, scratch.count, h, hkv, hd, n_slots, nsplit, scratch.nprog, scale, softcap or 1.0, window,
        SOFTCAP=softcap > 0, WINDOW=window > 0, G=group if scratch.dot == "ieee" and int8 is None else max(16, group),
        GC=gc,
        MINB=max(1, scratch.chunk // bn), SOLO=scratch.solo // bn, BN=bn, NS=ns, BS=bs, BD=bd, BLOCK=block_size,
        SKIP=scratch.skip, Q8=q8 is not None, DOT=scratch.dot, POLL=scratch.poll,
        KV8=0 if int8 is None else 1 if scratch.dot == "ieee" else 2, FRESH=fresh,
        num_warps=scratch.warps,
        num_stages=2, **pdl.launch(pdl_on))
    return out
