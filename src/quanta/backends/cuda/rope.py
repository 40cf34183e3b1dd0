"""Rotary position embedding, in place on ``(n, heads, hd)`` float32, positions read from device memory.

``neox=False`` rotates adjacent pairs (2i, 2i+1) (llama); ``neox=True`` rotates (i, i + rot/2) (qwen2, gemma).
The cos/sin table is ``(n_ctx, rot/2)`` float32. One program per token rotates every head. ``rope_qk`` rotates
the queries and keys of a token in one program and can store the rotated keys and the values straight into the
KV cache (``(hkv, n_ctx, hd)`` per layer) from registers: one launch instead of three. Tested against a numpy
rotation built from the same inverse frequencies.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, H, HD, HALF, NEOX: tl.constexpr,
                 BH: tl.constexpr, BR: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BH)[:, None]
    i = tl.arange(0, BR)[None, :]
    mask = (h < H) & (i < HALF)
    base = x_ptr + t * H * HD + h * HD
    # x first: its latency overlaps the position -> table chain
    if NEOX:
        a = tl.load(base + i, mask=mask, other=0.0)
        b = tl.load(base + i + HALF, mask=mask, other=0.0)
    else:  # adjacent pairs as one [BH, BR, 2] tile: one 8-byte access per pair instead of two strided ones
        pair = base[:, :, None] + 2 * i[:, :, None] + tl.arange(0, 2)[None, None, :]
        a, b = tl.split(tl.load(pair, mask=mask[:, :, None], other=0.0))
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * HALF + i, mask=i < HALF, other=1.0)
    s = tl.load(sin_ptr + pos * HALF + i, mask=i < HALF, other=0.0)
    ra = a * c - b * s
    rb = a * s + b * c
    if NEOX:
        tl.store(base + i, ra, mask=mask)
        tl.store(base + i + HALF, rb, mask=mask)
    else:
        tl.store(pair, tl.join(ra, rb), mask=mask[:, :, None])


def rope_table(inv_freq: np.ndarray, n_ctx: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * inv_freq`` for every position (angles formed in float32, like the CPU backend)."""
    ang = np.arange(n_ctx, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    return (torch.from_numpy(np.cos(ang).astype(np.float32)).to(device),
            torch.from_numpy(np.sin(ang).astype(np.float32)).to(device))


def rope(x: torch.Tensor, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor], neox: bool) -> torch.Tensor:
    """Rotate the first ``2 * table_width`` dims of every head of ``x`` (n, heads, hd) in place."""
    n, h, hd = x.shape
    assert x.is_contiguous()
    cos, sin = table
    half = cos.shape[1]
    _rope_kernel[(n,)](x, positions, cos, sin, h, hd, half, NEOX=neox, BH=triton.next_power_of_2(h),
                       BR=triton.next_power_of_2(half), num_warps=4)
    return x


@triton.jit
def _rotate_heads(x_ptr, c_ptr, t, pos, c, s, H, HD, HALF, NCTX, NEOX: tl.constexpr, STORE: tl.constexpr,
                  BH: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Rotate the H heads of token t in place; STORE: also write the whole rotated heads to the cache at pos."""
    h = tl.arange(0, BH)[:, None]
    i = tl.arange(0, BR)[None, :]
    mask = (h < H) & (i < HALF)
    base = x_ptr + t * H * HD + h * HD
    cbase = c_ptr + (h * NCTX + pos) * HD
    if NEOX:
        a = tl.load(base + i, mask=mask, other=0.0)
        b = tl.load(base + i + HALF, mask=mask, other=0.0)
    else:
        off = 2 * i[:, :, None] + tl.arange(0, 2)[None, None, :]
        a, b = tl.split(tl.load(base[:, :, None] + off, mask=mask[:, :, None], other=0.0))
    ra = a * c - b * s
    rb = a * s + b * c
    if NEOX:
        tl.store(base + i, ra, mask=mask)
        tl.store(base + i + HALF, rb, mask=mask)
        if STORE:
            tl.store(cbase + i, ra, mask=mask)
            tl.store(cbase + i + HALF, rb, mask=mask)
    else:
        tl.store(base[:, :, None] + off, tl.join(ra, rb), mask=mask[:, :, None])
        if STORE:
            tl.store(cbase[:, :, None] + off, tl.join(ra, rb), mask=mask[:, :, None])
    if STORE:  # dims past the rotary part (rot < hd) go to the cache unrotated
        d = tl.arange(0, BD)[None, :]
        tmask = (h < H) & (d >= 2 * HALF) & (d < HD)
        tl.store(cbase + d, tl.load(base + d, mask=tmask, other=0.0), mask=tmask)


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, cos_ptr, sin_ptr, HQ, HK, HD, HALF, NCTX,
                    NEOX: tl.constexpr, STORE: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr,
                    BR: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, BR)[None, :]
    c = tl.load(cos_ptr + pos * HALF + i, mask=i < HALF, other=1.0)
    s = tl.load(sin_ptr + pos * HALF + i, mask=i < HALF, other=0.0)
    if STORE:  # values: a plain copy into the cache
        h = tl.arange(0, BHK)[:, None]
        d = tl.arange(0, BD)[None, :]
        vm = (h < HK) & (d < HD)
        tl.store(vc_ptr + (h * NCTX + pos) * HD + d, tl.load(v_ptr + (t * HK + h) * HD + d, mask=vm), mask=vm)
    _rotate_heads(q_ptr, q_ptr, t, pos, c, s, HQ, HD, HALF, NCTX, NEOX, False, BHQ, BR, BD)
    _rotate_heads(k_ptr, kc_ptr, t, pos, c, s, HK, HD, HALF, NCTX, NEOX, STORE, BHK, BR, BD)


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor],
            neox: bool, v: torch.Tensor | None = None,
            cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate q (n, hq, hd) and k (n, hk, hd) in place; with ``v`` and ``cache`` (K and V of (hk, n_ctx, hd)),
    also store the rotated k and v at ``positions`` of the cache."""
    n, hq, hd = q.shape
    hk = k.shape[1]
    assert q.is_contiguous() and k.is_contiguous() and k.shape[2] == hd
    cos, sin = table
    half = cos.shape[1]
    store = v is not None and cache is not None
    kc, vc = cache if store else (k, k)
    if store:
        assert v.is_contiguous() and v.shape == k.shape and kc.shape[0] == hk
    _rope_qk_kernel[(n,)](q, k, v if store else k, kc, vc, positions, cos, sin, hq, hk, hd, half,
                          kc.shape[1] if store else 0, NEOX=neox, STORE=store, BHQ=triton.next_power_of_2(hq),
                          BHK=triton.next_power_of_2(hk), BR=triton.next_power_of_2(half),
                          BD=triton.next_power_of_2(hd), num_warps=4)
