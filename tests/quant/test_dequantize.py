"""The numpy reference dequantization against gguf-py's (an independent implementation) on random blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from quanta.gguf import TensorInfo
from quanta.quant import FORMATS, UnsupportedTypeError, dequantize, dequantize_raw, dequantize_rows, get_format

ALL_TYPES = tuple(FORMATS)


def random_tensor(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes of a (rows, cols) tensor, with every float field set to a finite value of sane size."""
    fmt = get_format(type_name)
    rng = np.random.default_rng(seed)
    n_blocks = rows * cols // fmt.block_size
    raw = rng.integers(0, 256, n_blocks * fmt.type_size, dtype=np.uint8)
    blocks = raw.view(fmt.block_dtype)
    for f in fmt.fields:
        if f.dtype in ("<f2", "<f4"):
            sign = rng.choice([-1, 1], (n_blocks, f.count))
            blocks[f.name] = sign * rng.uniform(1e-4, 2.0, (n_blocks, f.count))
    if type_name == "BF16":  # keep the exponent below all-ones (no inf/NaN)
        blocks["v"] &= 0xBFFF
    return raw.reshape(rows, -1)


def gguf_py(raw: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, GGMLQuantizationType[type_name])


def assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32
    assert ours.shape == ref.shape
    tol = 1e-6 * float(np.abs(ref).max())
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("seed", range(3))
def test_random_blocks_match_gguf_py(type_name: str, seed: int) -> None:
    rows, cols = 7, 3 * 256
    raw = random_tensor(type_name, rows, cols, seed)
    assert_close(dequantize_raw(raw, type_name, (rows, cols)), gguf_py(raw, type_name))


@pytest.mark.parametrize("type_name", ("Q4_0", "Q4_K", "Q6_K", "F16"))
def test_large_tensor_goes_through_in_chunks(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import quanta.quant.reference as reference

    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 1000)  # many uneven chunks
    raw = random_tensor(type_name, 40, 512, seed=7)
    assert_close(dequantize_raw(raw, type_name, (4, 10, 512)), gguf_py(raw, type_name).reshape(4, 10, 512))


def tensor_info(name: str, type_name: str, shape: tuple[int, ...], raw: np.ndarray) -> TensorInfo:
    return TensorInfo(name, type_name, shape, 0, raw.size, raw.reshape(-1))


@pytest.mark.parametrize("type_name", ("Q8_0", "Q5_K", "BF16"))
def test_dequantize_and_rows_of_a_tensor(type_name: str) -> None:
    raw = random_tensor(type_name, 12, 512, seed=3)
    t = tensor_info("blk.0.ffn_up.weight", type_name, (12, 512), raw)
    ref = gguf_py(raw, type_name)
    assert_close(dequantize(t), ref)
    assert_close(dequantize_rows(t, 5, 9), ref[5:9])
    assert dequantize_rows(t, 4, 4).shape == (0, 512)
    with pytest.raises(IndexError, match="out of range"):
        dequantize_rows(t, 3, 13)


def test_unsupported_type_names_type_and_tensor() -> None:
    with pytest.raises(UnsupportedTypeError, match="unsupported tensor type IQ2_XXS in tensor blk.3.attn_q.weight"):
        get_format("IQ2_XXS", "blk.3.attn_q.weight")
    raw = np.zeros(66, dtype=np.uint8)
    t = tensor_info("blk.3.attn_q.weight", "IQ2_XXS", (256,), raw)
    with pytest.raises(UnsupportedTypeError, match="IQ2_XXS in tensor blk.3.attn_q.weight"):
        dequantize(t)
    with pytest.raises(UnsupportedTypeError, match="unsupported tensor type Q8_K"):
        dequantize_raw(np.zeros(292, dtype=np.uint8), "Q8_K", (256,))


def test_byte_count_must_match_shape() -> None:
    with pytest.raises(ValueError, match="do not hold"):
        dequantize_raw(np.zeros(34 * 3, dtype=np.uint8), "Q8_0", (2, 64))
    with pytest.raises(ValueError, match="do not hold"):
        dequantize_raw(np.zeros(34, dtype=np.uint8), "Q8_0", (33,))


def test_raw_may_be_any_dtype_holding_the_bytes() -> None:
    x = np.linspace(-3, 3, 64, dtype=np.float16).reshape(2, 32)
    np.testing.assert_array_equal(dequantize_raw(x, "F16", (2, 32)), x.astype(np.float32))
