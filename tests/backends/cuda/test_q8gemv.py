"""The int8-activation decode GEMV and the producers of int8 activations, against numpy: x quantized per 32 in
float64 (round half away from zero), times gguf-py's dequantized weights in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_blocks import ALL_TYPES, gguf_reference, random_raw

from quanta.backends.cuda import activation, norm
from quanta.backends.cuda import q8gemv as q8
from quanta.backends.cuda.qmatmul import INT8_MAX_ROWS, qmatmul
from quanta.backends.cuda.repack import repack

QUANTIZED = [t for t in ALL_TYPES if t not in ("F16", "BF16", "F32")]


def _quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 in element order, d per 32) of float rows x (m, k)."""
    m, k = x.shape
    c = x.astype(np.float64).reshape(m, k // 32, 32)
    amax = np.abs(c).max(axis=2)
    inv = np.where(amax > 0, 127.0 / np.where(amax > 0, amax, 1), 0.0)
    t = c * inv[..., None]
    q = np.trunc(t + np.where(t >= 0, 0.5, -0.5)).astype(np.int8)
    return q.reshape(m, k), (amax / 127.0).astype(np.float32)


def _unpermute(q: torch.Tensor) -> np.ndarray:
    """int8 activations in the dp4a chunk order (byte 4j + b = element 8b + j) → element order."""
    m, k = q.shape
    return q.cpu().numpy().reshape(m, k // 32, 8, 4).transpose(0, 1, 3, 2).reshape(m, k)


def _dequantized_x(xq: q8.Q8Activation) -> np.ndarray:
    m, k = xq.q.shape
    return (_unpermute(xq.q).reshape(m, k // 32, 32).astype(np.float64)
            * xq.d.cpu().numpy().astype(np.float64)[..., None]).reshape(m, k)


def test_quantize_matches_numpy(device: str) -> None:
    x = np.random.default_rng(0).standard_normal((3, 320)).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero chunk: scale 0, codes 0
    xq = q8.quantize(torch.from_numpy(x).to(device))
    want_q, want_d = _quantize_ref(x)
    np.testing.assert_allclose(xq.d.cpu().numpy(), want_d, rtol=1e-6)
    got_q = _unpermute(xq.q).astype(np.int32)
    assert np.abs(got_q - want_q).max() <= 1  # float32 vs float64 rounding at exact halves
    assert (got_q == want_q).mean() > 0.99


@pytest.mark.parametrize("type_name", QUANTIZED)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_q8_matches_reference(type_name: str, m: int, device: str) -> None:
    # n = 18 is not a multiple of the row tile and k = 768 not of every unit tile: the masked paths run too
    n, k = 18, 768
    raw = random_raw(type_name, n, k, np.random.default_rng(1))
    ref_w = gguf_reference(raw, type_name, n, k)
    w = repack(torch.from_numpy(raw.copy()).to(device), type_name, (n, k))
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32)
    xq = q8.quantize(torch.from_numpy(x).to(device))
    want = _dequantized_x(xq) @ ref_w.T + res
    out = torch.full((m, n), float("nan"), device=device)
    got = qmatmul(torch.from_numpy(x).to(device), w, out=out, residual=torch.from_numpy(res).to(device),
                  xq=xq).cpu().numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # and it is a matmul of x: int8 activations cost ~1% relative error
    exact = x.astype(np.float64) @ ref_w.T + res
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.03


@pytest.mark.parametrize("pre", [1, 2])
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q4_0", "Q8_0"])
def test_gemv_q8_tiles_and_split_outputs(type_name: str, pre: int, device: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Several K steps (the first one or two peeled: ``PRE``), whole tiles, and a split epilogue with a bias."""
    for key in list(q8.Q8_CONFIG):
        monkeypatch.setitem(q8.Q8_CONFIG, key, {"BN": 4, "BJ": 8, "num_warps": 1, "PRE": pre})
    n, k = 16, 1024
    raw = random_raw(type_name, n, k, np.random.default_rng(2))
    ref_w = gguf_reference(raw, type_name, n, k)
    w = repack(torch.from_numpy(raw.copy()).to(device), type_name, (n, k))
    x = np.random.default_rng(3).standard_normal((1, k)).astype(np.float32)
    bias = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    xq = q8.quantize(torch.from_numpy(x).to(device))
    outs = [torch.empty((1, c), device=device) for c in (8, 4, 4)]
    qmatmul(torch.from_numpy(x).to(device), w, bias=torch.from_numpy(bias).to(device), outs=outs, xq=xq)
    got = torch.cat(outs, dim=1).cpu().numpy()
    want = _dequantized_x(xq) @ ref_w.T + bias
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_producers_write_int8_copies(device: str) -> None:
    """rms_norm and the gated activations write the same int8 activations as a separate quantize."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((2, 576)).astype(np.float32)).to(device)
    w = torch.from_numpy(rng.standard_normal(576).astype(np.float32)).to(device)
    got = q8.Q8Activation.empty(2, 576, x.device)
    y = norm.rms_norm(x, w, 1e-6, q8=got)
    want = q8.quantize(y)
    assert torch.equal(got.q, want.q) and torch.equal(got.d, want.d)
    g, u = (torch.from_numpy(rng.standard_normal((1, 1536)).astype(np.float32)).to(device) for _ in range(2))
    for fn in (activation.silu_mul, activation.gelu_mul):
        got = q8.Q8Activation.empty(1, 1536, x.device)
        y = fn(g, u, q8=got)
        want = q8.quantize(y)
        assert torch.equal(got.q, want.q) and torch.equal(got.d, want.d)


def test_backend_int8_copies_follow_the_float_values(device: str) -> None:
    """A matmul reads the int8 copy its input's producer wrote, unless an op wrote the input since then."""
    from quanta.backends.cuda.backend import CUDABackend

    be = CUDABackend(device)
    n, k = 64, 256
    raw = random_raw("Q4_K", n, k, np.random.default_rng(6))
    ref_w = gguf_reference(raw, "Q4_K", n, k)
    w = repack(torch.from_numpy(raw.copy()).to(device), "Q4_K", (n, k))
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32)).to(device)
    nw = torch.from_numpy(rng.standard_normal(k).astype(np.float32)).to(device)
    h = be.buffer("h", (1, k))
    be.rms_norm(x, nw, 1e-6, out=h)
    be.add(h, torch.ones(k, device=device))  # h changes after its producer wrote the int8 copy
    got = be.matmul(h, w).cpu().numpy()
    want = h.cpu().numpy().astype(np.float64) @ ref_w.T
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02
    be.rms_norm(x, nw, 1e-6, out=h)
    got = be.matmul(h, w).cpu().numpy()
    want = h.cpu().numpy().astype(np.float64) @ ref_w.T
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02


@pytest.mark.slow
@pytest.mark.parametrize("arch,types,head_dim", [("llama", {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                                                            "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
                                                  32), ("gemma3", {"token_embd": "F16"}, 16)])
def test_default_mode_decode_close_to_cpu_exact(arch: str, types: dict, head_dim: int, tmp_path, device: str,
                                                monkeypatch: pytest.MonkeyPatch, few_programs: None) -> None:
    """Decode in the default mode runs the int8 GEMV and stays within int8-activation error of the CPU's exact
    logits: with the attention writing the o-projection's int8 input (head dim 32) and without (16: the matmul
    quantizes it)."""
    from tiny_models import write_tiny_model

    from quanta import gguf as qgguf
    from quanta.backends.cpu.backend import CPUBackend
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.models import load_model

    calls = []
    monkeypatch.setattr(q8, "gemv_q8", lambda *a, _f=q8.gemv_q8: calls.append(1) or _f(*a))
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, types=types, d_model=256, d_ff=256, n_layers=1,
                            vocab=64, head_dim=head_dim)
    import quanta.backends.cuda.copies as copies_module

    fallbacks = []  # matmul inputs no producer wrote as int8
    monkeypatch.setattr(copies_module, "quantize", lambda *a, _f=q8.quantize: fallbacks.append(1) or _f(*a))
    from batches import BLOCK, TABLES, placement

    logits = []
    tokens = [1, 5, 7, 9, 11]
    for be in (CPUBackend(exact=True), CUDABackend(device)):
        model = load_model(qgguf.open(path), be, 32)
        cache = be.kv_cache(model.kv_shape(12, BLOCK))
        steps = []
        for first, n in ((0, 3), (3, 1), (4, 1)):  # a prefill, then two decode steps
            fallbacks.clear()
            meta = placement([(TABLES[0], first, n)], BLOCK)
            ids = be.from_host(np.asarray(tokens[first:first + n], np.int32))
            steps.append(np.array(be.to_host(model.forward(ids, be.metadata(meta), cache, None)))[-1:])
        logits.append(np.concatenate(steps[1:]))
    want, got = logits
    assert calls, "the int8 GEMV did not run"
    assert (len(fallbacks) == 0) == (head_dim == 32)  # head dim 16: the o-projection quantizes its input
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0"])
def test_rows_do_not_depend_on_their_batch(type_name: str, device: str) -> None:
    """A row's output is the same, bit for bit, whatever rows share its batch, and however many."""
    n, k = 16, 256
    raw = random_raw(type_name, n, k, np.random.default_rng(5))
    w = repack(torch.from_numpy(raw.copy()).to(device), type_name, (n, k))
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((INT8_MAX_ROWS, k)).astype(np.float32)).to(device)

    def product(x: torch.Tensor) -> torch.Tensor:
        return qmatmul(x, w, xq=q8.quantize(x))

    full = product(x)
    for rows in ([3, 1], [INT8_MAX_ROWS - 1, 0, 4, 2]):
        assert torch.equal(product(x[rows].contiguous()), full[rows])


def test_qmatmul_sends_small_batches_to_it(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to INT8_MAX_ROWS rows with an int8 copy: the int8 GEMV; more: the tensor-core GEMM."""
    from quanta.backends.cuda import gemm

    raw = random_raw("Q4_0", 16, 256, np.random.default_rng(7))
    w = repack(torch.from_numpy(raw.copy()).to(device), "Q4_0", (16, 256))
    ran = []
    monkeypatch.setattr(q8, "gemv_q8", lambda *a, **kw: ran.append("gemv"))
    monkeypatch.setattr(gemm, "gemm", lambda *a, **kw: ran.append("gemm"))
    for m in (1, 2, INT8_MAX_ROWS, INT8_MAX_ROWS + 1):
        x = torch.zeros((m, 256), device=device)
        qmatmul(x, w, xq=q8.Q8Activation.empty(m, 256, torch.device(device)) if m <= INT8_MAX_ROWS else None)
    assert ran == ["gemv", "gemv", "gemv", "gemm"]
