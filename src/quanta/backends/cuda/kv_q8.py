"""The int8 KV pool: K and V of ``(n_kv_heads, n_slots, head_dim)`` int8 codes per layer, with an fp16 scale per
32 values of a (slot, KV head) row (``max|x| / 127``, symmetric), 1.0625 bytes per value against fp16's 2.

As on the CPU (backends/cpu/attention.py), the rows are stored rotated by the normalised Walsh-Hadamard matrix H
(orthogonal and symmetric: H·H = I), which spreads a head's few large channels over all of them, so the shared
scales lose far less. Scores need no un-rotation (q·k = qH·kH): the queries are rotated when the keys are stored
(``write``, which also applies rope where the backend's ``rope_qk`` hands it the table: one launch), and the
attention kernels rotate their weighted sums of values back as they store them (``unrotated``). H is a (head_dim,
head_dim) float32 matrix in device memory; head_dim must be a power of two, at least 32. Tested against float64
numpy and the CPU backend's int8 pool (tests/backends/cuda/test_int8_kv_pool.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl
from quanta.backends.cuda.q8gemv import round_codes

GROUP = 32  # values per scale


@dataclass(frozen=True)
class Int8Layer:
    """One layer's view of the int8 pool: codes, scales (``(n_kv_heads, n_slots, head_dim / 32)`` fp16) and H."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    rotation: torch.Tensor


def hadamard(n: int, device: torch.device) -> torch.Tensor:
    """The normalised (n, n) Walsh-Hadamard matrix (n a power of two): H[i, j] = (-1)^popcount(i & j) / sqrt(n)."""
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return torch.from_numpy((1 - 2 * parity).astype(np.float32) / np.float32(np.sqrt(n))).to(device)


def supports(head_dim: int) -> bool:
    return head_dim >= GROUP and head_dim & (head_dim - 1) == 0


@triton.jit
def _columns(r_ptr, c, BD: tl.constexpr):
    """Columns c .. c+31 of H: [BD, 32]."""
    return tl.load(r_ptr + tl.arange(0, BD)[:, None] * BD + c + tl.arange(0, 32)[None, :])


@triton.jit
def _rotated_group(x, r_ptr, c, BD: tl.constexpr):
    """Columns c .. c+31 of x·H for rows x ([R, BD] float32): [R, 32] (IEEE products)."""
    return tl.sum(x[:, :, None] * _columns(r_ptr, c, BD)[None, :, :], axis=1)


@triton.jit
def _store_rotated_codes(x, r_ptr, codes_ptr, scale_ptr, row, BD: tl.constexpr):
    """Row ``x`` ([1, BD]) rotated, as int8 codes (round half away from zero) and fp16 scales at pool ``row``."""
    e = tl.arange(0, 32)
    for c in tl.static_range(0, BD, 32):
        q, amax = round_codes(_rotated_group(x, r_ptr, c, BD))
        tl.store(codes_ptr + row * BD + c + e[None, :], q)
        tl.store(scale_ptr + row * (BD // 32) + c // 32 + tl.arange(0, 1), (amax / 127.0).to(tl.float16))


@triton.jit
def _row(row_ptr, pos, cos_ptr, sin_ptr, HALF, ROPE: tl.constexpr, NEOX: tl.constexpr, BD: tl.constexpr):
    """A head's row ([1, BD]), with ROPE rotated to angle row ``pos`` of the cos/sin tables (rope.py's pairs:
    (i, i + HALF) with NEOX, else (2i, 2i + 1); dims past 2 * HALF as they are)."""
    d = tl.arange(0, BD)[None, :]
    x = tl.load(row_ptr + d)
    if ROPE:
        rot = d < 2 * HALF
        if NEOX:
            first = d < HALF
            partner = tl.where(first, d + HALF, d - HALF)
            f = tl.where(first, d, d - HALF)
        else:
            first = d % 2 == 0
            partner = d ^ 1
            f = d // 2
        y = tl.load(row_ptr + partner, mask=rot, other=0.0)
        c = tl.load(cos_ptr + pos * HALF + f, mask=rot, other=1.0)
        s = tl.load(sin_ptr + pos * HALF + f, mask=rot, other=0.0)
        x = x * c + tl.where(first, -y, y) * s
    return x


@triton.jit
def _write_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, r_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr,
                  H, HKV, NSLOTS, HALF, ROPE: tl.constexpr, NEOX: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """Program (t, j): j < H rotates query head j of token t in place; j = H + h stores KV head h's K and V (ROPE:
    q and k get the position's rope first)."""
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    t = tl.program_id(0)
    j = tl.program_id(1)
    pos = 0
    if ROPE:
        pos = tl.load(pos_ptr + t)
    if j < H:
        query = q_ptr + (t * H + j) * BD
        x = _row(query, pos, cos_ptr, sin_ptr, HALF, ROPE, NEOX, BD)
        e = tl.arange(0, 32)[None, :]
        for c in tl.static_range(0, BD, 32):  # every column is read (x) before the first store
            tl.store(query + c + e, _rotated_group(x, r_ptr, c, BD))
    else:
        h = j - H
        src = (t * HKV + h) * BD
        slot = (h * NSLOTS + tl.load(slot_ptr + t)).to(tl.int64)
        k = _row(k_ptr + src, pos, cos_ptr, sin_ptr, HALF, ROPE, NEOX, BD)
        _store_rotated_codes(k, r_ptr, kc_ptr, ks_ptr, slot, BD)
        _store_rotated_codes(tl.load(v_ptr + src + tl.arange(0, BD)[None, :]), r_ptr, vc_ptr, vs_ptr, slot, BD)


def write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Int8Layer, slots: torch.Tensor, *,
          rope: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], bool] | None = None,
          pdl_on: bool = False) -> None:
    """Rotate the queries q (n, H, hd) in place and store the new tokens' K and V (n, hkv, hd), rotated and
    quantized, at their ``slots`` of the layer's pool; ``rope`` (positions, the cos/sin table, neox): q and k get
    their positions' rope first, as rope.rope_qk gives it."""
    n, h, hd = q.shape
    hkv = k.shape[1]
    assert supports(hd) and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    positions, (cos, sin), neox = rope if rope is not None else (slots, (q, q), False)
    _write_kernel[(n, h + hkv)](q, k, v, layer.k, layer.v, layer.k_scale, layer.v_scale, layer.rotation, slots,
                                positions, cos, sin, h, hkv, layer.k.shape[1], cos.shape[-1] if rope else 0,
                                ROPE=rope is not None, NEOX=neox, BD=hd, num_warps=4, **pdl.launch(pdl_on))


@triton.jit
def dequantized(codes_ptr, scale_ptr, rows, d, mask, HD, CG: tl.constexpr, HALF: tl.constexpr):
    """The pool rows ``rows`` ([BN] int64) as [BN, BD] tiles (columns ``d``; masked: 0): float32, or with HALF
    float16 (codes are exact in fp16; one rounding of the product, as an fp16 pool stores it; half the work);
    CG: loads past L1 (``.cg``)."""
    BN: tl.constexpr = rows.shape[0]
    BD: tl.constexpr = d.shape[0]
    NG: tl.constexpr = BD // 32
    codes = codes_ptr + rows[:, None] * HD + d[None, :]
    scales = scale_ptr + rows[:, None] * NG + tl.arange(0, NG)[None, :]  # rows of masked positions exist: unmasked
    if CG:
        c = tl.load(codes, mask=mask, other=0, cache_modifier=".cg")
        s = tl.load(scales, cache_modifier=".cg")
    else:
        c = tl.load(codes, mask=mask, other=0)
        s = tl.load(scales)
    kind = tl.float16 if HALF else tl.float32
    return tl.reshape(tl.reshape(c.to(kind), [BN, NG, 32]) * s.to(kind)[:, :, None], [BN, BD])


@triton.jit
def unrotated(out, r_ptr, c, BD: tl.constexpr, HALF: tl.constexpr):
    """Columns c .. c+31 of out·H (out [R, BD] float32, R >= 16): the weighted sum of rotated values rotated back,
    in IEEE fp32 or with HALF on the tensor cores (tf32: operands rounded to 10-bit mantissas, as in the fast mode's
    attention dots)."""
    return tl.dot(out, _columns(r_ptr, c, BD), input_precision="tf32" if HALF else "ieee")
