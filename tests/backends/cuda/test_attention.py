"""Paged attention against a float64 numpy softmax attention: split-KV flash decoding of a batch of sequences and
varlen flash prefill (chunks after a cached prefix, several sequences in one launch), on scattered block tables,
with GQA, sliding windows and soft-capping."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from quanta.backends.base import AttentionMetadata
from quanta.backends.cuda.attention import attention, write_kv
from quanta.backends.cuda.flash_decode import DecodeScratch, _with_new_row, slot_index


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos: np.ndarray, scale: float, window: int,
              softcap: float) -> np.ndarray:
    """q (n, h, hd) of one sequence at ``pos``; keys, values (length, hkv, hd) of its positions 0.. → (n, h*hd)."""
    n, h, hd = q.shape
    group = h // keys.shape[1]
    out = np.zeros((n, h, hd))
    for i in range(n):
        seen = np.arange(pos[i] + 1)
        if window:
            seen = seen[seen > pos[i] - window]
        for j in range(h):
            s = keys[seen, j // group].astype(np.float64) @ q[i, j].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[i, j] = (p / p.sum()) @ values[seen, j // group]
    return out.reshape(n, h * hd)


class Pool:
    """A pool of random K/V (hkv, n_blocks * block, hd) and sequences on scattered blocks of it."""

    def __init__(self, lengths: list[int], hkv: int, hd: int, block: int, device: str, rng: np.random.Generator,
                 dtype: torch.dtype = torch.float32):
        self.block, self.device = block, device
        need = [-(-n // block) for n in lengths]
        n_blocks = sum(need) + 3
        order = rng.permutation(n_blocks)
        self.tables, o = [], 0
        for k in need:
            self.tables.append(order[o:o + k].astype(np.int32))
            o += k
        kv = rng.standard_normal((2, hkv, n_blocks * block, hd)).astype(np.float32)
        self.k, self.v = (torch.from_numpy(a).to(device=device, dtype=dtype) for a in kv)
        self.width = max(need)

    def slots(self, j: int, positions: np.ndarray) -> np.ndarray:
        t = self.tables[j]
        return (t[positions // self.block] * self.block + positions % self.block).astype(np.int32)

    def keys(self, j: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence j's K and V of positions 0..length-1, as (length, hkv, hd) float64 (the pool as stored)."""
        s = self.slots(j, np.arange(length))
        return (self.k.float().cpu().numpy()[:, s].transpose(1, 0, 2).astype(np.float64),
                self.v.float().cpu().numpy()[:, s].transpose(1, 0, 2).astype(np.float64))

    def meta(self, chunks: list[tuple[int, int]]) -> AttentionMetadata:
        """Device metadata of one forward: sequence j computes positions chunks[j] = (first, count)."""
        tables = np.zeros((len(chunks), self.width), np.int32)
        positions, slots, token_seq, starts = [], [], [], [0]
        for j, (first, n) in enumerate(chunks):
            tables[j, :len(self.tables[j])] = self.tables[j]
            p = np.arange(first, first + n)
            positions += list(p)
            slots += list(self.slots(j, p))
            token_seq += [j] * n
            starts.append(starts[-1] + n)

        def dev(a) -> torch.Tensor:
            return torch.from_numpy(np.asarray(a, np.int32)).to(self.device)

        return AttentionMetadata(dev(positions), dev(slots), dev(token_seq), dev(tables),
                                 dev([f + n for f, n in chunks]), dev(starts), len(chunks),
                                 max(n for _, n in chunks), self.block)


def _decode_batch(pool: Pool, lengths: list[int], q: torch.Tensor, scratch: DecodeScratch | None, window: int,
                  softcap: float, q8=None, fresh: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One decode step of every sequence (its last position): the kernel's output and the reference."""
    n, h, hd = q.shape
    meta = dataclasses.replace(pool.meta([(length - 1, 1) for length in lengths]), fresh=fresh)
    out = torch.full((n, h * hd), float("nan"), device=q.device)
    attention(q, pool.k, pool.v, meta, scale=hd ** -0.5, window=window, softcap=softcap, out=out, scratch=scratch,
              exact=scratch is None or scratch.dot == "ieee", q8=q8)
    qn = q.cpu().numpy()
    want = np.concatenate([reference(qn[j:j + 1], *pool.keys(j, length), np.array([length - 1]), hd ** -0.5,
                                     window, softcap) for j, length in enumerate(lengths)])
    return out.cpu().numpy(), want


def _q(n: int, h: int, hd: int, rng: np.random.Generator, device: str) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((n, h, hd)).astype(np.float32)).to(device)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (50, 0.0), (0, 30.0)])
@pytest.mark.parametrize("poll", [False, True])
def test_decode_batch_over_scattered_blocks(window: int, softcap: float, poll: bool, device: str) -> None:
    """Sequences of different lengths (one key; a block boundary; one chunk; several splits, the last holding
    one key) on scattered blocks, decoded together in one launch, twice with the same scratch (as every layer of a
    captured graph reuses it): the ticket counters are back at zero after each call, and with polling every
    partial slot read is back to NaN."""
    h, hkv, hd, block = 6, 2, 24, 16
    lengths = [1, 16, 17, 64, 65, 130, 200]
    rng = np.random.default_rng(window + int(softcap) + poll)
    pool = Pool(lengths, hkv, hd, block, device, rng)
    scratch = DecodeScratch(8, h, hkv, 256, hd, torch.device(device), chunk=64, poll=poll, tile_kb=1)
    assert scratch.nprog == 4  # 4 chunk programs of 64 keys, tiles of 16
    for _ in range(2):
        q = _q(len(lengths), h, hd, rng, device)
        got, want = _decode_batch(pool, lengths, q, scratch, window, softcap)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert not scratch.count.cpu().numpy().any()
        if poll:
            assert scratch.m.isnan().all() and scratch.o[:, :, :hd].isnan().all()


def test_decode_reading_several_fresh_rows_again(device: str) -> None:
    """``fresh`` rows (a verify step's rows as decode rows) read again after the wait: the same attention, whether
    they fall in a chunk's first tile, straddle two tiles or two chunks."""
    h, hkv, hd, block = 4, 2, 24, 16
    lengths = [1, 3, 16, 18, 64, 66, 129, 200]
    rng = np.random.default_rng(11)
    pool = Pool(lengths, hkv, hd, block, device, rng)
    scratch = DecodeScratch(8, h, hkv, 256, hd, torch.device(device), chunk=64, poll=False, tile_kb=1)
    got, want = _decode_batch(pool, lengths, _q(len(lengths), h, hd, rng, device), scratch, 0, 0.0, fresh=5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


MODEL_SHAPES = [  # heads, kv heads, head dim: TinyLlama, Llama-3.2-1B's group of 4 (with 2 of its 8 KV heads),
    (32, 4, 64), (8, 2, 64), (12, 2, 128), (4, 1, 256), (9, 3, 64)]  # Qwen2.5, Gemma-3, SmolLM2


@pytest.mark.slow
@pytest.mark.parametrize("heads, kv_heads, hd", MODEL_SHAPES)
def test_decode_on_model_shapes(heads: int, kv_heads: int, hd: int, device: str) -> None:
    """Groups of 8/4/6/4/3 and head dims 64-256, a batch of depths inside the first chunk, on tile and chunk
    boundaries and deep enough for many chunks (several combine steps), with a sliding window that starts mid-tile
    and soft-capping; a program cap that lengthens deep chunks."""
    lengths = [1, 64, 65, 128, 129, 1001, 1040]
    rng = np.random.default_rng(heads * 1000 + hd)
    pool = Pool(lengths, kv_heads, hd, 16, device, rng)
    for chunk, cap, window, softcap in ((32, 32, 0, 0.0), (32, 5, 300, 50.0)):
        scratch = DecodeScratch(len(lengths), heads, kv_heads, 1040, hd, torch.device(device), chunk=chunk,
                                max_programs=cap)
        got, want = _decode_batch(pool, lengths, _q(len(lengths), heads, hd, rng, device), scratch, window, softcap)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"chunk {chunk} window {window}")
        assert not scratch.count.cpu().numpy().any()


@pytest.mark.parametrize("heads, kv_heads, hd", MODEL_SHAPES[1:4])
@pytest.mark.parametrize("cache_dtype, dot", [(torch.float16, "half"), (torch.float32, "tf32")])
def test_decode_on_tensor_cores_and_fp16_cache(heads: int, kv_heads: int, hd: int, cache_dtype: torch.dtype,
                                               dot: str, device: str) -> None:
    """The default mode's decode: K/V stored as fp16 and/or scores and p·V on tensor cores (operands rounded to
    10-bit mantissas, group padded to 16 rows), against the float64 reference on the pool as stored; up to 128
    keys one program at head dim 128 ("solo")."""
    lengths = [1, 41, 128, 129, 700]
    rng = np.random.default_rng(heads + hd)
    pool = Pool(lengths, kv_heads, hd, 32, device, rng, cache_dtype)
    scratch = DecodeScratch(len(lengths), heads, kv_heads, 700, hd, torch.device(device), dot=dot)
    got, want = _decode_batch(pool, lengths, _q(len(lengths), heads, hd, rng, device), scratch, 0, 0.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)  # 10-bit mantissas: ~1e-3 of a score


def test_many_tokens_share_the_programs(device: str) -> None:
    """The more tokens a decode batch has, the fewer chunk programs each gets (about PROGRAMS in all)."""
    dev = torch.device(device)
    assert DecodeScratch(1, 32, 4, 4096, 64, dev).nprog == 32
    assert DecodeScratch(16, 32, 4, 4096, 64, dev).nprog == 8
    assert DecodeScratch(256, 32, 4, 4096, 64, dev).nprog == 1
    assert DecodeScratch(1, 32, 4, 100, 64, dev).nprog == 2  # no more than the longest sequence needs


@pytest.mark.parametrize("window,softcap,exact", [(0, 0.0, True), (7, 0.0, True), (0, 25.0, True), (0, 0.0, False),
                                                  (7, 25.0, False)])
def test_prefill_chunks_after_cached_prefixes(window: int, softcap: float, exact: bool, device: str) -> None:
    """One launch: a whole prompt, a chunk after a cached prefix that is not block-aligned, a longer chunk (several
    query tiles) and a decode token (a mixed batch), each attending to its own sequence's prefix and itself; exact
    (IEEE products on an fp32 pool) and the default mode (fp16 pool, fp16 tensor cores)."""
    h, hkv, hd, block = 4, 2, 32, 8
    chunks = [(0, 9), (21, 6), (5, 70), (40, 1)]
    lengths = [f + n for f, n in chunks]
    rng = np.random.default_rng(window + int(softcap) + exact)
    pool = Pool(lengths, hkv, hd, block, device, rng, torch.float32 if exact else torch.float16)
    meta = pool.meta(chunks)
    n = sum(c for _, c in chunks)
    q = _q(n, h, hd, rng, device)
    out = torch.full((n, h * hd), float("nan"), device=device)
    attention(q, pool.k, pool.v, meta, scale=hd ** -0.5, window=window, softcap=softcap, out=out, exact=exact)
    qn, o, want = q.cpu().numpy(), 0, []
    for j, (first, count) in enumerate(chunks):
        want.append(reference(qn[o:o + count], *pool.keys(j, first + count), np.arange(first, first + count),
                              hd ** -0.5, window, softcap))
        o += count
    np.testing.assert_allclose(out.cpu().numpy(), np.concatenate(want), rtol=1e-4 if exact else 0,
                               atol=1e-5 if exact else 2e-3)


def test_write_kv_stores_at_the_slots(device: str) -> None:
    rng = np.random.default_rng(4)
    hkv, hd, n = 2, 24, 5
    kc, vc = torch.zeros((hkv, 64, hd), device=device), torch.zeros((hkv, 64, hd), device=device)
    k, v = (torch.from_numpy(rng.standard_normal((n, hkv, hd)).astype(np.float32)).to(device) for _ in range(2))
    slots = np.array([40, 3, 17, 63, 0], np.int32)
    write_kv(k, v, kc, vc, torch.from_numpy(slots).to(device))
    np.testing.assert_array_equal(kc.cpu().numpy()[:, slots].transpose(1, 0, 2), k.cpu().numpy())
    np.testing.assert_array_equal(vc.cpu().numpy()[:, slots].transpose(1, 0, 2), v.cpu().numpy())
    others = np.setdiff1d(np.arange(64), slots)
    assert not kc.cpu().numpy()[:, others].any() and not vc.cpu().numpy()[:, others].any()


@pytest.mark.parametrize("heads, kv_heads, hd", [(12, 2, 128), (9, 3, 64)])
def test_decode_writes_int8_output(heads: int, kv_heads: int, hd: int, device: str) -> None:
    """With ``q8``, the decode kernel also writes each token's output as the int8 activations a separate quantize
    would (one program writing it directly, and the combine of several)."""
    from quanta.backends.cuda.q8gemv import Q8Activation, quantize

    lengths = [20, 200]
    rng = np.random.default_rng(hd)
    pool = Pool(lengths, kv_heads, hd, 16, device, rng)
    scratch = DecodeScratch(2, heads, kv_heads, 256, hd, torch.device(device), chunk=32)
    got = Q8Activation.empty(2, heads * hd, torch.device(device))
    meta = pool.meta([(n - 1, 1) for n in lengths])
    out = torch.empty((2, heads * hd), device=device)
    attention(_q(2, heads, hd, rng, device), pool.k, pool.v, meta, scale=hd ** -0.5, out=out, scratch=scratch,
              q8=got)
    want = quantize(out)
    assert torch.equal(got.q, want.q) and torch.equal(got.d, want.d)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and concurrent programs need the GPU")
@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("heads, kv_heads, hd", [(32, 4, 64), (12, 2, 128)])
def test_decode_batch_in_a_cuda_graph(heads: int, kv_heads: int, hd: int, poll: bool, device: str) -> None:
    """On the GPU the split programs run concurrently and in any order: the ticket must still elect exactly one
    combiner per (token, KV head), see every partial and leave the counters at zero, replay after replay; the
    polling combiner must never take a partial before it lands (nor a stale one)."""
    lengths = [1, 64, 500, 1024]
    rng = np.random.default_rng(7)
    pool = Pool(lengths, kv_heads, hd, 16, device, rng)
    scratch = DecodeScratch(4, heads, kv_heads, 1024, hd, torch.device(device), poll=poll)
    q = _q(4, heads, hd, rng, device)
    meta = pool.meta([(n - 1, 1) for n in lengths])
    out = torch.empty((4, heads * hd), device=device)
    attention(q, pool.k, pool.v, meta, scale=hd ** -0.5, out=out, scratch=scratch, exact=True)  # compiled first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention(q, pool.k, pool.v, meta, scale=hd ** -0.5, out=out, scratch=scratch, exact=True)
    qn = q.cpu().numpy()
    want = np.concatenate([reference(qn[j:j + 1], *pool.keys(j, n), np.array([n - 1]), hd ** -0.5, 0, 0.0)
                           for j, n in enumerate(lengths)])
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-5)
    assert not scratch.count.cpu().numpy().any()


@triton.jit
def _new_row_kernel(kc_ptr, vc_ptr, bt_ptr, ko_ptr, vo_ptr, pos, start, NSLOTS, HD, BN: tl.constexpr,
                    BD: tl.constexpr, BLOCK: tl.constexpr, FRESH: tl.constexpr):
    p = start + tl.arange(0, BN)
    d = tl.arange(0, BD)
    k = tl.full([BN, BD], -1.0, tl.float16)  # what a tile read before the PDL wait may hold
    v = tl.full([BN, BD], -2.0, tl.float16)
    rows = slot_index(bt_ptr, p, p >= 0, 1, NSLOTS, BLOCK)  # KV head 1
    k, v = _with_new_row(k, v, kc_ptr, vc_ptr, kc_ptr, vc_ptr, rows, p, pos, d, d < HD, HD, False, "half", FRESH)
    offs = tl.arange(0, BN)[:, None] * BD + d[None, :]
    tl.store(ko_ptr + offs, k)
    tl.store(vo_ptr + offs, v)


@pytest.mark.parametrize("fresh", [1, 4])
@pytest.mark.parametrize("pos", [16, 18, 21, 31])
def test_the_new_key_row_is_read_again(pos: int, fresh: int, device: str) -> None:
    """After its PDL wait the decode kernel reads again only the rows of the ``fresh`` positions up to ``pos`` (the
    keys and values the Q/K/V projection just stored, found through the block table; more than one for a verify
    step's draft rows): those rows from the pool, every other row as read before the wait."""
    n_slots, hd, bd, bn, start, block = 64, 48, 64, 16, 16, 8
    table = np.array([7, 2, 5, 0, 1, 3, 4, 6], np.int32)
    rng = np.random.default_rng(pos)
    kc, vc = (torch.from_numpy(rng.standard_normal((2, n_slots, hd)).astype(np.float16)).to(device) for _ in range(2))
    ko, vo = (torch.empty((bn, bd), dtype=torch.float16, device=device) for _ in range(2))
    _new_row_kernel[(1,)](kc, vc, torch.from_numpy(table).to(device), ko, vo, pos, start, n_slots, hd, BN=bn, BD=bd,
                          BLOCK=block, FRESH=fresh)
    for got, cache, old in ((ko, kc, -1.0), (vo, vc, -2.0)):
        want = np.full((bn, bd), old, dtype=np.float16)
        for q in range(max(start, pos - fresh + 1), pos + 1):  # the tile starts at ``start``
            want[q - start, :hd] = cache[1, table[q // block] * block + q % block].cpu().numpy()  # KV head 1
        np.testing.assert_array_equal(got.cpu().numpy(), want)
