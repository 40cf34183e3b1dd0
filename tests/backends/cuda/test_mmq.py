"""The int8 tensor-core matmul of decode batches (mmq.py) against numpy: x quantized per 32 by the backend's own
quantize (checked against numpy in test_q8gemv.py), times gguf-py's dequantized weights in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_blocks import ALL_TYPES, gguf_reference, random_raw
from test_q8gemv import _dequantized_x

from quanta.backends.cuda import mmq
from quanta.backends.cuda import q8gemv as q8
from quanta.backends.cuda.qmatmul import _Epilogue
from quanta.backends.cuda.repack import repack

QUANTIZED = [t for t in ALL_TYPES if t not in ("F16", "BF16", "F32")]
SMALL = {"BM": 16, "BN": 16, "CH": 2, "num_warps": 4, "num_stages": 2}


def _case(type_name: str, n: int, k: int, m: int, device: str, seed: int = 1):
    raw = random_raw(type_name, n, k, np.random.default_rng(seed))
    ref_w = gguf_reference(raw, type_name, n, k)
    w = repack(torch.from_numpy(raw.copy()).to(device), type_name, (n, k))
    x = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32)
    xq = q8.quantize(torch.from_numpy(x).to(device))
    return w, ref_w, x, xq


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_mmq_matches_reference(type_name: str, device: str) -> None:
    # 18 activation rows and 40 weight rows: neither a multiple of its tile (clamped loads, masked stores)
    n, k, m = 40, 256, 18
    w, ref_w, x, xq = _case(type_name, n, k, m, device)
    rng = np.random.default_rng(3)
    res = rng.standard_normal((m, n)).astype(np.float32)
    out = torch.full((m, n), float("nan"), device=device)
    mmq.mmq(xq, w, _Epilogue(out, torch.from_numpy(res).to(device), None, None, n), tiles=SMALL, waves=0)
    want = _dequantized_x(xq) @ ref_w.T + res
    got = out.cpu().numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    exact = x.astype(np.float64) @ ref_w.T + res  # and a matmul of x: int8 activations cost ~1%
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.03


@pytest.mark.parametrize("k,chunks", [(1024, 4), (1280, 16)])
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_mmq_split_k_and_split_outputs(type_name: str, k: int, chunks: int, device: str) -> None:
    """K split over programs (partials summed in order; 40 chunks in steps of 16: the second split's step reads
    past its range, which must count zero), a bias and three outputs."""
    n, m = 32, 5
    w, ref_w, x, xq = _case(type_name, n, k, m, device, seed=4)
    bias = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    outs = [torch.empty((m, c), device=device) for c in (16, 8, 8)]
    tiles = dict(SMALL, CH=chunks)
    assert mmq.k_splits(m, n, k, tiles, 132)[0] == 2  # 16 chunks at least per split
    mmq.mmq(xq, w, _Epilogue(outs[0], None, torch.from_numpy(bias).to(device), outs, n), tiles=tiles)
    got = torch.cat(outs, dim=1).cpu().numpy()
    want = _dequantized_x(xq) @ ref_w.T + bias
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_mmq_rows_do_not_depend_on_their_batch(device: str) -> None:
    """A row's output is the same, bit for bit, whatever rows share its batch (the split depends on the row count
    only through the tile count: here one tile of rows either way)."""
    n, k = 32, 512
    w, _, x, _ = _case("Q4_K", n, k, 9, device, seed=6)

    def product(rows: np.ndarray) -> torch.Tensor:
        out = torch.empty((len(rows), n), device=device)
        mmq.mmq(q8.quantize(torch.from_numpy(rows).to(device)), w, _Epilogue(out, None, None, None, n),
                tiles=SMALL, waves=0)
        return out

    full = product(x)
    for rows in ([3, 1], [8, 0, 4, 2, 7]):
        assert torch.equal(product(x[rows].copy()), full[rows])
