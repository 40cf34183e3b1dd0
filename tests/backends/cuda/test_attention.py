"""Flash attention (prefill) and split-KV flash-decoding against a float64 numpy softmax attention, with GQA,
sliding windows, soft-capping and positions read from device memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from quanta.backends.cuda.attention import attention, write_kv
from quanta.backends.cuda.flash_decode import DecodeScratch, _with_new_row


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
                  scratch=scratch, exact=True)
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("h, hkv, hd, n, start, window, softcap", [
    (4, 2, 16, 5, 3, 0, 0.0), (4, 4, 32, 20, 0, 7, 0.0), (8, 2, 64, 70, 30, 0, 0.0), (4, 1, 128, 40, 0, 0, 0.0),
    (4, 2, 256, 37, 10, 24, 50.0)])
def test_prefill_on_fp16_tensor_cores(h: int, hkv: int, hd: int, n: int, start: int, window: int, softcap: float,
                                      device: str) -> None:
    """The default mode's prefill: an fp16 cache, scores and p·V on fp16 tensor cores (operands rounded to 10-bit
    mantissas), against the float64 reference on the cache as stored."""
    rng = np.random.default_rng(h + hd + n)
    k_cache, v_cache = (torch.from_numpy(rng.standard_normal((hkv, 256, hd)).astype(np.float32))
                        .to(device=device, dtype=torch.float16) for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((n, h, hd)).astype(np.float32)).to(device)
    pos = torch.arange(start, start + n, dtype=torch.int32, device=device)
    out = torch.full((n, h * hd), float("nan"), device=device)
    attention(q, k_cache, v_cache, pos, scale=hd ** -0.5, window=window, softcap=softcap, out=out)
    want = reference(q.cpu().numpy(), k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy(),
                     pos.cpu().numpy(), hd ** -0.5, window, softcap)
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=0, atol=2e-3)  # 10-bit mantissas: ~1e-3 of a score


@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("heads, kv_heads, hd", [(8, 2, 24), (6, 1, 16)])
def test_one_launch_decode_across_positions_and_calls(heads: int, kv_heads: int, hd: int, poll: bool,
                                                      device: str) -> None:
    """One scratch reused call after call (as by every layer of a CUDA graph): one live split, several, a position
    on a split boundary (the last split holds one key), the last position, and windows that leave early splits
    dead. The ticket counters must be back at zero after every call, or the next call would combine nothing; with
    polling, every partial slot read must be back to NaN, or the next call could take a stale one."""
    n_ctx = 256  # 4 splits of 64 keys, in tiles of 16
    rng = np.random.default_rng(heads * 100 + hd)
    k_cache, v_cache, q = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(device)
                           for s in ((kv_heads, n_ctx, hd), (kv_heads, n_ctx, hd), (1, heads, hd)))
    scratch = DecodeScratch(heads, n_ctx, hd, torch.device(device), chunk=64, poll=poll, tile_kb=1)
    assert scratch.nprog == 4
    kc, vc, qn = k_cache.cpu().numpy(), v_cache.cpu().numpy(), q.cpu().numpy()
    for pos, window, softcap in [(0, 0, 0.0), (5, 0, 0.0), (63, 0, 0.0), (64, 0, 0.0), (130, 0, 20.0), (255, 0, 0.0),
                                 (127, 64, 0.0), (130, 50, 0.0), (64, 1, 0.0), (200, 100, 20.0), (1, 0, 0.0)]:
        p = torch.tensor([pos], dtype=torch.int32, device=device)
        out = torch.full((1, heads * hd), float("nan"), device=device)
        attention(q, k_cache, v_cache, p, scale=hd ** -0.5, window=window, softcap=softcap, out=out, scratch=scratch)
        want = reference(qn, kc, vc, np.array([pos]), hd ** -0.5, window, softcap)
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-5, err_msg=f"pos {pos} w {window}")
        assert not scratch.count.cpu().numpy().any()
        if poll:
            assert scratch.m[:heads].isnan().all() and scratch.o[:heads, :, :hd].isnan().all()


MODEL_SHAPES = [  # heads, kv heads, head dim: TinyLlama, Llama-3.2-1B's group of 4 (with 2 of its 8 KV heads),
    (32, 4, 64), (8, 2, 64), (12, 2, 128), (4, 1, 256), (9, 3, 64), (2, 2, 64)]  # Qwen2.5, Gemma-3, SmolLM2, MHA


@pytest.mark.parametrize("heads, kv_heads, hd", MODEL_SHAPES)
def test_decode_on_model_shapes(heads: int, kv_heads: int, hd: int, device: str) -> None:
    """Groups 8/4/6/4/3/1 and head dims 64-256 at positions inside the first chunk, on tile and chunk boundaries and
    deep enough for many chunks (several combine steps), with sliding windows that start mid-tile and cross chunk
    boundaries, and soft-capping; chunks of 32 and 128 keys, and a program cap that lengthens deep chunks."""
    n_ctx = 1040
    rng = np.random.default_rng(heads * 1000 + hd)
    k_cache, v_cache, q = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(device)
                           for s in ((kv_heads, n_ctx, hd), (kv_heads, n_ctx, hd), (1, heads, hd)))
    kc, vc, qn = k_cache.cpu().numpy(), v_cache.cpu().numpy(), q.cpu().numpy()
    for chunk, cap in ((32, 32), (128, 32), (32, 5)):
        scratch = DecodeScratch(heads, n_ctx, hd, torch.device(device), chunk=chunk, max_programs=cap)
        for pos, window, softcap in [(0, 0, 0.0), (63, 0, 0.0), (64, 0, 0.0), (100, 0, 0.0), (127, 0, 30.0),
                                     (128, 0, 0.0), (1000, 0, 0.0), (1039, 0, 50.0), (1000, 512, 0.0),
                                     (700, 300, 0.0), (200, 129, 20.0), (129, 1, 0.0)]:
            p = torch.tensor([pos], dtype=torch.int32, device=device)
            out = torch.full((1, heads * hd), float("nan"), device=device)
            attention(q, k_cache, v_cache, p, scale=hd ** -0.5, window=window, softcap=softcap, out=out,
                      scratch=scratch)
            want = reference(qn, kc, vc, np.array([pos]), hd ** -0.5, window, softcap)
            np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"chunk {chunk} pos {pos} window {window}")
            assert not scratch.count.cpu().numpy().any()


@pytest.mark.parametrize("heads, kv_heads, hd", MODEL_SHAPES[1:5])
@pytest.mark.parametrize("cache_dtype, dot", [(torch.float16, "fp16"), (torch.float16, "ieee"),
                                              (torch.float32, "tf32")])
def test_decode_on_tensor_cores_and_fp16_cache(heads: int, kv_heads: int, hd: int, cache_dtype: torch.dtype, dot: str,
                                               device: str) -> None:
    """The default mode's decode: K/V stored as fp16 and/or scores and p·V on tensor cores (operands rounded to
    10-bit mantissas, group padded to 16 rows), against the float64 reference on the cache as stored."""
    n_ctx = 700
    rng = np.random.default_rng(heads + hd)
    k_cache, v_cache = (torch.from_numpy(rng.standard_normal((kv_heads, n_ctx, hd)).astype(np.float32))
                        .to(device=device, dtype=cache_dtype) for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((1, heads, hd)).astype(np.float32)).to(device)
    kc, vc = k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy()
    scratch = DecodeScratch(heads, n_ctx, hd, torch.device(device), dot=dot)
    for pos, window, softcap in [(0, 0, 0.0), (40, 0, 0.0), (100, 0, 0.0), (127, 0, 0.0), (128, 0, 0.0), (699, 0, 0.0),
                                 (650, 300, 30.0)]:  # up to 128 keys: one program at head dim 128 ("solo")
        p = torch.tensor([pos], dtype=torch.int32, device=device)
        out = torch.full((1, heads * hd), float("nan"), device=device)
        attention(q, k_cache, v_cache, p, scale=hd ** -0.5, window=window, softcap=softcap, out=out, scratch=scratch)
        want = reference(q.cpu().numpy(), kc, vc, np.array([pos]), hd ** -0.5, window, softcap)
        tol = 1e-5 if dot == "ieee" else 2e-3  # 10-bit mantissas: ~1e-3 of a score
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=0, atol=tol, err_msg=f"pos {pos}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and concurrent programs need the GPU")
@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("heads, kv_heads, hd", [(32, 4, 64), (12, 2, 128)])
def test_one_launch_decode_in_a_cuda_graph(heads: int, kv_heads: int, hd: int, poll: bool, device: str) -> None:
    """On the GPU the split programs run concurrently and in any order: the ticket must still elect exactly one
    combiner per KV head, see every partial, and leave the counters at zero, replay after replay; the polling
    combiner must never take a partial before it lands (nor a stale one)."""
    n_ctx = 1024
    rng = np.random.default_rng(7)
    k_cache, v_cache, q = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(device)
                           for s in ((kv_heads, n_ctx, hd), (kv_heads, n_ctx, hd), (1, heads, hd)))
    scratch = DecodeScratch(heads, n_ctx, hd, torch.device(device), poll=poll)
    pos = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.empty((1, heads * hd), device=device)
    attention(q, k_cache, v_cache, pos, scale=hd ** -0.5, out=out, scratch=scratch)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention(q, k_cache, v_cache, pos, scale=hd ** -0.5, out=out, scratch=scratch)
    kc, vc, qn = k_cache.cpu().numpy(), v_cache.cpu().numpy(), q.cpu().numpy()
    for p in [0, 63, 64, 500, 1023]:
        want = reference(qn, kc, vc, np.array([p]), hd ** -0.5, 0, 0.0)
        pos.fill_(p)
        for _ in range(20):
            out.fill_(float("nan"))
            graph.replay()
            np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-5, err_msg=f"pos {p}")
        assert not scratch.count.cpu().numpy().any()


@pytest.mark.parametrize("heads, kv_heads, hd", [(12, 2, 128), (9, 3, 64)])
def test_decode_writes_int8_output(heads: int, kv_heads: int, hd: int, device: str) -> None:
    """With ``q8``, the decode kernel also writes its output as the int8 activations a separate quantize would
    (one program writing it directly, and the combine of several)."""
    from quanta.backends.cuda.q8gemv import Q8Activation, quantize

    n_ctx = 256
    rng = np.random.default_rng(hd)
    k_cache, v_cache, q = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(device)
                           for s in ((kv_heads, n_ctx, hd), (kv_heads, n_ctx, hd), (1, heads, hd)))
    scratch = DecodeScratch(heads, n_ctx, hd, torch.device(device), chunk=32)
    for pos in (20, 200):
        out = torch.empty((1, heads * hd), device=device)
        got = Q8Activation.empty(1, heads * hd, torch.device(device))
        attention(q, k_cache, v_cache, torch.tensor([pos], dtype=torch.int32, device=device), scale=hd ** -0.5,
                  out=out, scratch=scratch, q8=got)
        want = quantize(out)
        assert torch.equal(got.q, want.q) and torch.equal(got.d, want.d)


@triton.jit
def _new_row_kernel(kc_ptr, vc_ptr, ko_ptr, vo_ptr, pos, start, HD, BN: tl.constexpr, BD: tl.constexpr):
    p = start + tl.arange(0, BN)
    d = tl.arange(0, BD)
    k = tl.full([BN, BD], -1.0, tl.float16)  # what a tile read before the PDL wait may hold
    v = tl.full([BN, BD], -2.0, tl.float16)
    k, v = _with_new_row(k, v, kc_ptr, vc_ptr, p, pos, d, d < HD, HD)
    offs = tl.arange(0, BN)[:, None] * BD + d[None, :]
    tl.store(ko_ptr + offs, k)
    tl.store(vo_ptr + offs, v)


@pytest.mark.parametrize("pos", [16, 21, 31])
def test_the_new_key_row_is_read_again(pos: int, device: str) -> None:
    """After its PDL wait the decode kernel reads again only row ``pos`` of its tile (the key and value the Q/K/V
    projection just stored): that row from the cache, every other row as read before the wait."""
    n_ctx, hd, bd, bn, start = 64, 48, 64, 16, 16
    rng = np.random.default_rng(pos)
    kc, vc = (torch.from_numpy(rng.standard_normal((n_ctx, hd)).astype(np.float16)).to(device) for _ in range(2))
    ko, vo = (torch.empty((bn, bd), dtype=torch.float16, device=device) for _ in range(2))
    _new_row_kernel[(1,)](kc, vc, ko, vo, pos, start, hd, BN=bn, BD=bd)
    for got, cache, old in ((ko, kc, -1.0), (vo, vc, -2.0)):
        want = np.full((bn, bd), old, dtype=np.float16)
        want[pos - start, :hd] = cache[pos].cpu().numpy()
        np.testing.assert_array_equal(got.cpu().numpy(), want)
