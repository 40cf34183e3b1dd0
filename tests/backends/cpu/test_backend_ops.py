"""The CPU backend's non-matmul ops against plain numpy/torch formulas (HF's RMSNorm, rotary and attention)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quanta.backends import get_backend
from quanta.backends.base import KVShape
from quanta.models.base import rope_inv_freq

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def be():
    return get_backend("cpu", threads=2)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("rows", [1, 64])
def test_rms_norm(be, rows):
    x, w = randn(rows, 96), randn(96)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(be.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-5)
    x3 = x.reshape(rows, 3, 32).copy()
    ref3 = x3 / np.sqrt((x3.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w[:32]
    np.testing.assert_allclose(be.rms_norm(x3, w[:32].copy(), 1e-6, out=x3), ref3, rtol=1e-5, atol=1e-5)


def rotate_reference(x, pos, inv_freq, neox):
    """HF's rotate_half for NEOX; interleaved pairs for NORM (llama.cpp's GGUF layout)."""
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.astype(np.float64).copy()
    half = inv_freq.size
    if neox:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half], out[..., half:2 * half] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = a * cos - b * sin, a * sin + b * cos
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rot", [64, 32])  # 32: partial rotary (only the first dims rotate)
def test_rope(be, neox, rot):
    inv = rope_inv_freq(10000.0, rot)
    x, pos = randn(5, 4, 64), np.array([0, 1, 7, 100, 511], np.int32)
    ref = rotate_reference(x, pos, inv.astype(np.float64), neox)
    got = be.rope(x.copy(), pos, be.rope_table(inv, 512), neox=neox)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_rope_inv_freq_factors_and_scale():
    inv = rope_inv_freq(500000.0, 64, 2.0, np.full(32, 4.0, np.float32))
    ref = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64) / 4.0 / 2.0
    np.testing.assert_allclose(inv, ref, rtol=1e-6)


def attention_reference(q, k_all, v_all, pos, scale, window, softcap):
    """Naive attention of queries at ``pos`` over keys 0..max(pos) with GQA, causal mask and window."""
    n, h, hd = q.shape
    group = h // k_all.shape[1]
    out = np.zeros((n, h, hd))
    for i in range(n):
        keys = np.arange(pos[i] + 1)
        if window:
            keys = keys[keys > pos[i] - window]
        for head in range(h):
            s = k_all[keys, head // group] @ q[i, head].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ v_all[keys, head // group]
    return out.reshape(n, h * hd)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 20.0)])
def test_attention_prefill_then_decode(be, window, softcap):
    n_heads, n_kv, hd, total = 6, 2, 16, 12
    q, k, v = randn(total, n_heads, hd), randn(total, n_kv, hd), randn(total, n_kv, hd)
    pos = np.arange(total, dtype=np.int32)
    ref = attention_reference(q, k, v, pos, 0.25, window, softcap)
    cache = be.kv_cache(KVShape(1, n_kv, hd, 32))[0]
    pre = be.attention(q[:8], k[:8], v[:8], cache, pos[:8], scale=0.25, window=window, softcap=softcap)
    np.testing.assert_allclose(pre, ref[:8], rtol=1e-4, atol=1e-5)
    for t in range(8, total):
        row = be.attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache, pos[t:t + 1], scale=0.25, window=window,
                           softcap=softcap)
        np.testing.assert_allclose(row, ref[t:t + 1], rtol=1e-4, atol=1e-5)


def test_gated_activations_match_torch(be):
    torch = pytest.importorskip("torch")
    g, u = randn(3, 50), randn(3, 50)
    tg, tu = torch.from_numpy(g), torch.from_numpy(u)
    np.testing.assert_allclose(be.silu_mul(g, u), (torch.nn.functional.silu(tg) * tu).numpy(), rtol=1e-5, atol=1e-6)
    gelu = torch.nn.functional.gelu(tg, approximate="tanh") * tu
    np.testing.assert_allclose(be.gelu_mul(g, u), gelu.numpy(), rtol=1e-5, atol=1e-6)


def test_add_scale_softcap_softmax_argmax(be):
    a, b, bias = randn(4, 8), randn(4, 8), randn(8)
    np.testing.assert_allclose(be.add(a.copy(), b), a + b, rtol=1e-6)
    np.testing.assert_allclose(be.add(a.copy(), bias), a + bias, rtol=1e-6)
    heads = randn(4, 2, 4)  # the same elements as (n, heads, head_dim) rows
    np.testing.assert_allclose(be.add(a.copy(), heads), a + heads.reshape(4, 8), rtol=1e-6)
    with pytest.raises(ValueError):
        be.add(a.copy(), randn(3, 8))
    np.testing.assert_allclose(be.scale(a.copy(), 3.0), a * 3, rtol=1e-6)
    np.testing.assert_allclose(be.softcap(a.copy() * 50, 30.0), 30 * np.tanh(a * 50 / 30), rtol=1e-5, atol=1e-5)
    sm = be.softmax(a)
    np.testing.assert_allclose(sm, np.exp(a) / np.exp(a).sum(-1, keepdims=True), rtol=1e-5)
    assert be.argmax(a[2]) == int(np.argmax(a[2]))
    assert be.last_row(a).shape == (1, 8)


def test_buffers_are_reused(be):
    first = be.buffer("t", (1, 16))
    assert be.buffer("t", (1, 16)).__array_interface__["data"] == first.__array_interface__["data"]
    assert be.buffer("t", (4, 16)).shape == (4, 16)


def test_bad_device_and_threads():
    with pytest.raises(ValueError, match="unknown device"):
        get_backend("tpu")
    with pytest.raises(ValueError, match="threads"):
        get_backend("cpu", threads=0)
    assert math.isfinite(get_backend("cpu", threads=1).threads)
