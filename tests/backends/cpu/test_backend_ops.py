"""The CPU backend's non-matmul ops against plain numpy/torch formulas (HF's RMSNorm, rotary and attention)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quanta.backends import get_backend
from quanta.backends.base import KVShape
from quanta.engine.model_runner import decode_rows
from quanta.models.base import rope_inv_freq

from batches import placement

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


@pytest.mark.parametrize("dtype,hd", [("f32", 16), ("f16", 16), ("f16", 24), ("f16", 64), ("q8", 16), ("q8", 64)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 20.0)])
def test_paged_attention_of_a_batch(be, window, softcap, dtype, hd):
    """Two sequences on scattered blocks of a shared pool: a 9-token prefill (BLAS path) next to a 3-token one
    (kernel path), then decode steps of both in one batch; each against the naive attention of its own tokens.
    int8 heads of 16 values have one scale group, heads of 64 two groups of 32 (the kernels' fixed-length loop); f16
    heads of 24 values end in a part shorter than the row helpers' 16 lanes."""
    _check_batch(be, window, softcap, dtype, hd, 6, 2)


@pytest.mark.parametrize("n_heads,n_kv", [(5, 5), (8, 2), (7, 1), (4, 1)])
def test_paged_attention_of_every_head_group(be, n_heads, n_kv):
    """The f16 cache's kernel takes a KV head's query heads together, up to four per pass: one head per KV head,
    two passes of four, passes of four and three, and (one KV head, two threads) two passes of two."""
    _check_batch(be, 0, 0.0, "f16", 64, n_heads, n_kv)


def _check_batch(be, window, softcap, dtype, hd, n_heads, n_kv):
    b = 4
    scale = 1 / np.sqrt(hd)  # as the models scale (scores of the same spread at every head size)
    tables = [[5, 2, 7, 0], [3, 6, 1]]
    lengths = [13, 9]
    data = [(randn(n, n_heads, hd), randn(n, n_kv, hd), randn(n, n_kv, hd)) for n in lengths]
    refs = [attention_reference(q, k, v, np.arange(len(q)), scale, window, softcap) for q, k, v in data]
    cache = be.kv_cache(KVShape(1, n_kv, hd, 8, b), dtype)[0]
    # f16: 2^-11 relative per stored value; int8: ~1% of |v| ~ 1
    tol = {"f32": dict(rtol=1e-4, atol=1e-5), "f16": dict(rtol=0, atol=3e-3), "q8": dict(rtol=0, atol=0.03)}[dtype]
    steps = [[(0, 9), (0, 3)]] + [[(9 + i, 1), (3 + i, 1)] for i in range(4)]
    for step in steps:
        meta = be.metadata(placement([(tables[j], first, n) for j, (first, n) in enumerate(step)], b))
        pick = lambda a, j: a[step[j][0]:step[j][0] + step[j][1]]  # noqa: E731
        q, k, v = (np.concatenate([pick(data[j][x], j) for j in range(2)]) for x in range(3))
        out = be.attention(q, k, v, cache, meta, scale=scale, window=window, softcap=softcap)
        want = np.concatenate([pick(refs[j], j) for j in range(2)])
        np.testing.assert_allclose(out, want, **tol)


def test_one_long_decode_over_the_threads(be):
    """One token of one KV head with four query heads over 1,100 keys (69 paged blocks): enough work for the
    threaded kernel, whose two passes of two heads go one to each thread."""
    n_heads, hd, b, n = 4, 64, 16, 1100
    q, k, v = randn(n, n_heads, hd), randn(n, 1, hd), randn(n, 1, hd)
    table = list(np.random.default_rng(1).permutation(-(-n // b)))
    cache = be.kv_cache(KVShape(1, 1, hd, len(table), b), "f16")[0]
    be.attention(q[:-1], k[:-1], v[:-1], cache, be.metadata(placement([(table, 0, n - 1)], b)), scale=0.125)
    out = be.attention(q[-1:], k[-1:], v[-1:], cache, be.metadata(placement([(table, n - 1, 1)], b)), scale=0.125)
    want = attention_reference(q, k, v, np.arange(n), 0.125, 0, 0.0)[-1:]
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-3)




def test_a_decode_batch_on_the_worker_threads_equals_each_token_alone(be, monkeypatch):
    """Eight sequences' decode tokens (f16 cache, nine query heads on three KV heads) make enough work for the
    GEMV's worker threads; each token's output equals, bit for bit, its output decoded alone (on the calling
    thread), and the naive attention's within f16's rounding."""
    from quanta.backends.cpu import attention as cpu_attention

    calls = []
    on_workers = cpu_attention.attention_on_workers
    monkeypatch.setattr(cpu_attention, "attention_on_workers", lambda *a: calls.append(1) or on_workers(*a))
    n_heads, n_kv, hd, b = 9, 3, 64, 16
    lengths = [97, 120, 64, 101, 88, 130, 75, 110]
    tables = np.random.default_rng(2).permutation(sum(-(-n // b) for n in lengths))
    starts = np.cumsum([0] + [-(-n // b) for n in lengths])
    tables = [list(tables[starts[j]:starts[j + 1]]) for j in range(len(lengths))]
    data = [(randn(n, n_heads, hd), randn(n, n_kv, hd), randn(n, n_kv, hd)) for n in lengths]
    cache = be.kv_cache(KVShape(1, n_kv, hd, int(starts[-1]), b), "f16")[0]
    for (q, k, v), table, n in zip(data, tables, lengths):
        be.attention(q[:-1], k[:-1], v[:-1], cache, be.metadata(placement([(table, 0, n - 1)], b)), scale=0.125)
    last = [np.concatenate([d[x][-1:] for d in data]) for x in range(3)]
    meta = be.metadata(placement([(table, n - 1, 1) for table, n in zip(tables, lengths)], b))
    batch = be.attention(*last, cache, meta, scale=0.125)
    assert calls, "the batch did not run on the worker threads"
    for j, ((q, k, v), table, n) in enumerate(zip(data, tables, lengths)):
        alone = be.attention(q[-1:], k[-1:], v[-1:], cache, be.metadata(placement([(table, n - 1, 1)], b)),
                             scale=0.125)
        np.testing.assert_array_equal(batch[j:j + 1], alone)
        want = attention_reference(q, k, v, np.arange(n), 0.125, 0, 0.0)[-1:]
        np.testing.assert_allclose(alone, want, rtol=0, atol=3e-3)
    assert len(calls) == 1

@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("shape", [(3, 50), (20, 2050)])  # rows with a tail past the 16 lanes; the threaded path
def test_gated_activations_match_torch(exact, shape):
    torch = pytest.importorskip("torch")
    be = get_backend("cpu", threads=2, exact=exact)
    g, u = 4 * randn(*shape), randn(*shape)
    tg, tu = torch.from_numpy(g), torch.from_numpy(u)
    np.testing.assert_allclose(be.silu_mul(g, u), (torch.nn.functional.silu(tg) * tu).numpy(), rtol=1e-5, atol=1e-6)
    gelu = torch.nn.functional.gelu(tg, approximate="tanh") * tu
    np.testing.assert_allclose(be.gelu_mul(g, u), gelu.numpy(), rtol=1e-5, atol=1e-6)


def test_add_scale_softcap_rows_argmax(be):
    a, b, bias = randn(4, 8), randn(4, 8), randn(8)
    np.testing.assert_allclose(be.add(a.copy(), b), a + b, rtol=1e-6)
    np.testing.assert_allclose(be.add(a.copy(), bias), a + bias, rtol=1e-6)
    heads = randn(4, 2, 4)  # the same elements as (n, heads, head_dim) rows
    np.testing.assert_allclose(be.add(a.copy(), heads), a + heads.reshape(4, 8), rtol=1e-6)
    with pytest.raises(ValueError):
        be.add(a.copy(), randn(3, 8))
    np.testing.assert_allclose(be.scale(a.copy(), 3.0), a * 3, rtol=1e-6)
    np.testing.assert_allclose(be.softcap(a.copy() * 50, 30.0), 30 * np.tanh(a * 50 / 30), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(be.gather_rows(a, np.asarray([3, 1], np.int32)), a[[3, 1]])
    assert be.argmax_rows(a).tolist() == a.argmax(1).tolist()
    broken = a.copy()
    broken[1, 2], broken[3, 0] = np.nan, np.inf
    assert be.argmax_rows(broken).tolist() == [a[0].argmax(), -1, a[2].argmax(), -1]


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


def test_the_kv_pool_is_resident_only_where_written():
    """A pool of 4 GiB with one slot written per layer and head costs a few pages, not the pool (numpy's large
    arrays ask for 2 MiB huge pages, which made every head's whole row resident)."""
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    from quanta.backends.cpu.kv_cache import CPUKVCache

    before = rss()
    pool = CPUKVCache(KVShape(n_layers=32, n_kv_heads=8, head_dim=64, n_blocks=2048, block_size=16))
    assert pool.nbytes == 2**32
    for layer in range(32):
        k, v, _, _ = pool[layer]
        k[:, 5] = 1.0
        v[:, 5] = 1.0
    assert rss() - before < 64 * 2**20


def test_a_verify_step_attends_as_decode_rows(be):
    """``decode_rows`` (the model runner's: a verify step as one decode row per token, as the captured decode graphs
    run it): two sequences' last tokens and drafts (4 and 2 rows) after their prompts attend as chunks do, each
    draft to the rows before it and its own, against the naive attention of each sequence's tokens."""
    n_heads, n_kv, hd, b = 4, 2, 16, 4
    tables, prompts, rows = [[5, 2, 7, 0], [3, 6, 1]], [7, 5], [4, 2]
    data = [(randn(p + r, n_heads, hd), randn(p + r, n_kv, hd), randn(p + r, n_kv, hd)) for p, r in zip(prompts, rows)]
    refs = [attention_reference(q, k, v, np.arange(len(q)), 0.25, 0, 0.0) for q, k, v in data]
    cache = be.kv_cache(KVShape(1, n_kv, hd, 8, b), "f32")[0]
    for step, meta_of in (([(0, p) for p in prompts], lambda m: m), (list(zip(prompts, rows)), decode_rows)):
        meta = meta_of(placement([(tables[j], first, n) for j, (first, n) in enumerate(step)], b))
        q, k, v = (np.concatenate([data[j][x][f:f + n] for j, (f, n) in enumerate(step)]) for x in range(3))
        out = be.attention(q, k, v, cache, be.metadata(meta), scale=0.25)
    want = np.concatenate([refs[j][p:p + r] for j, (p, r) in enumerate(zip(prompts, rows))])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
