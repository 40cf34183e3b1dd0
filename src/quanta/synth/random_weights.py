"""Random tensors written directly in a block format: random quant codes plus a scale chosen for a target std.

Generating codes instead of quantizing Gaussian floats is ~100x faster and still a valid model. The scale is
calibrated once per format with the numpy reference dequantizer: for formats with a minimum (Q4_1, Q5_1, Q2_K,
Q4_K, Q5_K) the min is set so the weights are centred on zero, then ``d`` so their std equals the target.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from quanta.quant.formats import get_format
from quanta.quant.reference import dequantize_raw

_FLOATS = ("F32", "F16", "BF16")
_POOL = 1 << 20  # Gaussian values drawn per float tensor; the tensor tiles them at random offsets
_TILE = 1 << 16


def random_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random bytes as a writable uint8 array (64 bits at a time from the bit generator: fast)."""
    words = rng.bit_generator.random_raw(-(-n // 8))
    return words.view(np.uint8)[:n]


def _with_scales(raw: np.ndarray, type_name: str, d: float, low: float) -> np.ndarray:
    """Overwrite the scale fields of every block: ``d``, and ``dmin`` (K-quants) or ``m`` (Q4_1/Q5_1)."""
    fmt = get_format(type_name)
    blocks = raw.view(fmt.block_dtype)
    blocks["d"] = d
    names = blocks.dtype.names
    if "dmin" in names:
        blocks["dmin"] = low
    elif "m" in names:
        blocks["m"] = low
    return raw


@lru_cache(maxsize=None)
def _calibration(type_name: str) -> tuple[float, float]:
    """(d giving unit std, min per unit of d giving zero mean) for random codes of ``type_name``."""
    fmt = get_format(type_name)
    n = 2048 * fmt.block_size

    def stats(d: float, low: float) -> tuple[float, float]:
        raw = _with_scales(random_bytes(n // fmt.block_size * fmt.type_size, np.random.default_rng(7)), type_name,
                           d, low)
        w = dequantize_raw(raw, type_name, (n,))
        return float(w.mean()), float(w.std())

    has_min = bool({"dmin", "m"} & set(fmt.block_dtype.names))
    ratio = 0.0
    if has_min:
        mean_codes, _ = stats(1.0, 0.0)
        mean_min, _ = stats(0.0, 1.0)
        ratio = -mean_codes / mean_min
    _, std = stats(1.0, ratio)
    return 1.0 / std, ratio


def _random_floats(type_name: str, n: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """Gaussian floats at memcpy speed: tiles of a Gaussian pool copied from random offsets."""
    pool = rng.standard_normal(min(n, _POOL) + _TILE, dtype=np.float32) * np.float32(std)
    if type_name == "F16":
        pool = pool.astype(np.float16)
    elif type_name == "BF16":
        pool = (pool.view(np.uint32) >> 16).astype(np.uint16)  # the high half of each float32 (truncation)
    if n <= _POOL:
        return pool[:n].copy()
    out = np.empty(n, dtype=pool.dtype)
    starts = rng.integers(0, _POOL, -(-n // _TILE))
    for i, s in enumerate(starts.tolist()):
        chunk = out[i * _TILE : (i + 1) * _TILE]
        chunk[:] = pool[s : s + chunk.size]
    return out


def random_tensor(type_name: str, shape: tuple[int, ...], rng: np.random.Generator, std: float = 0.02
                  ) -> np.ndarray:
    """Random weights of ``shape`` (numpy order) encoded in ``type_name``, as the uint8/float array to write."""
    n = int(np.prod(shape))
    if type_name in _FLOATS:
        return _random_floats(type_name, n, rng, std)
    fmt = get_format(type_name)
    unit_d, ratio = _calibration(type_name)
    d = std * unit_d
    return _with_scales(random_bytes(n // fmt.block_size * fmt.type_size, rng), type_name, d, d * ratio)
