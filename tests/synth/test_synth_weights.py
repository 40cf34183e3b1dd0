"""Random block-format weights decode (with gguf-py, an independent decoder) to sensible, finite values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from quanta.synth.random_weights import random_tensor

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("std", [0.02, 0.5])
def test_decoded_weights_have_the_requested_std(type_name, std):
    rng = np.random.default_rng(3)
    shape = (64, 512)
    data = random_tensor(type_name, shape, rng, std=std)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = data.view(np.uint8).reshape(shape[0], -1) if type_name not in ("F32", "F16") else data.reshape(shape)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    assert w.shape == shape and np.isfinite(w).all()
    assert w.std() == pytest.approx(std, rel=0.1)
    assert abs(w.mean()) < 0.15 * std


def test_large_float_tensors_are_gaussian_and_seeded():
    a = random_tensor("F16", (3000, 1024), np.random.default_rng(5))
    b = random_tensor("F16", (3000, 1024), np.random.default_rng(5))
    assert np.array_equal(a, b)
    x = a.astype(np.float64)
    assert x.std() == pytest.approx(0.02, rel=0.05) and abs(x.mean()) < 1e-3
    assert np.mean(np.abs(x) < 0.02) == pytest.approx(0.6827, abs=0.02)  # one-sigma mass of a Gaussian
