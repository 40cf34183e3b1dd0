"""Fast mode's error is that of 8-bit activations, nothing more: it matches ``q8(x) @ W.T`` computed in float64.

The reference quantizes activations per 32 (``d = max|x| / 127``, ``round(x / d)``: llama.cpp's q8_0/q8_1), for
the K-quants' GEMV per 256 (its q8_K), in numpy and multiplies by the gguf-py dequantized weight. A kernel that handles the weights' minimums or offsets
with other sums than the quantized activations' (e.g. the exact fp32 sum) is several times worse than that.
"""

from __future__ import annotations

import gguf as gguf_py
import numpy as np
import pytest

from quanta.backends.cpu import qmatmul as qm
from quanta.backends.cpu.kernels.isa import host_isas
from quanta.gguf.reader import TensorInfo
from quanta.quant import quantize

ON_ISA = {isa: qm.CPUThreads(2, isa=isa) for isa in host_isas()}
FORMATS_WITH_MIN_OR_OFFSET = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _q8(x: np.ndarray, block: int) -> np.ndarray:
    b = x.reshape(x.shape[0], -1, block).astype(np.float64)
    d = np.abs(b).max(-1, keepdims=True) / 127
    q = np.rint(np.divide(b, d, out=np.zeros_like(b), where=d > 0))
    return (q * d).reshape(x.shape)


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(((a - ref) ** 2).mean() / (ref**2).mean()))


@pytest.mark.parametrize("isa", list(ON_ISA))
@pytest.mark.parametrize("type_name", FORMATS_WITH_MIN_OR_OFFSET)
@pytest.mark.parametrize("n", [1, 12])
def test_fast_mode_error_is_the_activation_rounding(type_name, n, isa):
    rng = np.random.default_rng(7)
    m, k = 96, 512
    w = (rng.standard_normal((m, k)) * 0.02 + 0.01).astype(np.float32)  # off-centre: minimums matter
    raw = quantize(w, type_name)
    tensor = TensorInfo("w", type_name, (m, k), 0, raw.nbytes, raw.reshape(-1))
    dense = gguf_py.quants.dequantize(raw, gguf_py.GGMLQuantizationType[type_name]).astype(np.float64)
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[:, 3] *= 25  # an outlier channel, as real activations have
    exact = x.astype(np.float64) @ dense.T
    gemv = n < qm.q8_gemm_min_rows(isa, type_name)
    expected = _rel(_q8(x, 256 if gemv and type_name.endswith("_K") else 32) @ dense.T, exact)
    got = _rel(qm.qmatmul(x, qm.prepare_weight(tensor), ON_ISA[isa], exact=False).astype(np.float64), exact)
    assert got <= 1.1 * expected + 1e-6
