"""Quantizers: float32 weights → the bytes of a ggml block format, vectorised over whole tensors.

The 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and F16/BF16 follow llama.cpp's ``quantize_row_*_ref`` and
produce bytes identical to gguf-py's ``gguf.quants.quantize``; the K-quants live in ``kquants.py``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from quanta.quant.formats import get_format
from quanta.quant.kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k

_CHUNK_ELEMENTS = 1 << 20  # weights quantized per step: keeps temporaries cache-sized


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """Quantize ``x`` of shape ``(..., k)`` to ``type_name``: uint8 of shape ``(..., k // block_size * type_size)``."""
    if type_name not in _QUANTIZERS:
        get_format(type_name)  # unknown types: UnsupportedTypeError
        raise ValueError(f"cannot quantize to {type_name} (quantizable types: {', '.join(QUANTIZABLE_TYPES)})")
    fmt = get_format(type_name)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % fmt.block_size:
        raise ValueError(f"cannot quantize shape {x.shape} to {type_name}: "
                         f"the last dimension must be a multiple of {fmt.block_size}")
    blocks = np.ascontiguousarray(x).reshape(-1, fmt.block_size)
    out = np.empty((blocks.shape[0], fmt.type_size), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    encode = _QUANTIZERS[type_name]
    # a block spanning less than float16's resolution has a subnormal scale whose inverse overflows, as in llama.cpp
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, blocks.shape[0], step):
            out[i : i + step] = encode(blocks[i : i + step]).view(np.uint8).reshape(-1, fmt.type_size)
    return out.reshape(*x.shape[:-1], x.shape[-1] // fmt.block_size * fmt.type_size)


def _inverse_scale(d: np.ndarray) -> np.ndarray:
    """``1 / d``, and 0 where ``d`` is 0 (a block of zeros)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """``(..., 2m)`` values 0-15 → ``(..., m)`` bytes: the first half in low nibbles, the second in high ones."""
    m = q.shape[-1] // 2
    return (q[..., :m] & 0x0F) | (q[..., m:] << 4)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per row, the value with the largest magnitude, sign kept (the first one on ties), as a column."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1, keepdims=True), axis=-1)


def _quantize_f32(x: np.ndarray) -> np.ndarray:
    return x


def _quantize_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _quantize_bf16(x: np.ndarray) -> np.ndarray:
    # ggml_compute_fp32_to_bf16: NaNs become quiet NaNs, everything else rounds to nearest even
    n = x.view(np.uint32).astype(np.uint64)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    rounded = (n + 0x7FFF + ((n >> 16) & 1)) >> 16
    quiet = (n >> 16) | 64
    return np.where(nan, quiet, rounded).astype(np.uint16)


def _quantize_q4_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / np.float32(-8)
    q = np.trunc(x * _inverse_scale(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    return get_format("Q4_0").pack(d=d.astype(np.float16), qs=_pack_nibbles(q))


def _quantize_q4_1(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.trunc((x - lo) * _inverse_scale(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    return get_format("Q4_1").pack(d=d.astype(np.float16), m=lo.astype(np.float16), qs=_pack_nibbles(q))


def _q5_high_bits(q: np.ndarray) -> np.ndarray:
    """The 5th bit of each of 32 weights, as 4 bytes of a little-endian 32-bit mask."""
    return np.packbits(q >> 4, axis=-1, bitorder="little")


def _quantize_q5_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / np.float32(-16)
    q = np.trunc(x * _inverse_scale(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
    return get_format("Q5_0").pack(d=d.astype(np.float16), qh=_q5_high_bits(q), qs=_pack_nibbles(q))


def _quantize_q5_1(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = np.trunc((x - lo) * _inverse_scale(d) + np.float32(0.5)).astype(np.uint8).clip(0, 31)
    return get_format("Q5_1").pack(d=d.astype(np.float16), m=lo.astype(np.float16),
                       qh=_q5_high_bits(q), qs=_pack_nibbles(q))


def _quantize_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    v = np.abs(x * _inverse_scale(d))
    whole = np.floor(v)
    q = np.sign(x) * (whole + np.floor(2 * (v - whole)))  # roundf (halves away from zero), exact for any float
    return get_format("Q8_0").pack(d=d.astype(np.float16), qs=q.astype(np.int8))


_QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": _quantize_f32, "F16": _quantize_f16, "BF16": _quantize_bf16,
    "Q4_0": _quantize_q4_0, "Q4_1": _quantize_q4_1, "Q5_0": _quantize_q5_0, "Q5_1": _quantize_q5_1,
    "Q8_0": _quantize_q8_0, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k,
}

QUANTIZABLE_TYPES: tuple[str, ...] = tuple(_QUANTIZERS)
