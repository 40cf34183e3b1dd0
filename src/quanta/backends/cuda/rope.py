"""Rotary position embedding, in place on ``(n, heads, hd)`` float32, positions read from device memory.

``neox=False`` rotates adjacent pairs (2i, 2i+1) (llama); ``neox=True`` rotates (i, i + rot/2) (qwen2, gemma).
The cos/sin table is ``(n_ctx, rot/2)`` float32; dims past ``rot`` are left as they are. A program rotates a
block of heads of one token: the two members of each pair are read as two planes (``x[i]``/``x[i + rot/2]``, or the
strided ``x[2i]``/``x[2i+1]``) with the table row as a tile of the same shape, so every value has one register
layout and nothing is exchanged through shared memory. ``rope_qk`` runs its query-head blocks and then its key-head
blocks, which rotate their keys and store them and the values straight into the paged KV pool (``(hk, n_slots,
hd)`` per layer) from registers, at each token's slot (``AttentionMetadata.slots``). Tested against a
numpy rotation built from the same inverse frequencies (tests/backends/cuda/test_ops.py).

Where the GEMVs run (decode of up to qmatmul's ``INT8_MAX_ROWS`` rows) the rotation and the KV store can instead run
in the epilogue of the Q/K/V GEMVs (``RopeStore``, ``gemv_rows``, ``rope_store``: one launch fewer per layer); tested
against the projections followed by ``rope_qk`` (tests/backends/cuda/test_rope_fusion.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl


@triton.jit
def _rotate(x_ptr, c_ptr, cos_ptr, sin_ptr, t, h0, pos, slot, H, HD, HALF, NSLOTS, NEOX: tl.constexpr,
            STORE: tl.constexpr, TAIL: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Rotate heads [h0, h0 + BH) of token t in place to angle row ``pos``; STORE: also write the rotated heads
    to the pool ``c_ptr`` at ``slot`` (TAIL: with their unrotated dims past the rotary part)."""
    h = h0 + tl.arange(0, BH)[:, None]
    i = tl.arange(0, BR)[None, :]
    # every load is a [BH, BR] tile of the same contiguity, so all get one register layout: no shuffles through
    # shared memory (the table row is loaded once per head, from L1)
    if NEOX:
        ia = i
        ib = i + HALF
        f = i + 0 * h
    else:
        ia = 2 * i
        ib = ia + 1
        f = ia // 2 + 0 * h  # i, its contiguity hidden like that of the strided planes
    mask = (h < H) & (i < HALF)
    base = x_ptr + (t * H + h) * HD
    a = tl.load(base + ia, mask=mask, other=0.0)
    b = tl.load(base + ib, mask=mask, other=0.0)
    c = tl.load(cos_ptr + pos * HALF + f, mask=mask, other=1.0)
    s = tl.load(sin_ptr + pos * HALF + f, mask=mask, other=0.0)
    ra = a * c - b * s
    rb = a * s + b * c
    tl.store(base + ia, ra, mask=mask)
    tl.store(base + ib, rb, mask=mask)
    if STORE:
        cbase = c_ptr + (h * NSLOTS + slot) * HD
        tl.store(cbase + ia, ra, mask=mask)
        tl.store(cbase + ib, rb, mask=mask)
        if TAIL:
            d = tl.arange(0, BD)[None, :]
            tmask = (h < H) & (d >= 2 * HALF) & (d < HD)
            tl.store(cbase + d, tl.load(base + d, mask=tmask, other=0.0), mask=tmask)


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, H, HD, HALF, NEOX: tl.constexpr, BH: tl.constexpr,
                 BR: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    _rotate(x_ptr, x_ptr, cos_ptr, sin_ptr, t, tl.program_id(1) * BH, pos, 0, H, HD, HALF, 0, NEOX, False, False,
            BH, BR, BR)


def rope_table(inv_freq: np.ndarray, n_ctx: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * inv_freq`` for every position (angles formed in float32, like the CPU backend)."""
    ang = np.arange(n_ctx, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    return (torch.from_numpy(np.cos(ang).astype(np.float32)).to(device),
            torch.from_numpy(np.sin(ang).astype(np.float32)).to(device))


def _head_block(heads: int, bd: int) -> int:
    """Heads per program: about 256 floats, so a token's heads spread over several programs."""
    return min(triton.next_power_of_2(heads), max(1, 256 // bd))


def rope(x: torch.Tensor, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor],
         neox: bool, pdl_on: bool = False) -> torch.Tensor:
    """Rotate the first ``2 * table_width`` dims of every head of ``x`` (n, heads, hd) in place."""
    n, h, hd = x.shape
    assert x.is_contiguous()
    cos, sin = table
    half = cos.shape[1]
    bh = _head_block(h, triton.next_power_of_2(hd))
    _rope_kernel[(n, triton.cdiv(h, bh))](x, positions, cos, sin, h, hd, half, NEOX=neox, BH=bh,
                                          BR=triton.next_power_of_2(half), num_warps=2, **pdl.launch(pdl_on))
    return x


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, HQ, HK, HD, HALF,
                    NSLOTS, QBLOCKS,
                    NEOX: tl.constexpr, STORE: tl.constexpr, TAIL: tl.constexpr, BHQ: tl.constexpr,
                    BHK: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """Program (t, j): query heads [j*BHQ, (j+1)*BHQ) of token t for j < QBLOCKS, then key heads (and their
    values) [(j-QBLOCKS)*BHK, ...): a token's 32 key heads of 128 in one program of 2 warps took ~14 us (Llama-2-7B's
    decode, 15% of its step)."""
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    t = tl.program_id(0)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    if j < QBLOCKS:
        _rotate(q_ptr, q_ptr, cos_ptr, sin_ptr, t, j * BHQ, pos, 0, HQ, HD, HALF, NSLOTS, NEOX, False, False, BHQ, BR,
                BD)
    else:
        h0 = (j - QBLOCKS) * BHK
        slot = 0
        if STORE:  # values: a plain copy into the pool
            slot = tl.load(slot_ptr + t)
            h = h0 + tl.arange(0, BHK)[:, None]
            d = tl.arange(0, BD)[None, :]
            vm = (h < HK) & (d < HD)
            tl.store(vc_ptr + (h * NSLOTS + slot) * HD + d, tl.load(v_ptr + (t * HK + h) * HD + d, mask=vm), mask=vm)
        _rotate(k_ptr, kc_ptr, cos_ptr, sin_ptr, t, h0, pos, slot, HK, HD, HALF, NSLOTS, NEOX, STORE, TAIL, BHK, BR,
                BD)


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor],
            neox: bool, v: torch.Tensor | None = None, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
            slots: torch.Tensor | None = None, pdl_on: bool = False) -> None:
    """Rotate q (n, hq, hd) and k (n, hk, hd) in place to ``positions``; with ``v``, ``cache`` (K and V of (hk,
    n_slots, hd)) and ``slots``, also store the rotated k and v at ``slots`` of the pool."""
    n, hq, hd = q.shape
    hk = k.shape[1]
    assert q.is_contiguous() and k.is_contiguous() and k.shape[2] == hd
    cos, sin = table
    store = v is not None and cache is not None
    assert not store or slots is not None
    kc, vc = cache if store else (k, k)
    if store:
        assert v.is_contiguous() and v.shape == k.shape and kc.shape[0] == hk
    half = cos.shape[1]
    bd = triton.next_power_of_2(hd)
    bhq, bhk = _head_block(hq, bd), _head_block(hk, bd)
    q_blocks = triton.cdiv(hq, bhq)
    _rope_qk_kernel[(n, q_blocks + triton.cdiv(hk, bhk))](
        q, k, v if store else k, kc, vc, positions, slots if store else positions, cos, sin, hq, hk, hd, half,
        kc.shape[1] if store else 0, q_blocks, NEOX=neox, STORE=store, TAIL=2 * half < hd, BHQ=bhq, BHK=bhk,
        BR=triton.next_power_of_2(half), BD=bd, num_warps=2, **pdl.launch(pdl_on))


@dataclass
class RopeStore:
    """The output side of a decode Q/K/V GEMV that rotates and stores (``CUDABackend.qkv_rope``). Its weight holds
    rows ``row0``, ``row0 + 1``, … of the stacked Q|K|V matrix: rows below ``nq`` are rotated into ``q`` (m, nq),
    rows in [nq, nq + nk) rotated into the K pool and the rest copied into the V pool: activation row i at angle
    ``positions[i]``, stored at pool slot ``slots[i]``."""

    q: torch.Tensor
    cache: tuple[torch.Tensor, torch.Tensor]
    positions: torch.Tensor
    slots: torch.Tensor
    table: tuple[torch.Tensor, torch.Tensor]
    neox: bool
    row0: int
    nq: int
    nk: int

    def args(self) -> tuple:
        """The GEMV's rope arguments: positions, slots, cos and sin tables, row0, head dim, table width, slots per
        head of the pool."""
        _, n_slots, hd = self.cache[0].shape
        return (self.positions, self.slots, *self.table, self.row0, hd, self.table[0].shape[1], n_slots)


@triton.jit
def gemv_rows(tile, BN: tl.constexpr, ROW0, NQK, HD, HALF, ROPE: tl.constexpr, NEOX: tl.constexpr):
    """The BN output rows of the GEMV program of row tile ``tile`` (from ROW0 in a rope GEMV): consecutive ones.
    Rope rotates pairs, and a rope GEMV rotates the pairs in adjacent output slots (2i, 2i+1): llama's pairs are
    adjacent rows; with NEOX, slots 2i and 2i+1 of a Q/K head take its rows i and i + HALF. V rows keep their
    slots."""
    rows = tile * BN + tl.arange(0, BN)
    if ROPE:
        if NEOX:
            g = ROW0 + rows
            w = g % HD
            rows = tl.where(g < NQK, g - w + w // 2 + (w % 2) * HALF, g) - ROW0
    return rows


@triton.jit
def rope_store(y, m, rows, rmask, q_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, ROW0, NQ, NQK, HD,
               HALF, NSLOTS, NEOX: tl.constexpr, BN: tl.constexpr):
    """Epilogue of a rope GEMV for activation row ``m`` (BN even, ``y`` in the slot order of ``gemv_rows``): rotate
    each pair of adjacent slots to the row's position, then store the query rows into row m of q and the key and
    value rows at the row's slot of the pool (``(hk, n_slots, hd)``, any float type)."""
    pos = tl.load(pos_ptr + m)
    slot = tl.load(slot_ptr + m)
    g = ROW0 + rows
    ya, yb = tl.split(tl.reshape(y, [BN // 2, 2]))
    ga, _ = tl.split(tl.reshape(g, [BN // 2, 2]))
    f = ga % HD if NEOX else (ga % HD) // 2
    rot = ga < NQK  # V pairs: cos 1, sin 0 leave them as they are
    c = tl.load(cos_ptr + pos * HALF + f, mask=rot, other=1.0)
    s = tl.load(sin_ptr + pos * HALF + f, mask=rot, other=0.0)
    y = tl.reshape(tl.join(ya * c - yb * s, ya * s + yb * c), [BN])
    tl.store(q_ptr + m * NQ + g, y, mask=rmask & (g < NQ))
    kr = g - NQ
    tl.store(kc_ptr + (kr // HD * NSLOTS + slot) * HD + kr % HD, y, mask=rmask & (kr >= 0) & (g < NQK))
    vr = g - NQK
    tl.store(vc_ptr + (vr // HD * NSLOTS + slot) * HD + vr % HD, y, mask=rmask & (vr >= 0))
