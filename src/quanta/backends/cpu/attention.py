"""Causal GQA attention over the KV-cache arena, with sliding window and score soft-capping (numba).

Cache layout per layer: K and V of (n_kv_heads, n_ctx, head_dim) float32, so one head's keys are contiguous.
The new tokens' K/V are written at their positions first. Decode (few queries): a numba kernel where each
(query, head) pair computes its scores into a per-thread scratch row (n_ctx floats), a float32 softmax and the
weighted sum of V. Prefill: the same formula with BLAS over each kv head's score matrix. Both are the textbook
formula of HF's eager attention; tests compare them with a naive numpy version.
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc", "contract"})  # vectorised dot products
def attention_kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                     positions: np.ndarray, scale: float, window: int, softcap: float, scratch: np.ndarray,
                     out: np.ndarray) -> None:
    n, n_heads, hd = q.shape
    n_kv = k.shape[1]
    for i in range(n):
        p = positions[i]
        for h in range(n_kv):
            for d in range(hd):
                k_cache[h, p, d] = k[i, h, d]
                v_cache[h, p, d] = v[i, h, d]
    group = n_heads // n_kv
    for t in numba.prange(n * n_heads):
        i, h = t // n_heads, t % n_heads
        kh = h // group
        p = positions[i]
        lo = max(0, p - window + 1) if window > 0 else 0
        s = scratch[numba.get_thread_id()]
        m = -np.inf
        for j in range(lo, p + 1):
            acc = np.float32(0.0)
            for d in range(hd):
                acc += q[i, h, d] * k_cache[kh, j, d]
            acc *= np.float32(scale)
            if softcap > 0:
                acc = np.float32(softcap * math.tanh(acc / softcap))
            s[j - lo] = acc
            m = max(m, acc)
        total = np.float32(0.0)
        for j in range(p + 1 - lo):
            e = np.float32(math.exp(s[j] - m))
            s[j] = e
            total += e
        o = out[i, h * hd:(h + 1) * hd]
        o[:] = 0.0
        for j in range(p + 1 - lo):
            w = s[j] / total
            for d in range(hd):
                o[d] += w * v_cache[kh, lo + j, d]


def attention_blas(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   positions: np.ndarray, scale: float, window: int, softcap: float, out: np.ndarray) -> None:
    """The same attention for many queries (prefill): per kv head, scores = Q·Kᵀ and P·V through BLAS sgemm,
    with the causal / sliding-window mask applied to the score matrix."""
    n, n_heads, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    k_cache[:, positions] = k.transpose(1, 0, 2)
    v_cache[:, positions] = v.transpose(1, 0, 2)
    n_keys = int(positions.max()) + 1
    key_pos = np.arange(n_keys, dtype=np.int32)
    allowed = key_pos[None, :] <= positions[:, None]
    if window > 0:
        allowed &= key_pos[None, :] > positions[:, None] - window
    blocked = np.repeat(~allowed, group, axis=0)  # rows: (token, head in group)
    o = out.reshape(n, n_heads, hd)
    for h in range(n_kv):
        qh = q[:, h * group:(h + 1) * group].reshape(n * group, hd)
        s = qh @ k_cache[h, :n_keys].T
        s *= np.float32(scale)
        if softcap > 0:
            np.tanh(s / np.float32(softcap), out=s)
            s *= np.float32(softcap)
        s[blocked] = -np.inf
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=1, keepdims=True)
        o[:, h * group:(h + 1) * group] = (s @ v_cache[h, :n_keys]).reshape(n, group, hd)
