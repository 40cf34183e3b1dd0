"""The decode attention's vector helpers against numpy: ``axpy`` (float32 and int8 rows, lengths with a scalar tail,
rows that are views of larger arrays), the int8 rows' scaled dot and sum (groups with and without a tail past the
16 lanes) and ``exp_shifted`` (Cephes' expf) against float64 exp."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from quanta.backends.cpu.kernels.vector_rows import LANES, axpy, exp_shifted, scaled_axpy, scaled_dot_row


@numba.njit
def _axpy(o, w, v):
    axpy(o, w, v)


@numba.njit
def _scaled_dot_row(q, codes, scales):
    return scaled_dot_row(q, codes, scales)


@numba.njit
def _scaled_axpy(o, w, codes, scales):
    scaled_axpy(o, w, codes, scales)


@numba.njit
def _exp_shifted(row, m):
    return exp_shifted(row, m)


@pytest.mark.parametrize("n", [3, 16, 40, 64, 256])
@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_axpy_adds_the_scaled_row(n, dtype):
    rng = np.random.default_rng(n)
    out = rng.standard_normal((3, n + 5)).astype(np.float32)
    values = (rng.integers(-127, 128, (2, n)) if dtype == np.int8 else rng.standard_normal((2, n))).astype(dtype)
    expected = out.copy()
    expected[1, 5:] += np.float32(0.37) * values[1].astype(np.float32)
    _axpy(out[1, 5:], np.float32(0.37), values[1])  # views of larger arrays: only that row's range changes
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_exp_shifted_is_within_two_ulp_lanes_and_tail():
    x = np.linspace(-87.0, 88.0, LANES * 20_000 + 7).astype(np.float32)  # 7 values past the last 16 lanes
    row = x.copy()
    _exp_shifted(row, np.float32(0.0))
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(row - ref) / ref) < 2.5 * 2.0 ** -24
    scores = np.array([3.0, -1.0, 0.5, 2.0] * 8, np.float32)
    m = scores.max()
    shifted = scores.copy()
    total = _exp_shifted(shifted, m)
    np.testing.assert_allclose(shifted, np.exp(scores.astype(np.float64) - m), rtol=3e-7)
    assert total == pytest.approx(np.exp(scores.astype(np.float64) - m).sum(), rel=1e-6)
    row = np.full(LANES, -1000.0, np.float32)  # far below the range: tiny, never NaN or negative
    _exp_shifted(row, np.float32(0.0))
    assert np.all((row >= 0) & (row < 1e-37))


@pytest.mark.parametrize("groups,size", [(2, 32), (8, 32), (3, 20), (1, 64), (2, 7)])
def test_scaled_int8_rows_match_float64(groups, size):
    rng = np.random.default_rng(groups * size)
    n = groups * size
    q = rng.standard_normal(n + 3).astype(np.float32)[3:]  # a view past the start of its array
    codes = rng.integers(-127, 128, n).astype(np.int8)
    scales = rng.uniform(0.001, 0.05, groups).astype(np.float32)
    values = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), size)
    assert _scaled_dot_row(q, codes, scales) == pytest.approx(float(q.astype(np.float64) @ values), rel=1e-5,
                                                              abs=1e-5)
    out = rng.standard_normal((2, n)).astype(np.float32)
    expected = out.astype(np.float64).copy()
    expected[1] += 0.37 * values
    _scaled_axpy(out[1], np.float32(0.37), codes, scales)  # only that row changes
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
