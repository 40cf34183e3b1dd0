"""Numpy reference dequantization: the readable oracle every CPU and GPU kernel is tested against.

Each ``_dequant_<type>`` turns an array of blocks (the structured view from ``formats.py``) into float32 weights of
shape ``(n_blocks, block_size)``, following llama.cpp's ``dequantize_row_*`` in ggml-quants.c. Whole arrays of
blocks are processed at once; big tensors go through in chunks so temporaries stay small. Tested against gguf-py's
``gguf.quants.dequantize`` on random blocks and on every tensor of the real models.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from quanta.gguf import TensorInfo
from quanta.quant.formats import QuantFormat, get_format

_CHUNK_ELEMENTS = 1 << 22  # weights dequantized per step: bounds the temporaries of big tensors


def dequantize(tensor: TensorInfo) -> np.ndarray:
    """All weights of ``tensor`` as float32, in ``tensor.shape``."""
    return dequantize_raw(tensor.raw, tensor.type, tensor.shape, tensor.name)


def dequantize_rows(tensor: TensorInfo, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``tensor`` seen as a matrix ``(rows, shape[-1])``, as float32 (e.g. embedding lookup)."""
    fmt = get_format(tensor.type, tensor.name)
    row_len = tensor.shape[-1]
    n_rows = tensor.n_elements // row_len
    if not 0 <= start <= stop <= n_rows:
        raise IndexError(f"rows {start}:{stop} out of range for tensor {tensor.name} with {n_rows} rows")
    row_bytes = row_len // fmt.block_size * fmt.type_size
    raw = tensor.raw[start * row_bytes : stop * row_bytes]
    return dequantize_raw(raw, tensor.type, (stop - start, row_len), tensor.name)


def dequantize_raw(raw: np.ndarray, type_name: str, shape: tuple[int, ...], tensor_name: str = "") -> np.ndarray:
    """Decode the bytes of a tensor of ggml type ``type_name`` into float32 weights of ``shape``."""
    fmt = get_format(type_name, tensor_name)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    n = int(np.prod(shape, dtype=np.int64))
    if n % fmt.block_size or raw.size != n // fmt.block_size * fmt.type_size:
        raise ValueError(
            f"tensor {tensor_name or '?'}: {raw.size} bytes do not hold {shape} weights of type {type_name}")
    blocks = fmt.blocks(raw)
    out = np.empty((blocks.size, fmt.block_size), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    decode = _DEQUANTIZERS[fmt.name]
    for i in range(0, blocks.size, step):
        out[i : i + step] = decode(blocks[i : i + step], fmt)
    return out.reshape(shape)


def _f32(field: np.ndarray) -> np.ndarray:
    """A scale field (float16 or float32, one per block) as a float32 column ``(n_blocks, 1)``."""
    return field.astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(..., m)`` packed bytes → ``(..., 2m)``: all low nibbles, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(packed: np.ndarray) -> np.ndarray:
    """``(..., m)`` bytes → ``(..., 8m)`` bits, bit j of the little-endian bit string at position j."""
    return np.unpackbits(packed, axis=-1, bitorder="little")


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """``(n, m)`` bytes → ``(n, 4, m)`` 2-bit fields: index 1 selects bits (0-1, 2-3, 4-5, 6-7)."""
    return (qs[:, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]) & 3


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K packed in 12 bytes (llama.cpp get_scale_min_k4).

    Bytes 0-3: scales 0-3 (low 6 bits), bytes 4-7: mins 0-3 (low 6 bits); bytes 8-11 hold the low 4 bits of
    scale/min 4-7 (scale in the low nibble) and their top 2 bits sit in bits 6-7 of bytes 0-3 (scale) and 4-7 (min).
    """
    lo_sc, lo_m, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    mins = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _dequant_f32(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    return b["v"].astype(np.float32)


def _dequant_f16(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    return b["v"].astype(np.float32)


def _dequant_bf16(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    # bfloat16 is the top half of a float32
    return (b["v"].astype(np.uint32) << 16).view(np.float32)


def _dequant_q4_0(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    # 32 weights: low nibbles are weights 0-15, high nibbles 16-31; w = d * (q - 8)
    q = _nibbles(b["qs"]).astype(np.float32) - 8
    return _f32(b["d"]) * q


def _dequant_q4_1(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    q = _nibbles(b["qs"]).astype(np.float32)
    return _f32(b["d"]) * q + _f32(b["m"])


def _q5_values(b: np.ndarray) -> np.ndarray:
    # bit j of the 32-bit qh is the 5th bit of weight j
    return (_nibbles(b["qs"]) | (_bits(b["qh"]) << 4)).astype(np.float32)


def _dequant_q5_0(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    return _f32(b["d"]) * (_q5_values(b) - 16)


def _dequant_q5_1(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    return _f32(b["d"]) * _q5_values(b) + _f32(b["m"])


def _dequant_q8_0(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    return _f32(b["d"]) * b["qs"].astype(np.float32)


def _dequant_q2_k(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    # 256 weights in 16 sub-blocks of 16. Each 128-weight half reads 32 bytes of qs four times (bit pairs 0-1,
    # 2-3, 4-5, 6-7 give weights 0-31, 32-63, ...). scales[j]: low nibble scales sub-block j, high nibble its min.
    n = b.size
    q = _crumbs(b["qs"].reshape(n * 2, 32)).reshape(n, 16, 16).astype(np.float32)
    sc = b["scales"]
    d = _f32(b["d"])[:, :, None] * (sc & 0x0F)[:, :, None]
    m = _f32(b["dmin"])[:, :, None] * (sc >> 4)[:, :, None]
    return (d * q - m).reshape(n, 256)


def _dequant_q3_k(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    # Low 2 bits as in Q2_K; bit (j // 32) of hmask[j % 32] is the high bit of weight j, and a CLEAR bit subtracts 4.
    # 16 six-bit scales (offset 32): low nibbles in bytes 0-7 (scales 0-7 low, 8-15 high nibble), top 2 bits of
    # scale j in bits 2*(j // 4) of byte 8 + j % 4.
    n = b.size
    low = _crumbs(b["qs"].reshape(n * 2, 32)).reshape(n, 256)
    high = _bits(b["hmask"]).reshape(n, 32, 8).transpose(0, 2, 1).reshape(n, 256)
    q = low.astype(np.float32) - 4 * (1 - high.astype(np.float32))
    packed = b["scales"]
    lo = _nibbles(packed[:, 0:8])
    hi = _crumbs(packed[:, 8:12]).reshape(n, 16)
    scales = (lo | (hi << 4)).astype(np.float32) - 32
    d = _f32(b["d"]) * scales
    return (d[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


def _dequant_q4_k(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    # 8 sub-blocks of 32; each 64-weight chunk c reads qs[32c:32c+32]: low nibbles are weights 0-31, high 32-63.
    n = b.size
    q = _nibbles(b["qs"].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    scales, mins = _k4_scales_mins(b["scales"])
    d = _f32(b["d"]) * scales
    m = _f32(b["dmin"]) * mins
    return (d[:, :, None] * q - m[:, :, None]).reshape(n, 256)


def _dequant_q5_k(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    # As Q4_K, plus a 5th bit for weight 32k + l in bit k of qh[l].
    n = b.size
    low = _nibbles(b["qs"].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = _bits(b["qh"]).reshape(n, 32, 8).transpose(0, 2, 1)
    q = (low | (high << 4)).astype(np.float32)
    scales, mins = _k4_scales_mins(b["scales"])
    d = _f32(b["d"]) * scales
    m = _f32(b["dmin"]) * mins
    return (d[:, :, None] * q - m[:, :, None]).reshape(n, 256)


def _dequant_q6_k(b: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    # Two 128-weight halves, each from 64 bytes of ql and 32 of qh. Weight 32k + l of a half: low 4 bits from
    # ql[l + 32 * (k % 2)] (low nibble for k < 2, high nibble otherwise), high 2 bits from qh[l] bits 2k..2k+1.
    # 16 int8 scales, one per 16 weights; w = d * scale * (q - 32).
    n = b.size
    low = _nibbles(b["ql"].reshape(n * 2, 64)).reshape(n, 2, 4, 32)
    high = _crumbs(b["qh"].reshape(n * 2, 32)).reshape(n, 2, 4, 32)
    q = (low | (high << 4)).astype(np.float32) - 32
    d = _f32(b["d"]) * b["scales"].astype(np.float32)
    return (d[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


_DEQUANTIZERS: dict[str, Callable[[np.ndarray, QuantFormat], np.ndarray]] = {
    "F32": _dequant_f32, "F16": _dequant_f16, "BF16": _dequant_bf16,
    "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1, "Q5_0": _dequant_q5_0, "Q5_1": _dequant_q5_1,
    "Q8_0": _dequant_q8_0, "Q2_K": _dequant_q2_k, "Q3_K": _dequant_q3_k, "Q4_K": _dequant_q4_k,
    "Q5_K": _dequant_q5_k, "Q6_K": _dequant_q6_k,
}
