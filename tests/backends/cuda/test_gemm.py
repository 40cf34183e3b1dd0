"""The prefill GEMM (gemm.py) for every format, in both modes, against gguf-py's dequantize followed by a float64
matmul; with the epilogue's bias, residual and split outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_blocks import ALL_TYPES, gguf_reference, random_raw

from quanta.backends.cuda.gemm import GEMM_TILES, dequantize_words, gemm, k_splits
from quanta.backends.cuda.qmatmul import _Epilogue
from quanta.backends.cuda.repack import fuse, repack

# bf16 keeps 8 significant bits: each operand is off by up to 2^-9 relative (round to nearest; the interpreter
# truncates: 2^-8), so a product by up to ~2^-7; with random signs the sum's error is ~that RMS of the products'
# error: a few 1e-3 of |y|, never near 1e-2.
BF16_TOL = 1e-2
EXACT_TOL = 1e-5
QUANTIZED = [t for t in ALL_TYPES if t not in ("F16", "BF16", "F32")]
DENSE_TILE = {"BM": 32, "BN": 64, "BK": 64, "SWAP": False, "num_warps": 4, "num_stages": 2}  # small, for the interpreter


def _weight(type_name: str, n: int, k: int, device: str, seed: int = 0):
    raw = random_raw(type_name, n, k, np.random.default_rng(seed))
    ref = gguf_reference(raw, type_name, n, k)
    return repack(torch.from_numpy(raw.copy()).to(device), type_name, (n, k)), ref


def _rel(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.cpu().numpy() - want) / np.linalg.norm(want))


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("exact", [False, True])
def test_gemm_matches_dequantized_matmul(type_name: str, exact: bool, device: str) -> None:
    # m = 37 and n = 72 fill no tile; k = 288 is no multiple of the K step (64): the masked tail runs
    m, n, k = 37, 72, 512 if type_name.endswith("_K") else 288
    w, ref_w = _weight(type_name, n, k, device)
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    out = torch.full((m, n), float("nan"), device=device)
    gemm(torch.from_numpy(x).to(device), w, _Epilogue(out, None, None, None, n), exact)
    assert _rel(out, x.astype(np.float64) @ ref_w.T) < (EXACT_TOL if exact else BF16_TOL)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("swap", [False, True])
def test_tiles_with_several_k_steps(type_name: str, swap: bool, device: str) -> None:
    """Whole tiles (m = 32, n = 64, k = 512 in 64-wide steps), both operand orders."""
    m, n, k = 32, 64, 512
    w, ref_w = _weight(type_name, n, k, device, seed=2)
    x = np.random.default_rng(3).standard_normal((m, k)).astype(np.float32)
    out = torch.full((m, n), float("nan"), device=device)
    tiles = {"BM": 32, "BN": 64, "BK": 64, "SWAP": swap, "num_warps": 4, "num_stages": 2}
    gemm(torch.from_numpy(x).to(device), w, _Epilogue(out, None, None, None, n), False, tiles)
    assert _rel(out, x.astype(np.float64) @ ref_w.T) < BF16_TOL


@pytest.mark.parametrize("exact", [False, True])
def test_bias_and_residual_into_the_output(exact: bool, device: str) -> None:
    """``out += x @ W.T + bias`` with the residual being the output itself (the o- and down-projections)."""
    m, n, k = 5, 80, 256
    w, ref_w = _weight("Q4_0", n, k, device, seed=5)
    rng = np.random.default_rng(6)
    x, res, b = rng.standard_normal((m, k)), rng.standard_normal((m, n)), rng.standard_normal(n)
    out = torch.from_numpy(res.astype(np.float32)).to(device)
    bias = torch.from_numpy(b.astype(np.float32)).to(device)
    gemm(torch.from_numpy(x.astype(np.float32)).to(device), w, _Epilogue(out, out, bias, None, n), exact)
    assert _rel(out, x @ ref_w.T + b + res) < (EXACT_TOL if exact else BF16_TOL)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "F16"])
def test_fused_split_outputs_with_biases(type_name: str, device: str) -> None:
    """Three matrices stacked by rows, one launch: each column block lands in its own array, with its bias."""
    m, k, widths = 37, 256, (40, 16, 24)
    parts = [_weight(type_name, n, k, device, seed=10 + i) for i, n in enumerate(widths)]
    rng = np.random.default_rng(7)
    biases = [rng.standard_normal(n).astype(np.float32) for n in widths]
    biases[1] = None
    fused = fuse([w for w, _ in parts], [None if b is None else torch.from_numpy(b).to(device) for b in biases])
    x = rng.standard_normal((m, k)).astype(np.float32)
    outs = [torch.full((m, n), float("nan"), device=device) for n in widths]
    gemm(torch.from_numpy(x).to(device), fused, _Epilogue(outs[0], None, fused.bias, outs, sum(widths)), True)
    for (_, ref_w), b, got in zip(parts, biases, outs):
        assert _rel(got, x.astype(np.float64) @ ref_w.T + (0.0 if b is None else b)) < EXACT_TOL



def test_k_split_rule() -> None:
    """Fast mode splits K while the output tiles fill fewer than SPLIT_WAVES (4) waves of the multiprocessors, each
    split at least four K steps; exact mode never splits."""
    tiny = GEMM_TILES[("fast", "tiny")]
    assert k_splits(16, 2048, 2048, tiny, False, 132) == (8, 256)  # 32 tiles, 32 K steps
    assert k_splits(16, 2048, 5632, tiny, False, 132) == (15, 384)  # 88 steps: 15 splits of 6 (the last of 4)
    assert k_splits(16, 11264, 2048, tiny, False, 132) == (3, 704)  # 176 tiles
    assert k_splits(16, 32000, 2048, tiny, False, 132) == (2, 1024)  # 500 tiles
    assert k_splits(16, 64000, 2048, tiny, False, 132) == (1, 2048)  # 1,000 tiles: four waves already
    assert k_splits(16, 64, 192, tiny, False, 132) == (1, 192)  # too short to split
    assert k_splits(16, 2048, 2048, GEMM_TILES[("exact", "tiny")], True, 132)[0] == 1


@pytest.mark.parametrize("type_name,sms,splits", [("Q4_K", 132, 4), ("Q5_0", 132, 4), ("Q4_K", 1, 3)])
def test_split_k_sums_then_applies_the_epilogue(type_name: str, sms: int, splits: int, device: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Split K (16 steps: 4 splits of 4; on one multiprocessor 3 splits of 6, so a split starts inside a K-quant
    super-block), the partials summed before the epilogue: a bias and a residual that is the output itself, or a
    bias and three split outputs."""
    from quanta.backends.cuda import gemm as gemm_module

    monkeypatch.setattr(gemm_module, "_sms", lambda device: sms)
    monkeypatch.setattr(gemm_module, "SPLIT_WAVES", 3)
    m, k, widths = 5, 1024, (40, 16, 8)
    n = sum(widths)
    assert gemm_module.k_splits(m, n, k, GEMM_TILES[("fast", "tiny")], False, sms)[0] == splits
    w, ref_w = _weight(type_name, n, k, device, seed=8)
    rng = np.random.default_rng(9)
    x, res, b = rng.standard_normal((m, k)), rng.standard_normal((m, n)), rng.standard_normal(n)
    want = x @ ref_w.T + b
    xt, bias = torch.from_numpy(x.astype(np.float32)).to(device), torch.from_numpy(b.astype(np.float32)).to(device)
    out = torch.from_numpy(res.astype(np.float32)).to(device)
    gemm(xt, w, _Epilogue(out, out, bias, None, n), False)
    assert _rel(out, want + res) < BF16_TOL
    outs = [torch.full((m, c), float("nan"), device=device) for c in widths]
    gemm(xt, w, _Epilogue(outs[0], None, bias, outs, n), False)
    assert _rel(torch.cat(outs, dim=1), want) < BF16_TOL


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_gemm_through_a_dequantized_scratch(type_name: str, device: str) -> None:
    """Fast mode from DEQUANT_MIN_ROWS rows: the weight dequantized into a bf16 scratch in word order (column
    ``32c + NS*w + s`` holds weight ``32c + NW*s + w``), then multiplied as a dense matrix."""
    m, n, k = 37, 72, 512 if type_name.endswith("_K") else 288
    w, ref_w = _weight(type_name, n, k, device)
    scratch = torch.full((n * k + 5,), float("nan"), dtype=torch.bfloat16, device=device)
    rows = dequantize_words(w, scratch).float().cpu().numpy()
    nw = 4 if w.kind == "q4" else 8
    np.testing.assert_allclose(rows, ref_w.reshape(n, k // 32, 32 // nw, nw).transpose(0, 1, 3, 2).reshape(n, k),
                               rtol=2 ** -7, atol=1e-30)  # bf16: 8 significant bits
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    out = torch.full((m, n), float("nan"), device=device)
    gemm(torch.from_numpy(x).to(device), w, _Epilogue(out, None, None, None, n), False, DENSE_TILE, scratch=scratch)
    assert _rel(out, x.astype(np.float64) @ ref_w.T) < BF16_TOL


def test_dequantized_gemm_into_split_outputs_and_the_residual(device: str) -> None:
    """The epilogue is the fused GEMM's: q|k|v stacked with biases into three arrays, and ``out += x @ W.T``."""
    m, k, widths = 37, 256, (40, 16, 24)
    parts = [_weight("Q4_K", n, k, device, seed=20 + i) for i, n in enumerate(widths)]
    rng = np.random.default_rng(8)
    biases = [rng.standard_normal(n).astype(np.float32) for n in widths]
    fused = fuse([w for w, _ in parts], [torch.from_numpy(b).to(device) for b in biases])
    x = rng.standard_normal((m, k)).astype(np.float32)
    outs = [torch.full((m, n), float("nan"), device=device) for n in widths]
    scratch = torch.empty(sum(widths) * k, dtype=torch.bfloat16, device=device)
    xt = torch.from_numpy(x).to(device)
    gemm(xt, fused, _Epilogue(outs[0], None, fused.bias, outs, sum(widths)), False, DENSE_TILE, scratch=scratch)
    for (_, ref_w), b, got in zip(parts, biases, outs):
        assert _rel(got, x.astype(np.float64) @ ref_w.T + b) < BF16_TOL
    (w, ref_w), out = parts[0], outs[0]  # the o- and down-projections: the output is its own residual
    gemm(xt, w, _Epilogue(out, out, None, None, w.n), False, DENSE_TILE, scratch=scratch)
    assert _rel(out, 2 * (x.astype(np.float64) @ ref_w.T) + biases[0]) < BF16_TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_split_k_in_a_captured_graph_equals_eager() -> None:
    """The partials of a split-K GEMM allocated inside a CUDA graph capture (the decode graphs of 8-64 rows): its
    replays equal the eager product, bit for bit."""
    m, n, k = 16, 256, 2048
    w, _ = _weight("Q4_K", n, k, "cuda", seed=11)
    assert k_splits(m, n, k, GEMM_TILES[("fast", "tiny")], False, 132)[0] > 1
    x = torch.randn(m, k, device="cuda")
    want = torch.empty(m, n, device="cuda")
    gemm(x, w, _Epilogue(want, None, None, None, n), False)
    out = torch.empty(m, n, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(x, w, _Epilogue(out, None, None, None, n), False)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
