"""RMSNorm (with and without the fused residual add), RoPE (both pair layouts), gated activations, the in-place
elementwise ops, the device argmax of a batch's rows and the row gather, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quanta.backends.cuda import activation, norm, rope
from quanta.backends.cuda.sampling import ArgmaxRows


def _t(a: np.ndarray, device: str) -> torch.Tensor:
    """A fresh float32 copy: on the CPU, ``from_numpy`` would share memory with ``a`` and with other copies."""
    return torch.from_numpy(np.array(a, dtype=np.float32)).to(device)


def test_rms_norm_and_fused_residual(device: str) -> None:
    rng = np.random.default_rng(0)
    x, r, w = rng.standard_normal((3, 100)), rng.standard_normal((3, 100)), rng.standard_normal(100)

    def ref(a):
        return a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-5) * w

    got = norm.rms_norm(_t(x, device), _t(w, device), 1e-5).cpu().numpy()
    np.testing.assert_allclose(got, ref(x), rtol=1e-5, atol=1e-5)
    xt = _t(x, device)
    got = norm.rms_norm(xt, _t(w, device), 1e-5, residual=_t(r, device)).cpu().numpy()
    np.testing.assert_allclose(xt.cpu().numpy(), x + r, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, ref(x + r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("hd, rot", [(16, 12), (64, 64)])  # only the first `rot` dims rotate; 64: 2 head blocks
def test_rope_rotates_pairs(neox: bool, hd: int, rot: int, device: str) -> None:
    rng = np.random.default_rng(1)
    n, h = 3, 5
    x = rng.standard_normal((n, h, hd)).astype(np.float32)
    pos = np.array([0, 7, 31], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    want = x.astype(np.float64).copy()
    half = rot // 2
    ia, ib = (np.arange(half), np.arange(half) + half) if neox else (np.arange(0, rot, 2), np.arange(1, rot, 2))
    a, b = x[:, :, ia], x[:, :, ib]
    want[:, :, ia], want[:, :, ib] = a * c - b * s, a * s + b * c
    xt = _t(x, device)
    rope.rope(xt, torch.from_numpy(pos).to(device), rope.rope_table(inv_freq, 32, torch.device(device)), neox)
    np.testing.assert_allclose(xt.cpu().numpy(), want, rtol=1e-5, atol=1e-5)


def test_gated_activations_and_inplace_ops(device: str) -> None:
    rng = np.random.default_rng(2)
    g, u = rng.standard_normal((4, 300)) * 4, rng.standard_normal((4, 300))
    silu = g / (1 + np.exp(-g)) * u
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    np.testing.assert_allclose(activation.silu_mul(_t(g, device), _t(u, device)).cpu().numpy(), silu,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(activation.gelu_mul(_t(g, device), _t(u, device)).cpu().numpy(), gelu,
                               rtol=1e-5, atol=1e-5)
    b = rng.standard_normal(300)
    np.testing.assert_allclose(activation.add_(_t(g, device), _t(b, device)).cpu().numpy(), g + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(activation.scale_(_t(g, device), 0.5).cpu().numpy(), g * 0.5, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(activation.softcap_(_t(g * 10, device), 30.0).cpu().numpy(),
                               30 * np.tanh(g * 10 / 30), rtol=1e-5, atol=1e-5)


def test_argmax_rows_take_the_first_maximum_and_flag_broken_rows(device: str) -> None:
    """Per row numpy's argmax (a tie across blocks: the first), and -1 for a row with a NaN or an infinite
    maximum (as the CPU backend)."""
    x = np.random.default_rng(3).standard_normal((6, 5000)).astype(np.float32)
    x[0, 4321] = x[0, 777] = 50.0
    x[2, 100] = np.nan
    x[3, 4999] = np.inf
    x[4] = -np.inf
    am = ArgmaxRows(8, 5000, torch.device(device))
    got = am(_t(x, device)).cpu().numpy()
    want = x.argmax(axis=1)
    want[2:5] = -1
    np.testing.assert_array_equal(got, want)
    assert got[0] == 777
    np.testing.assert_array_equal(am(_t(x[5:], device)).cpu().numpy(), want[5:])  # fewer rows, same scratch


def _packed(allowed: np.ndarray) -> np.ndarray:
    """llguidance's mask layout of a bool (rows, n) array: bit i % 32 of int32 word i // 32."""
    words = (allowed.shape[1] + 31) // 32
    padded = np.zeros((allowed.shape[0], words * 32), np.uint8)
    padded[:, :allowed.shape[1]] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_masked_argmax_is_the_argmax_of_the_allowed_tokens(device: str, backend: str) -> None:
    """Per row the best allowed token (a NaN or inf outside the mask does not matter; nothing allowed: -1), on
    both backends, against numpy over the allowed columns; the mask may end before the row does."""
    rng = np.random.default_rng(5)
    n = 5000
    x = rng.standard_normal((5, n)).astype(np.float32)
    allowed = rng.random((5, n)) < 0.02
    allowed[0] = True  # an unconstrained row in a constrained batch
    x[1, ~allowed[1]] = np.nan  # only disallowed tokens broken
    x[2, np.flatnonzero(~allowed[2])[:3]] = np.inf
    allowed[3] = False
    allowed[4, 4990:] = False
    masks = _packed(allowed)
    masks_short = masks.copy()
    want = np.where(allowed, x, -np.inf).argmax(axis=1)
    want[3] = -1
    if backend == "cuda":
        from quanta.backends.cuda.backend import CUDABackend
        be = CUDABackend(device)
        got = be.to_host(be.argmax_rows(be.from_host(x), masks))
    else:
        from quanta.backends.cpu.backend import CPUBackend
        be = CPUBackend()
        got = be.argmax_rows(x, masks)
    masks[:] = 0  # the backend was done with the masks when it returned
    np.testing.assert_array_equal(got, want)
    short = masks_short[:, :(4990 // 32)]  # the mask's words cover the first 4,960 tokens only
    want_short = np.where(allowed & (np.arange(n) < short.shape[1] * 32), x, -np.inf).argmax(axis=1)
    want_short[3] = -1
    got_short = be.to_host(be.argmax_rows(be.from_host(x), short)) if backend == "cuda" else be.argmax_rows(x, short)
    np.testing.assert_array_equal(got_short, want_short)


def test_backend_gathers_rows_and_argmaxes(device: str) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    be = CUDABackend(device)
    x = np.random.default_rng(4).standard_normal((5, 300)).astype(np.float32)
    rows = be.from_host(np.asarray([4, 0, 2], np.int32))
    got = be.gather_rows(be.from_host(x), rows)
    np.testing.assert_array_equal(be.to_host(got), x[[4, 0, 2]])
    np.testing.assert_array_equal(be.to_host(be.argmax_rows(got)), x[[4, 0, 2]].argmax(axis=1))


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("hq, hk, hd, rot", [(4, 2, 16, 12), (5, 3, 128, 96)])  # 128: 3 query-, 2 key-head blocks
def test_rope_qk_rotates_both_and_stores_the_cache(neox: bool, hq: int, hk: int, hd: int, rot: int,
                                                   device: str) -> None:
    """One launch: q and k rotated like two rope() calls (the reference above) to their positions, k and v stored
    in the pool at their slots (the unrotated tail dims too: rot < hd)."""
    rng = np.random.default_rng(3)
    n, n_ctx = 3, 40
    q, k, v = (rng.standard_normal((n, h, hd)).astype(np.float32) for h in (hq, hk, hk))
    pos = np.array([2, 9, 33], np.int32)
    slots = np.array([17, 0, 38], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    table = rope.rope_table(inv_freq, n_ctx, torch.device(device))
    post = torch.from_numpy(pos).to(device)
    want_q, want_k = _t(q, device), _t(k, device)
    rope.rope(want_q, post, table, neox)
    rope.rope(want_k, post, table, neox)
    qt, kt, vt = _t(q, device), _t(k, device), _t(v, device)
    kc, vc = torch.zeros((hk, n_ctx, hd), device=device), torch.zeros((hk, n_ctx, hd), device=device)
    rope.rope_qk(qt, kt, post, table, neox, v=vt, cache=(kc, vc), slots=torch.from_numpy(slots).to(device))
    np.testing.assert_array_equal(qt.cpu().numpy(), want_q.cpu().numpy())
    np.testing.assert_array_equal(kt.cpu().numpy(), want_k.cpu().numpy())
    np.testing.assert_array_equal(kc.cpu().numpy()[:, slots].transpose(1, 0, 2), want_k.cpu().numpy())
    np.testing.assert_array_equal(vc.cpu().numpy()[:, slots].transpose(1, 0, 2), v)
    others = np.setdiff1d(np.arange(n_ctx), slots)
    assert not kc.cpu().numpy()[:, others].any() and not vc.cpu().numpy()[:, others].any()
    qt2, kt2 = _t(q, device), _t(k, device)
    rope.rope_qk(qt2, kt2, post, table, neox)  # without a cache: rotation only
    np.testing.assert_array_equal(kt2.cpu().numpy(), want_k.cpu().numpy())
