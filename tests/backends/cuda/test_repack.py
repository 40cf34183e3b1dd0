"""The load-time repack keeps every weight exactly: packed planes → float32 equals gguf-py's dequantize."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from packed_reference import dequantize_packed
from random_blocks import ALL_TYPES, gguf_reference, random_raw

from quanta.backends.cuda.repack import repack


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_repack_is_lossless(type_name: str) -> None:
    rng = np.random.default_rng(1)
    n, k = 3, 512
    raw = random_raw(type_name, n, k, rng)
    want = gguf_reference(raw, type_name, n, k)
    w = repack(torch.from_numpy(raw.copy()), type_name, (n, k))
    np.testing.assert_array_equal(dequantize_packed(w).numpy(), want)


def test_rows_must_hold_whole_chunks() -> None:
    raw = np.zeros((2, 48 // 32 * 34), np.uint8)
    with pytest.raises(ValueError, match="multiple of 32"):
        repack(torch.from_numpy(raw), "Q8_0", (2, 48))


@pytest.mark.parametrize("type_name, extra_bits", [("Q4_0", 0), ("Q4_1", 0), ("Q5_0", 0), ("Q5_1", 0), ("Q8_0", 0),
                                                   ("Q6_K", 0), ("Q4_K", 0.125), ("Q5_K", 0.125)])
def test_packed_size_matches_gguf(type_name: str, extra_bits: float) -> None:
    """What decode streams per weight: the GGUF's bits (5- and 6-bit codes as a 4-bit plane plus high bits, not as
    8-bit codes), plus a byte per K-quant sub-scale and sub-min where GGUF packs them into 6 bits."""
    n, k = 4, 512
    raw = random_raw(type_name, n, k, np.random.default_rng(2))
    w = repack(torch.from_numpy(raw.copy()), type_name, (n, k))
    assert w.nbytes * 8 == raw.size * 8 + extra_bits * n * k
