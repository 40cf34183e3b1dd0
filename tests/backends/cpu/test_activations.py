"""The fast mode's 8-bit activations (vectorised quantizers) against numpy: llama.cpp's rounding, per 32
(``d = max|x| / 127``, codes ``rint(x * (1 / d))``, ties to even) or per 256 for the K-quants, bit for bit, in each
layout the kernels read (``q8_rows.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from quanta.backends.cpu.kernels.activations import gemv_activations, quantize_q8_32, superblock_activations
from quanta.backends.cpu.kernels.q8_rows import ROWS_PER_PASS


def reference(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (n, k) int8 and scales (n, k / block) float32, in numpy float32 arithmetic."""
    blocks = x.reshape(x.shape[0], -1, block)
    d = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inv[:, :, None]).astype(np.int8)
    return codes.reshape(x.shape), d


def activations(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, k)) * rng.uniform(0.01, 60, (n, 1))).astype(np.float32)
    x[0, :32] = 0  # a zero block (scale 0)
    x[-1, 32:64] = 0.5  # a block of equal values: every code at the top of the range
    x[-1, 64:96] = np.float32(1e-30)  # a tiny scale
    x[:, 100] = np.float32(63.5) / np.float32(127) * np.abs(x[:, 96:128]).max(axis=1)  # a code near a rounding tie
    return x


@pytest.mark.parametrize("n,k", [(1, 576), (3, 160), (8, 1536)])
def test_per_32_codes_and_scales(n, k):
    x = activations(n, k, seed=k)
    codes, d = reference(x, 32)
    xq, xd, xsum, xqsum = (np.zeros((n, k), np.int8), *(np.zeros((n, k // 32), t) for t in (np.float32,) * 2),
                           np.zeros((n, k // 32), np.int32))
    quantize_q8_32(x, xq, xd, xsum, xqsum)
    np.testing.assert_array_equal(xq, codes)
    np.testing.assert_array_equal(xd, d)
    np.testing.assert_array_equal(xqsum, codes.reshape(n, -1, 32).sum(axis=2, dtype=np.int32))
    np.testing.assert_array_equal(xsum, d * xqsum.astype(np.float32))


@pytest.mark.parametrize("n,k", [(1, 576), (5, 160), (8, 1536)])  # 160: an odd number of blocks
def test_gemv_layout(n, k):
    x = activations(n, k, seed=k + 1)
    codes, d = reference(x, 32)
    pairs, groups = -(-k // 64), -(-n // ROWS_PER_PASS)
    xq, xstart = np.full((n, 64 * pairs), 7, np.int8), np.ones((n, pairs, 8), np.int32)  # stale values
    xd, xsum = np.ones((groups, pairs, 8), np.float32), np.ones((groups, pairs, 8), np.float32)
    gemv_activations(x, xq, xd, xsum, xstart, 8)
    padded = np.zeros((n, 64 * pairs), np.int8)
    padded[:, :k] = codes
    by_block = padded.reshape(n, pairs, 2, 2, 16)  # pair, block of the pair, half of the block
    np.testing.assert_array_equal(xq.reshape(n, pairs, 2, 2, 16), by_block.transpose(0, 1, 3, 2, 4))
    sums = by_block.sum(axis=(3, 4), dtype=np.int32)  # (n, pairs, 2)
    d_pairs = np.zeros((n, 2 * pairs), np.float32)
    d_pairs[:, : k // 32] = d
    d_pairs = d_pairs.reshape(n, pairs, 2)
    for t in range(n):
        g, r = divmod(t, ROWS_PER_PASS)
        for j in (0, 1):
            np.testing.assert_array_equal(xd[g, :, ROWS_PER_PASS * j + r], d_pairs[t, :, j])
            block_sums = d_pairs[t, :, j] * sums[t, :, j].astype(np.float32)
            np.testing.assert_array_equal(xsum[g, :, ROWS_PER_PASS * j + r], block_sums)
            np.testing.assert_array_equal(xstart[t, :, 4 * j], -8 * sums[t, :, j])
            np.testing.assert_array_equal(xstart[t, :, 4 * j + 1 : 4 * j + 4], 0)


@pytest.mark.parametrize("n,k", [(1, 512), (6, 2048)])
def test_superblock_layout(n, k):
    x = activations(n, k, seed=k + 2)
    codes, d = reference(x, 256)
    supers, groups = k // 256, -(-n // ROWS_PER_PASS)
    xq, xd = np.zeros((n, k), np.int8), np.zeros((groups, supers, 2 * ROWS_PER_PASS), np.float32)
    xsum = np.zeros((groups, ROWS_PER_PASS * supers, 8), np.float32)
    xstart = np.zeros((n, supers, 8), np.int32)
    superblock_activations(x, xq, xd, xsum, xstart)
    np.testing.assert_array_equal(xq, codes)
    sums16 = codes.reshape(n, supers, 16, 16).sum(axis=3, dtype=np.int32)
    for t in range(n):
        g, r = divmod(t, ROWS_PER_PASS)
        np.testing.assert_array_equal(xd[g, :, r], d[t])
        np.testing.assert_array_equal(xstart[t], (sums16[t, :, 0::2] & 0xFFFF) | (sums16[t, :, 1::2] << 16))
        np.testing.assert_array_equal(xsum[g, r * supers : (r + 1) * supers],
                                      d[t][:, None] * (sums16[t, :, 0::2] + sums16[t, :, 1::2]).astype(np.float32))
