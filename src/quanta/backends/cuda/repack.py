"""Load-time repack of GGUF blocks into the planes the Triton kernels read.

Every supported format is decoded (bit fields only, no float math) into one uniform description of a weight
``(n, k)``::

    w[r, c] = d[r, c // SB] * sc[r, c // G] * (q[r, c] - QOFF) - dmin[r, c // SB] * mn[r, c // G]

with integer codes ``q``, a float16 super-block scale ``d`` (and ``dmin``), and small integer sub-scales ``sc``
(and sub-mins ``mn``) per group of ``G`` weights. Formats without sub-scales (Q4_0 … Q8_0) have ``SB == G`` and no
``sc``/``mn`` planes; Q4_1/Q5_1 store ``dmin = -m``. This keeps the GGUF numbers exactly (the fp32 products are
formed in the kernel, as in gguf-py), but lays each plane out row-major so a program's loads are contiguous.

Code planes: unsigned codes (``QOFF`` is the offset of signed formats), laid out so that a thread reading one
16- or 32-byte chunk of a row finds, in each slot of its words, weights whose activations are contiguous:
  * 4-bit codes (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K): 16 bytes per 32 weights = four little-endian 32-bit words;
    weight ``32*c + 4*s + w`` of chunk ``c`` is nibble ``s`` (bits 4s..4s+3) of word ``w``.
    Q4_0/Q4_1: same bytes as GGUF. Q4_K: 4.625 vs 4.5 bits (sub-scales widened to a byte each).
    Q3_K: 4.5625 vs 3.4375 bits. Q2_K: 5.125 vs 2.625 bits.
  * 5- and 6-bit codes (Q5_0, Q5_1, Q5_K, Q6_K): their low 4 bits as a 4-bit plane (above), and the ``HB`` high
    bits (1 or 2) in a second plane ``qh``, ``HB`` words per chunk laid out for the int8 GEMV (q8gemv.py): the
    high bits of weight ``8b + j`` of a chunk (``j`` < 8) are bits ``HB*f .. HB*f+HB-1`` of byte ``b`` of word
    ``j // F``, ``f = j % F``, ``F = 8 // HB``; so ``(word >> HB*f) & (2^HB - 1) * 0x01010101`` pairs with the
    activation word ``j``. Q5_0: 5.5 (same). Q5_1: 6 (same). Q5_K: 5.625 vs 5.5. Q6_K: 6.5625 (same) bits.
  * 8-bit codes (Q8_0): 32 bytes per 32 weights = eight words; weight ``32*c + 8*s + w`` is byte ``s`` of word
    ``w``, stored as ``q + 128`` (QOFF 128); 8.5 bits (same).
  * F32/F16/BF16 matrices stay as they are (``kind == "dense"``).
The repack runs with torch ops on whatever device the raw bytes are on (on the GPU at load time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.quant.formats import QuantFormat, get_format

_BITS_4 = ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")
# formats whose codes are wider than 4 bits: a 4-bit plane plus a plane of their high bits (HB of them). Before
# session 12 they were stored as 8-bit codes: 2.5-3 more bits per weight streamed (GPU journal, runs 97-99)
HIGH_BITS = {"Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q6_K": 2}


@dataclass
class PackedWeight:
    """One matrix ``(n, k)`` in kernel planes (see the module docstring for the formula)."""

    type: str
    n: int
    k: int
    kind: str  # "q4" (with ``qh``: 5- and 6-bit codes), "q8" or "dense"
    q: torch.Tensor  # uint8 (n, k/2) | uint8 (n, k) | float (n, k)
    qh: torch.Tensor | None = None  # uint8 (n, k*HB/8): the high bits of 5- and 6-bit codes
    high_bits: int = 0  # HB
    d: torch.Tensor | None = None  # float16 (n, k/SB)
    sc: torch.Tensor | None = None  # int8 (n, k/G)
    dmin: torch.Tensor | None = None  # float16 (n, k/SB)
    mn: torch.Tensor | None = None  # uint8 (n, k/G)
    group: int = 32
    super_block: int = 32
    qoff: int = 0

    @property
    def nbytes(self) -> int:
        planes = (self.q, self.qh, self.d, self.sc, self.dmin, self.mn)
        return sum(p.numel() * p.element_size() for p in planes if p is not None)


def _field(blocks: torch.Tensor, fmt: QuantFormat, name: str) -> torch.Tensor:
    """The bytes of one field of every block: (n_blocks, field bytes) uint8."""
    f = next(f for f in fmt.fields if f.name == name)
    size = torch.empty((), dtype=_TORCH[f.dtype]).element_size() * f.count
    off = fmt.offset(name)
    return blocks[:, off:off + size]


_TORCH = {"<f2": torch.float16, "<f4": torch.float32, "<u2": torch.int16, "u1": torch.uint8, "i1": torch.int8}


def _f16(blocks: torch.Tensor, fmt: QuantFormat, name: str) -> torch.Tensor:
    return _field(blocks, fmt, name).contiguous().view(torch.float16).reshape(-1)


def _shift(x: torch.Tensor, shifts: list[int], axis: int, mask: int) -> torch.Tensor:
    """``(x >> s) & mask`` for each shift, stacked on a new axis at ``axis`` (uint8)."""
    parts = [(x >> s) & mask for s in shifts]
    return torch.stack(parts, dim=axis)


def _k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 8 six-bit scales and mins from 12 bytes (llama.cpp get_scale_min_k4)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _bits_of(packed: torch.Tensor) -> torch.Tensor:
    """(nb, m) bytes → (nb, 8, m): bit j of byte i at [:, j, i]."""
    return _shift(packed, list(range(8)), 1, 1)


def _decode(t: str, blocks: torch.Tensor, fmt: QuantFormat) -> dict:
    """Integer codes (nb, block_size) and per-block scale fields of one format."""
    nb = blocks.shape[0]
    if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        qs = _field(blocks, fmt, "qs")
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
        if t.startswith("Q5"):
            # a little-endian 32-bit mask: bit b of byte i is weight 8*i + b
            qh = _bits_of(_field(blocks, fmt, "qh")).transpose(1, 2).reshape(nb, 32)
            q = q | (qh << 4)
        out = {"q": q, "d": _f16(blocks, fmt, "d"), "G": 32, "SB": 32}
        if t in ("Q4_0", "Q5_0"):
            out["qoff"] = 8 if t == "Q4_0" else 16
        else:
            out["dmin"] = -_f16(blocks, fmt, "m")
        return out
    if t == "Q8_0":  # int8 v as the unsigned byte v + 128
        return {"q": _field(blocks, fmt, "qs") ^ 0x80, "d": _f16(blocks, fmt, "d"), "qoff": 128, "G": 32, "SB": 32}
    if t == "Q2_K":
        scales = _field(blocks, fmt, "scales")
        q = _shift(_field(blocks, fmt, "qs").reshape(nb, 2, 32), [0, 2, 4, 6], 2, 3).reshape(nb, 256)
        return {"q": q, "d": _f16(blocks, fmt, "d"), "dmin": _f16(blocks, fmt, "dmin"),
                "sc": scales & 0x0F, "mn": scales >> 4, "G": 16, "SB": 256}
    if t == "Q3_K":
        s = _field(blocks, fmt, "scales")
        lo = _shift(s[:, 0:8], [0, 4], 1, 0x0F).reshape(nb, 16)
        hi = _shift(s[:, 8:12], [0, 2, 4, 6], 1, 0x03).reshape(nb, 16)
        sc = ((lo | (hi << 4)).to(torch.int16) - 32).to(torch.int8)
        ql = _shift(_field(blocks, fmt, "qs").reshape(nb, 2, 32), [0, 2, 4, 6], 2, 3).reshape(nb, 256)
        hbit = _bits_of(_field(blocks, fmt, "hmask")).reshape(nb, 256)
        return {"q": ql | (hbit << 2), "d": _f16(blocks, fmt, "d"), "sc": sc, "qoff": 4, "G": 16, "SB": 256}
    if t in ("Q4_K", "Q5_K"):
        sc, mn = _k4_scales_mins(_field(blocks, fmt, "scales"))
        q = _shift(_field(blocks, fmt, "qs").reshape(nb, 4, 32), [0, 4], 2, 0x0F).reshape(nb, 256)
        if t == "Q5_K":
            q = q | (_bits_of(_field(blocks, fmt, "qh")).reshape(nb, 256) << 4)
        return {"q": q, "d": _f16(blocks, fmt, "d"), "dmin": _f16(blocks, fmt, "dmin"),
                "sc": sc.to(torch.int8), "mn": mn, "G": 32, "SB": 256}
    if t == "Q6_K":
        ql = _shift(_field(blocks, fmt, "ql").reshape(nb, 2, 64), [0, 4], 2, 0x0F).reshape(nb, 256)
        qh = _shift(_field(blocks, fmt, "qh").reshape(nb, 2, 32), [0, 2, 4, 6], 2, 0x03).reshape(nb, 256)
        return {"q": ql | (qh << 4), "d": _f16(blocks, fmt, "d"), "sc": _field(blocks, fmt, "scales").view(torch.int8),
                "qoff": 32, "G": 16, "SB": 256}
    raise AssertionError(t)


def _interleave(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(n, k) codes → (n, k*bits/8) bytes in the chunk layout of the module docstring."""
    n, k = q.shape
    nw = bits  # words per 32-weight chunk
    q = q.reshape(n, k // 32, 32 // bits, nw).transpose(2, 3)  # [.., word w, slot s] = weight nw*s + w
    if bits == 8:
        return q.reshape(n, k).contiguous()
    q = q.reshape(n, k // 32, nw, 4, 2)  # slot s = 2*byte + (high nibble)
    return (q[..., 0] | (q[..., 1] << 4)).reshape(n, k // 2).contiguous()


def _high_plane(hi: torch.Tensor, hb: int) -> torch.Tensor:
    """(n, k) high bits → the ``qh`` plane (n, k*hb/8) of the module docstring."""
    n, k = hi.shape
    fields = 8 // hb
    # weight 8b + (h*F + f) of chunk c → [n, c, h, b, f]
    h = hi.reshape(n, k // 32, 4, hb, fields).transpose(2, 3)
    out = torch.zeros(h.shape[:-1], dtype=torch.uint8, device=hi.device)
    for f in range(fields):
        out |= h[..., f] << (hb * f)
    return out.reshape(n, k * hb // 8).contiguous()


def repack(raw: torch.Tensor, type_name: str, shape: tuple[int, int], tensor_name: str = "") -> PackedWeight:
    """GGUF bytes of an ``(n, k)`` matrix (uint8, any device) → :class:`PackedWeight` on the same device."""
    fmt = get_format(type_name, tensor_name)
    n, k = int(shape[0]), int(shape[1])
    raw = raw.reshape(-1)
    if type_name in ("F32", "F16", "BF16"):
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        return PackedWeight(type_name, n, k, "dense", raw.view(dt).reshape(n, k).contiguous())
    if k % 32:
        raise ValueError(f"tensor {tensor_name}: row length {k} is not a multiple of 32")
    blocks = raw.reshape(-1, fmt.type_size)
    f = _decode(type_name, blocks, fmt)
    g, sb = f["G"], f["SB"]
    q = f["q"].reshape(n, k).to(torch.uint8)
    hb = HIGH_BITS.get(type_name, 0)
    bits4 = type_name in _BITS_4 or hb > 0
    packed = _interleave(q & 0x0F if hb else q, 4 if bits4 else 8)

    def plane(x: torch.Tensor | None, per: int) -> torch.Tensor | None:
        return None if x is None else x.reshape(n, k // per).contiguous()

    return PackedWeight(type_name, n, k, "q4" if bits4 else "q8", packed, qh=_high_plane(q >> 4, hb) if hb else None,
                        high_bits=hb, d=plane(f["d"], sb), sc=plane(f.get("sc"), g), dmin=plane(f.get("dmin"), sb),
                        mn=plane(f.get("mn"), g), group=g, super_block=sb, qoff=f.get("qoff", 0))


@dataclass
class FusedWeight:
    """Matrices of one input stacked by rows (Q|K|V, gate|up) for one split-output matmul, with their biases.

    Every plane is row-major, so stacking is a row concatenation of each plane: bytes per token are unchanged and
    the separate matrices are dropped (no second copy)."""

    packed: PackedWeight
    widths: tuple[int, ...]  # rows of each stacked matrix, in order
    bias: torch.Tensor | None  # (sum of widths,) float32; zeros for a matrix without bias

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


MAX_FUSED = 3  # the split epilogue has three outputs


def fuse(weights: list[PackedWeight], biases: list[torch.Tensor | None]) -> FusedWeight | None:
    """Stack 2..3 matrices of the same format and input width; None when they differ (e.g. Q6_K v beside Q4_K
    q and k) or there is nothing to fuse."""
    if not 2 <= len(weights) <= MAX_FUSED or not all(isinstance(w, PackedWeight) for w in weights):
        return None
    first = weights[0]
    if any((w.type, w.k, w.q.dtype) != (first.type, first.k, first.q.dtype) for w in weights):
        return None

    def cat(name: str) -> torch.Tensor | None:
        planes = [getattr(w, name) for w in weights]
        return None if planes[0] is None else torch.cat(planes, dim=0)

    n = sum(w.n for w in weights)
    packed = PackedWeight(first.type, n, first.k, first.kind, cat("q"), qh=cat("qh"), high_bits=first.high_bits,
                          d=cat("d"), sc=cat("sc"), dmin=cat("dmin"), mn=cat("mn"), group=first.group,
                          super_block=first.super_block, qoff=first.qoff)
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.reshape(-1).float() if b is not None else
                          torch.zeros(w.n, dtype=torch.float32, device=first.q.device)
                          for w, b in zip(weights, biases)])
    return FusedWeight(packed, tuple(w.n for w in weights), bias)
