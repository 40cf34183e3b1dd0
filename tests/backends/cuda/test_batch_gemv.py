"""The batched int8 GEMV (a weight read once for several activation rows) against numpy: x quantized per 32 in
float64, times gguf-py's dequantized weights in float64; each row's result independent of the other rows of its
batch; and which rows qmatmul sends to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_blocks import ALL_TYPES, gguf_reference, random_raw
from test_q8gemv import _dequantized_x

from quanta.backends.cuda import batch_gemv
from quanta.backends.cuda import q8gemv as q8
from quanta.backends.cuda.qmatmul import INT8_MAX_ROWS, _Epilogue, qmatmul
from quanta.backends.cuda.repack import repack

QUANTIZED = [t for t in ALL_TYPES if t not in ("F16", "BF16", "F32")]


@pytest.fixture(autouse=True)
def wide_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide row tiles and groups of 4 rows: the interpreter runs the programs one by one."""
    monkeypatch.setattr(batch_gemv, "MIN_PROGRAMS", 1)
    monkeypatch.setattr(batch_gemv, "MAX_GROUP", 4)


def _weight(type_name: str, n: int, k: int, seed: int, device: str):
    raw = random_raw(type_name, n, k, np.random.default_rng(seed))
    return gguf_reference(raw, type_name, n, k), repack(torch.from_numpy(raw.copy()).to(device), type_name, (n, k))


def _batch(xq: q8.Q8Activation, w, residual: torch.Tensor | None = None, **kw) -> torch.Tensor:
    m = xq.q.shape[0]
    out = torch.full((m, w.n), float("nan"), device=xq.q.device)
    batch_gemv.batch_gemv_q8(xq, w, _Epilogue(out, residual, None, None, w.n), **kw)
    return out


@pytest.mark.parametrize("type_name", QUANTIZED)
@pytest.mark.parametrize("m", [2, 5])
def test_batch_gemv_matches_reference(type_name: str, m: int, device: str) -> None:
    """n = 18 is not a multiple of the row tile, k = 768 not of every unit tile (masked paths); 5 rows: a full
    group and a partial one; a residual added into the output."""
    n, k = 18, 768
    ref_w, w = _weight(type_name, n, k, 1, device)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32)
    xq = q8.quantize(torch.from_numpy(x).to(device))
    got = _batch(xq, w, torch.from_numpy(res).to(device)).cpu().numpy()
    want = _dequantized_x(xq) @ ref_w.T + res
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    exact = x.astype(np.float64) @ ref_w.T + res  # and it is a matmul of x: int8 activations cost ~1%
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.03


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_k_steps_split_outputs_and_bias(type_name: str, device: str) -> None:
    """Rows longer than the tile (several K steps per activation row), whole tiles, and a split epilogue with a
    bias."""
    n, k, m = 16, 512, 3
    ref_w, w = _weight(type_name, n, k, 2, device)
    x = np.random.default_rng(3).standard_normal((m, k)).astype(np.float32)
    bias = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    xq = q8.quantize(torch.from_numpy(x).to(device))
    outs = [torch.empty((m, c), device=device) for c in (8, 4, 4)]
    ep = _Epilogue(outs[0], None, torch.from_numpy(bias).to(device), outs, n)  # qmatmul's output side
    batch_gemv.batch_gemv_q8(xq, w, ep, tile={"BM": 2, "BN": 8, "BJ": 8, "num_warps": 1})
    got = torch.cat(outs, dim=1).cpu().numpy()
    want = _dequantized_x(xq) @ ref_w.T + bias
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0"])
def test_rows_do_not_depend_on_their_batch(type_name: str, device: str) -> None:
    """A row's output is the same, bit for bit, whatever rows share its batch, and however many."""
    n, k = 16, 256
    _, w = _weight(type_name, n, k, 5, device)
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((16, k)).astype(np.float32)).to(device)
    full = _batch(q8.quantize(x), w)
    for rows in ([3, 11], [15, 0, 10, 5, 9, 2]):
        sub = x[rows].contiguous()
        assert torch.equal(_batch(q8.quantize(sub), w), full[rows])


def test_qmatmul_sends_small_batches_to_it(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row: the int8 GEMV; 2 to INT8_MAX_ROWS: the batched one; more: the tensor-core GEMM."""
    from quanta.backends.cuda import gemm

    _, w = _weight("Q4_0", 16, 256, 7, device)
    ran = []
    monkeypatch.setattr(q8, "gemv_q8", lambda *a, **kw: ran.append("gemv"))
    monkeypatch.setattr(batch_gemv, "batch_gemv_q8", lambda *a, **kw: ran.append("batch"))
    monkeypatch.setattr(gemm, "gemm", lambda *a, **kw: ran.append("gemm"))
    for m in (1, 2, INT8_MAX_ROWS, INT8_MAX_ROWS + 1):
        x = torch.zeros((m, 256), device=device)
        qmatmul(x, w, xq=q8.Q8Activation.empty(m, 256, torch.device(device)) if m <= INT8_MAX_ROWS else None)
    assert ran == ["gemv", "batch", "batch", "gemm"]


def test_tile_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight row fits the tile (up to MAX_UNITS units), BN shrinks to keep MIN_PROGRAMS row tiles and the
    register budget (but stays even: 2 for small matrices), and groups hold up to MAX_GROUP rows (4 here)."""
    monkeypatch.setattr(batch_gemv, "MIN_PROGRAMS", 256)
    t = batch_gemv._tile(2048, 64, 0, 3)  # a 2,048-wide 4-bit matrix of 2,048 rows
    assert t == {"BM": 4, "BN": 8, "BJ": 64, "num_warps": 2}
    assert batch_gemv._tile(256, 64, 0, 64)["BN"] == 2 and batch_gemv._tile(256, 64, 0, 64)["BM"] == 4
    assert batch_gemv._tile(5632, 344, 2, 8)["BJ"] == batch_gemv.MAX_UNITS
