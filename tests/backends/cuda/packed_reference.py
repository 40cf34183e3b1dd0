"""The repacked planes read back to float32 weights with plain torch ops: the inverse of repack.py's layout
(its module docstring), written independently of the kernels so that a repack test can compare it with gguf-py."""

from __future__ import annotations

import torch

from quanta.backends.cuda.repack import PackedWeight


def unpack_codes(w: PackedWeight) -> torch.Tensor:
    """The code planes back to (n, k) unsigned codes in weight order (4- or 8-bit words, plus the high-bit plane)."""
    n, k = w.n, w.k
    nw = 4 if w.kind == "q4" else 8
    b = w.q.reshape(n, k // 32, nw, 4)
    if w.kind == "q4":
        b = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(n, k // 32, nw, 8)
    q = b.transpose(2, 3).reshape(n, k)
    if w.qh is not None:
        hb = w.high_bits
        h = w.qh.reshape(n, k // 32, hb, 4)
        hi = torch.stack([(h >> (hb * f)) & ((1 << hb) - 1) for f in range(8 // hb)], dim=-1)  # [n, c, h, b, f]
        q = q | (hi.transpose(2, 3).reshape(n, k) << 4)
    return q


def dequantize_packed(w: PackedWeight) -> torch.Tensor:
    """The float32 weights (n, k) of a packed matrix: ``d * sc * (q - QOFF) - dmin * mn`` per group."""
    if w.kind == "dense":
        return w.q.float()
    n, k = w.n, w.k
    q = (unpack_codes(w).float() - w.qoff).reshape(n, k // w.group, w.group)
    per = w.super_block // w.group
    scale = w.d.float().repeat_interleave(per, dim=1)
    if w.sc is not None:
        scale = scale * w.sc.float()
    out = q * scale[:, :, None]
    if w.dmin is not None:
        mn = w.dmin.float().repeat_interleave(per, dim=1)
        if w.mn is not None:
            mn = mn * w.mn.float()
        out = out - mn[:, :, None]
    return out.reshape(n, k)
