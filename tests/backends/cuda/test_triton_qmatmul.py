"""Fused-dequant GEMV (1-4 rows) and GEMM (more rows) and the embedding gather, for every format, against
gguf-py's dequantize followed by a float64 matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_blocks import ALL_TYPES, gguf_reference, random_raw

from quanta.backends.cuda.embed import embed
from quanta.backends.cuda.qmatmul import qmatmul
from quanta.backends.cuda.repack import repack


def _weight(type_name: str, n: int, k: int, device: str, seed: int = 0):
    raw = random_raw(type_name, n, k, np.random.default_rng(seed))
    ref = gguf_reference(raw, type_name, n, k)
    return repack(torch.from_numpy(raw.copy()).to(device), type_name, (n, k)), ref


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("m", [1, 3, 20])
def test_qmatmul_matches_dequantized_matmul(type_name: str, m: int, device: str) -> None:
    # n = 18 is not a multiple of the row tile and k = 768 not of every chunk tile: the masked paths run too
    n, k = 18, 768
    w, ref_w = _weight(type_name, n, k, device)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32)
    want = x.astype(np.float64) @ ref_w.T + res
    out = torch.full((m, n), float("nan"), device=device)
    got = qmatmul(torch.from_numpy(x).to(device), w, out=out, residual=torch.from_numpy(res).to(device),
                  exact=True).cpu().numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q4_0"])
def test_gemv_unmasked_tiles(type_name: str, device: str) -> None:
    """Shapes that fill whole tiles take the unmasked (vectorised) path."""
    n, k = 32, 1024
    w, ref_w = _weight(type_name, n, k, device, seed=3)
    x = np.random.default_rng(4).standard_normal((1, k)).astype(np.float32)
    got = qmatmul(torch.from_numpy(x).to(device), w).cpu().numpy()
    want = x.astype(np.float64) @ ref_w.T
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_embed_gathers_dequantized_rows(type_name: str, device: str) -> None:
    w, ref_w = _weight(type_name, 7, 256, device, seed=5)
    ids = torch.tensor([6, 0, 3, 3], dtype=torch.int32, device=device)
    got = embed(w, ids).cpu().numpy()
    np.testing.assert_allclose(got, ref_w[[6, 0, 3, 3]], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q4_0", "Q3_K"])
@pytest.mark.parametrize("bn,bj,warps", [(2, 8, 1), (4, 16, 2)])
def test_gemv_tile_configs(type_name: str, bn: int, bj: int, warps: int, device: str,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Tile shapes the tuner may pick: several K steps (the first one peeled), masked (n = 18, k = 768) and whole
    (n = 16, k = 1024) tiles."""
    from quanta.backends.cuda import qmatmul as qm

    for key in list(qm.GEMV_CONFIG):
        monkeypatch.setitem(qm.GEMV_CONFIG, key, {"BN": bn, "BJ": bj, "num_warps": warps})
    for n, k in ((18, 768), (16, 1024)):
        w, ref_w = _weight(type_name, n, k, device, seed=n)
        x = np.random.default_rng(k).standard_normal((2, k)).astype(np.float32)
        got = qmatmul(torch.from_numpy(x).to(device), w).cpu().numpy()
        want = x.astype(np.float64) @ ref_w.T
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "F16"])
@pytest.mark.parametrize("m", [1, 5])
def test_fused_split_outputs_with_biases(type_name: str, m: int, device: str) -> None:
    """Three matrices stacked by rows, one launch: each column block lands in its own array, with its bias."""
    from quanta.backends.cuda.repack import fuse

    k, widths = 256, (40, 16, 24)
    parts = [_weight(type_name, n, k, device, seed=10 + i) for i, n in enumerate(widths)]
    rng = np.random.default_rng(m)
    biases = [rng.standard_normal(n).astype(np.float32) for n in widths]
    biases[1] = None
    fused = fuse([w for w, _ in parts], [None if b is None else torch.from_numpy(b).to(device) for b in biases])
    assert fused is not None and fused.widths == widths and fused.nbytes == sum(w.nbytes for w, _ in parts)
    x = rng.standard_normal((m, k)).astype(np.float32)
    outs = [torch.full((m, n), float("nan"), device=device) for n in widths]
    qmatmul(torch.from_numpy(x).to(device), fused.packed, bias=fused.bias, outs=outs, exact=True)
    for (_, ref_w), b, got in zip(parts, biases, outs):
        want = x.astype(np.float64) @ ref_w.T + (0.0 if b is None else b)
        assert np.linalg.norm(got.cpu().numpy() - want) / np.linalg.norm(want) < 1e-5


def test_fuse_refuses_mixed_formats(device: str) -> None:
    from quanta.backends.cuda.repack import fuse

    a, _ = _weight("Q4_K", 16, 256, device)
    b, _ = _weight("Q6_K", 16, 256, device)
    assert fuse([a, b], [None, None]) is None
    assert fuse([a], [None]) is None


@pytest.mark.parametrize("m", [1, 5])
def test_bias_and_residual_into_the_output(m: int, device: str) -> None:
    """``out += x @ W.T + bias`` with the residual being the output itself (the o- and down-projections)."""
    n, k = 18, 256
    w, ref_w = _weight("Q4_0", n, k, device, seed=5)
    rng = np.random.default_rng(6)
    x, res, b = rng.standard_normal((m, k)), rng.standard_normal((m, n)), rng.standard_normal(n)
    out = torch.from_numpy(res.astype(np.float32)).to(device)
    qmatmul(torch.from_numpy(x.astype(np.float32)).to(device), w, out=out, residual=out,
            bias=torch.from_numpy(b.astype(np.float32)).to(device), exact=True)
    want = x @ ref_w.T + b + res
    assert np.linalg.norm(out.cpu().numpy() - want) / np.linalg.norm(want) < 1e-5



@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0", "F16"])
@pytest.mark.parametrize("exact", [True, False])
def test_gemv_grid_in_either_order(type_name: str, exact: bool, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GEMV of several rows launched tiles outermost (the order of weights past TILE_MAJOR_BYTES) gives, bit for
    bit, what rows outermost gives, and both the dequantized reference."""
    from quanta.backends.cuda import q8gemv, qmatmul as qm

    n, k, m = 18, 768, 3
    w, ref_w = _weight(type_name, n, k, device)
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((m, k)).astype(np.float32)).to(device)
    xq = None if exact or type_name == "F16" else q8gemv.quantize(x)
    rows_outer = qmatmul(x, w, exact=exact, xq=xq)
    monkeypatch.setattr(qm, "TILE_MAJOR_BYTES", 0)
    assert qm.gemv_grid(w, 2, m)[1]["TILE_MAJOR"]
    assert torch.equal(qmatmul(x, w, exact=exact, xq=xq), rows_outer)
    want = x.cpu().numpy().astype(np.float64) @ ref_w.T
    assert np.linalg.norm(rows_outer.cpu().numpy() - want) / np.linalg.norm(want) < (1e-5 if xq is None else 0.03)
