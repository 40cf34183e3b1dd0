"""Rotary position embedding, in place on ``(n, heads, hd)`` float32, positions read from device memory.

``neox=False`` rotates adjacent pairs (2i, 2i+1) (llama); ``neox=True`` rotates (i, i + rot/2) (qwen2, gemma).
The cos/sin table is ``(n_ctx, rot/2)`` float32. One program per token rotates every head. Tested against a numpy
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
