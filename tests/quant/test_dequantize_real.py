"""The reference dequantization against gguf-py on every tensor of both real models."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

import quanta.gguf
from quanta.quant import dequantize, dequantize_rows

WHOLE_TENSOR_LIMIT = 1 << 24  # bigger tensors (token embeddings) are compared in row chunks
ROWS_PER_CHUNK_ELEMENTS = 1 << 23


def check_tensor(t: quanta.gguf.TensorInfo) -> None:
    qtype = GGMLQuantizationType[t.type]
    if t.n_elements <= WHOLE_TENSOR_LIMIT:
        ref = gguf.quants.dequantize(t.raw.reshape(-1), qtype).reshape(t.shape)
        ours = dequantize(t)
        assert ours.dtype == np.float32 and ours.shape == t.shape, t.name
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6 * float(np.abs(ref).max()), err_msg=t.name)
        return
    cols = t.shape[-1]
    n_rows = t.n_elements // cols
    row_bytes = t.nbytes // n_rows
    step = max(1, ROWS_PER_CHUNK_ELEMENTS // cols)
    for start in range(0, n_rows, step):
        stop = min(n_rows, start + step)
        ref = gguf.quants.dequantize(t.raw[start * row_bytes : stop * row_bytes].reshape(stop - start, -1), qtype)
        ours = dequantize_rows(t, start, stop)
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6 * float(np.abs(ref).max()),
                                   err_msg=f"{t.name} rows {start}:{stop}")


@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_every_tensor_matches_gguf_py(model: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    with quanta.gguf.open(path) as f:
        types = set()
        for t in f.tensors.values():
            check_tensor(t)
            types.add(t.type)
    expected = {"Q4_1", "Q8_0", "F32"} if model == "smollm2_path" else {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}
    assert expected <= types
