"""Random GGUF blocks of every format with finite, moderate scales (for kernel tests), and gguf-py's dequantization
of them as the independent reference."""

from __future__ import annotations

import numpy as np
import pytest

from quanta.quant.formats import FORMATS

ALL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")


def random_raw(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, k) weights of ``type_name`` as uint8 bytes, shape (n, row bytes): random codes, scales in ±0.5."""
    fmt = FORMATS[type_name]
    if type_name in ("F32", "F16", "BF16"):
        x = rng.standard_normal((n, k)).astype(np.float32)
        if type_name == "F16":
            x = x.astype(np.float16)
        elif type_name == "BF16":
            x = (x.view(np.uint32) >> 16).astype(np.uint16)
        return x.view(np.uint8).reshape(n, -1)
    nb = n * k // fmt.block_size
    raw = rng.integers(0, 256, size=(nb, fmt.type_size), dtype=np.uint8)
    for f in fmt.fields:
        if f.dtype == "<f2" and f.count == 1:
            o = fmt.offset(f.name)
            raw[:, o:o + 2] = rng.uniform(-0.5, 0.5, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return raw.reshape(n, -1)


def gguf_reference(raw: np.ndarray, type_name: str, n: int, k: int) -> np.ndarray:
    """gguf-py's dequantization of (n, k) ``type_name`` weights, in float64; skips the test where gguf-py is not
    installed (the GPU machine), so the tests that need no oracle still run there."""
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    return quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float64)
