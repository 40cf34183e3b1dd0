"""Flash attention (prefill) and split-KV flash-decoding against a float64 numpy softmax attention, with GQA,
sliding windows, soft-capping and positions read from device memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quanta.backends.cuda.attention import DecodeScratch, attention, write_kv


def reference(q, k_cache, v_cache, pos, scale, window, softcap):
    n, h, hd = q.shape
    group = h // k_cache.shape[0]
    out = np.zeros((n, h, hd))
    for i in range(n):
        keys = np.arange(pos[i] + 1)
        if window:
            keys = keys[keys > pos[i] - window]
        for j in range(h):
            s = k_cache[j // group, keys].astype(np.float64) @ q[i, j] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[i, j] = (p / p.sum()) @ v_cache[j // group, keys]
    return out.reshape(n, h * hd)


CASES = [  # heads, kv heads, head dim, new tokens, start, window, softcap
    (4, 2, 16, 5, 3, 0, 0.0),  # prefill after a cached prefix
    (4, 4, 32, 20, 0, 7, 0.0),  # sliding window inside one prompt
    (6, 2, 24, 1, 70, 0, 0.0),  # decode, several splits, head dim not a power of two
    (4, 1, 16, 1, 130, 50, 30.0),  # decode with window and soft-cap
    (4, 2, 16, 1, 0, 0, 0.0),  # decode of the first token
]


@pytest.mark.parametrize("case", CASES)
def test_attention_matches_reference(case, device: str) -> None:
    h, hkv, hd, n, start, window, softcap = case
    n_ctx = 256
    rng = np.random.default_rng(sum(case[:5]))

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device)

    k_cache, v_cache = t(hkv, n_ctx, hd), t(hkv, n_ctx, hd)
    q, k, v = t(n, h, hd), t(n, hkv, hd), t(n, hkv, hd)
    pos = torch.arange(start, start + n, dtype=torch.int32, device=device)
    write_kv(k, v, k_cache, v_cache, pos)
    np.testing.assert_array_equal(k_cache[:, start:start + n].cpu().numpy(), k.transpose(0, 1).cpu().numpy())
    want = reference(q.cpu().numpy(), k_cache.cpu().numpy(), v_cache.cpu().numpy(), pos.cpu().numpy(),
                     hd ** -0.5, window, softcap)
    scratches = [None, DecodeScratch(h, n_ctx, hd, torch.device(device))] if n == 1 else [None]
    for scratch in scratches:  # decode is checked through both kernels
        out = torch.full((n, h * hd), float("nan"), device=device)
        attention(q, k_cache, v_cache, pos, scale=hd ** -0.5, window=window, softcap=softcap, out=out,
                  scratch=scratch)
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-5)
