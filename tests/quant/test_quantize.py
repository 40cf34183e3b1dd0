"""Quantizers: bytes identical to gguf-py's where it has a quantizer; shapes, errors and edge blocks otherwise.

How close the K-quants come to llama.cpp's own quantizer is tested in test_quantize_llama_cpp.py.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quanta.quant import QUANTIZABLE_TYPES, UnsupportedTypeError, dequantize_raw, get_format, quantize

GGUF_PY_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def gguf_py_bytes(x: np.ndarray, type_name: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):  # subnormal scales, see quanta.quant.quantize
        q = gguf.quants.quantize(x, GGMLQuantizationType[type_name])
    return np.ascontiguousarray(q).view(np.uint8).reshape(*x.shape[:-1], -1)


def edge_rows(rng: np.random.Generator, cols: int) -> np.ndarray:
    """Rows that stress rounding and the special cases: zeros, constants, ties, one outlier, one sign only."""
    gauss = rng.standard_normal(cols).astype(np.float32)
    halves = (rng.integers(-16, 16, cols) + 0.5).astype(np.float32) / 8  # exact .5 ties after scaling
    outlier = gauss * 0.01
    outlier[cols // 3] = 40.0
    return np.stack([
        np.zeros(cols, np.float32), np.full(cols, 0.75, np.float32), np.full(cols, -3.0, np.float32),
        halves, outlier, np.abs(gauss), -np.abs(gauss), gauss * 1e-6, gauss * 1e4,
        np.where(np.arange(cols) % 2 == 0, 0, gauss).astype(np.float32),
    ])


@pytest.mark.parametrize("type_name", GGUF_PY_TYPES)
def test_bytes_identical_to_gguf_py(type_name: str) -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal((50, 512)).astype(np.float32), edge_rows(rng, 512)])
    assert np.array_equal(quantize(x, type_name), gguf_py_bytes(x, type_name))


@pytest.mark.parametrize("type_name", GGUF_PY_TYPES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_bytes_identical_to_gguf_py_property(type_name: str, data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 4))
    magnitude = data.draw(st.sampled_from([2.0**-10, 1.0, 2.0**10]))
    elements = st.floats(-magnitude, magnitude, width=32, allow_subnormal=False)
    x = data.draw(arrays(np.float32, (rows, 64), elements=elements))
    assert np.array_equal(quantize(x, type_name), gguf_py_bytes(x, type_name))


def rounding_rmse(x: np.ndarray, type_name: str) -> float:
    """The RMSE of rounding to nearest on each block's own grid: step / sqrt(12), from the data alone."""
    if type_name == "F32":
        return 0.0
    if type_name in ("F16", "BF16"):
        ulp = np.spacing(x.astype(np.float16)).astype(np.float32) if type_name == "F16" else np.spacing(x) * 2.0**16
        return float(np.sqrt(np.mean(ulp**2) / 12))
    sub = {"Q6_K": 16, "Q4_K": 32, "Q5_K": 32}.get(type_name, 32)
    b = x.reshape(-1, sub)
    amax, span = np.abs(b).max(axis=1), b.max(axis=1) - np.minimum(b.min(axis=1), 0)
    step = {"Q4_0": amax / 8, "Q5_0": amax / 16, "Q8_0": amax / 127, "Q6_K": amax / 32,
            "Q4_1": span / 15, "Q4_K": span / 15, "Q5_1": span / 31, "Q5_K": span / 31}[type_name]
    return float(np.sqrt(np.mean(step**2) / 12))


@pytest.mark.parametrize("type_name", QUANTIZABLE_TYPES)
def test_output_shape_and_rounding_error(type_name: str) -> None:
    fmt = get_format(type_name)
    x = np.random.default_rng(2).standard_normal((2, 3, 512)).astype(np.float32)
    q = quantize(x, type_name)
    assert q.dtype == np.uint8
    assert q.shape == (2, 3, 512 // fmt.block_size * fmt.type_size)
    y = dequantize_raw(q, type_name, x.shape)
    rmse = float(np.sqrt(np.mean((y - x) ** 2)))
    assert rmse <= 1.1 * rounding_rmse(x, type_name), (rmse, rounding_rmse(x, type_name))


@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_quants_on_edge_blocks(type_name: str) -> None:
    rng = np.random.default_rng(3)
    x = np.delete(edge_rows(rng, 512), 7, axis=0)  # row 7 (1e-6) is below float16 scales: lost, as in llama.cpp
    y = dequantize_raw(quantize(x, type_name), type_name, x.shape)
    assert np.all(np.isfinite(y))
    assert np.array_equal(y[0], x[0])  # zeros stay exact zeros
    scale = np.abs(x).max(axis=1, keepdims=True)
    assert np.all(np.abs(y - x) <= 0.2 * scale)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_quants_reproduce_an_exactly_representable_block(type_name: str) -> None:
    # a block whose sub-blocks are each one integer grid with a power-of-two step is quantized without loss
    nlevels = {"Q4_K": 16, "Q5_K": 32, "Q6_K": 32}[type_name]
    rng = np.random.default_rng(4)
    levels = rng.integers(0, nlevels, (4, 256))
    levels[:, ::16] = 0
    levels[:, 1::16] = nlevels - 1  # every sub-block spans its full grid
    x = (levels - (nlevels // 2 if type_name == "Q6_K" else 0)).astype(np.float32) / 64
    y = dequantize_raw(quantize(x, type_name), type_name, x.shape)
    np.testing.assert_allclose(y, x, atol=2e-3 * np.abs(x).max())


def test_errors_for_bad_shapes_and_types() -> None:
    x = np.zeros((2, 48), np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(x, "Q8_0")
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 512 + 32), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="cannot quantize to Q2_K"):
        quantize(np.zeros(256, np.float32), "Q2_K")
    with pytest.raises(UnsupportedTypeError, match="IQ4_NL"):
        quantize(np.zeros(256, np.float32), "IQ4_NL")


def test_quantizable_types() -> None:
    assert set(QUANTIZABLE_TYPES) == {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_TYPES}
