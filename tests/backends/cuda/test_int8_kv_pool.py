"""The CUDA backend's int8 KV pool (kv_q8.py): the rotation against the CPU backend's Walsh-Hadamard transform, the
store against a float64 numpy quantization, the decode and prefill kernels over it against the float64 attention
of the pool as stored, and whole forwards against the CPU backend's int8 pool (the same scheme written in numba)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from batches import run_steps
from test_attention import Pool, reference
from test_backend import QK_FUSED, STEPS, TOKENS
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.backends.cpu.attention import hadamard
from quanta.backends.cpu.backend import CPUBackend
from quanta.backends.cuda import kv_q8
from quanta.backends.cuda.attention import attention
from quanta.backends.cuda.flash_decode import DecodeScratch
from quanta.models import load_model


@pytest.mark.parametrize("n", [32, 64, 128, 256])
def test_rotation_is_the_cpu_backends_hadamard_transform(n: int) -> None:
    want = np.eye(n, dtype=np.float32)
    for row in want:
        hadamard(row)  # the CPU backend's in-place butterfly
    got = kv_q8.hadamard(n, torch.device("cpu")).numpy()
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got @ got, np.eye(n), atol=1e-5)


def _int8_pool(pool: Pool, hd: int, device: str) -> kv_q8.Int8Layer:
    """An empty int8 pool of ``pool``'s shape."""
    hkv, n_slots, _ = pool.k.shape
    codes = [torch.zeros((hkv, n_slots, hd), dtype=torch.int8, device=device) for _ in range(2)]
    scales = [torch.zeros((hkv, n_slots, hd // 32), dtype=torch.float16, device=device) for _ in range(2)]
    return kv_q8.Int8Layer(*codes, *scales, kv_q8.hadamard(hd, torch.device(device)))


def _dequantized(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """(hkv, n_slots, hd) float64 values the codes stand for, in the rotated basis."""
    c = codes.cpu().numpy().astype(np.float64)
    return c * np.repeat(scales.cpu().numpy().astype(np.float64), 32, axis=-1)


def test_write_rotates_the_queries_and_quantizes_the_rotated_rows(device: str) -> None:
    rng = np.random.default_rng(3)
    n, h, hkv, hd, n_slots = 5, 4, 2, 64, 40
    q, k, v = (rng.standard_normal((n, heads, hd)).astype(np.float32) for heads in (h, hkv, hkv))
    k[:, :, 7] *= 30  # an outlier channel: the rotation spreads it over every group
    slots = np.array([33, 2, 17, 39, 0], np.int32)
    pool = Pool([n_slots], hkv, hd, n_slots, device, rng)
    layer = _int8_pool(pool, hd, device)
    qt = torch.from_numpy(q.copy()).to(device)  # (on the CPU from_numpy would share q, rotated in place)
    kv_q8.write(qt, torch.from_numpy(k).to(device), torch.from_numpy(v).to(device), layer,
                torch.from_numpy(slots).to(device))
    rot = layer.rotation.cpu().numpy().astype(np.float64)
    np.testing.assert_allclose(qt.cpu().numpy(), q @ rot, rtol=1e-5, atol=1e-5)
    for x, codes, scales in ((k, layer.k, layer.k_scale), (v, layer.v, layer.v_scale)):
        want = (x.astype(np.float64) @ rot).reshape(n, hkv, hd // 32, 32)
        step = np.abs(want).max(-1) / 127
        got_step = scales.cpu().numpy()[:, slots].transpose(1, 0, 2).astype(np.float64)
        np.testing.assert_allclose(got_step, step, rtol=1e-3)  # fp16 scales
        got = codes.cpu().numpy()[:, slots].transpose(1, 0, 2).reshape(n, hkv, hd // 32, 32)
        assert np.abs(got - want / step[..., None]).max() <= 0.5 + 1e-3  # nearest codes (ties either way)
        assert np.abs(got).max() == 127
        others = np.setdiff1d(np.arange(n_slots), slots)
        assert not codes.cpu().numpy()[:, others].any() and not scales.cpu().numpy()[:, others].any()


def _kv_rows(pool: Pool, j: int, positions: np.ndarray, device: str) -> tuple[torch.Tensor, ...]:
    """Sequence j's float K and V of ``positions`` as new tokens' (n, hkv, hd), and their slots."""
    slots = torch.from_numpy(pool.slots(j, positions)).to(device)
    k, v = (x.float()[:, slots.long()].transpose(0, 1).contiguous() for x in (pool.k, pool.v))
    return k, v, slots


def _stored(pool: Pool, layer: kv_q8.Int8Layer, chunks: list[tuple[int, int]], hd: int, device: str) -> None:
    """The positions before each sequence's chunk (first, count) written into ``layer`` (no queries)."""
    for j, (first, _) in enumerate(chunks):
        if first:
            k, v, slots = _kv_rows(pool, j, np.arange(first), device)
            kv_q8.write(torch.zeros((first, 0, hd), device=device), k, v, layer, slots)


def _write_chunks(q: torch.Tensor, pool: Pool, layer: kv_q8.Int8Layer, chunks: list[tuple[int, int]],
                  device: str) -> torch.Tensor:
    """The chunks' own K/V written with their queries, as the backend does: the rotated queries."""
    parts = [_kv_rows(pool, j, np.arange(first, first + n), device) for j, (first, n) in enumerate(chunks)]
    k, v, slots = (torch.cat(x) for x in zip(*parts))
    rotated = q.clone()
    kv_q8.write(rotated, k, v, layer, slots)
    return rotated


def _as_stored(pool: Pool, layer: kv_q8.Int8Layer, j: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence j's K and V (length, hkv, hd) as the int8 pool holds them, rotated back (float64)."""
    rot = layer.rotation.cpu().numpy().astype(np.float64)
    s = pool.slots(j, np.arange(length))
    return tuple((_dequantized(c, sc)[:, s] @ rot).transpose(1, 0, 2)
                 for c, sc in ((layer.k, layer.k_scale), (layer.v, layer.v_scale)))


@pytest.mark.parametrize("heads, kv_heads, hd, window, softcap", [(8, 2, 64, 0, 0.0), (8, 2, 64, 50, 30.0),
                                                                  (12, 2, 128, 0, 0.0), (4, 1, 256, 50, 30.0)])
def test_decode_over_the_int8_pool(heads: int, kv_heads: int, hd: int, window: int, softcap: float,
                                   device: str) -> None:
    """Decode of a batch (one program; several splits and their combine) over the int8 pool: the float64 attention
    of the pool as stored, up to fp16 tensor-core rounding; the float pool's within the int8 error; and the
    output's int8 copy as a separate quantize would write it."""
    from quanta.backends.cuda.q8gemv import Q8Activation, quantize

    lengths = [1, 40, 300]
    chunks = [(n - 1, 1) for n in lengths]
    rng = np.random.default_rng(hd + window)
    pool = Pool(lengths, kv_heads, hd, 16, device, rng)
    layer = _int8_pool(pool, hd, device)
    _stored(pool, layer, chunks, hd, device)
    scratch = DecodeScratch(len(lengths), heads, kv_heads, 300, hd, torch.device(device), dot="half", chunk=64)
    q = torch.from_numpy(rng.standard_normal((len(lengths), heads, hd)).astype(np.float32)).to(device)
    qn = q.cpu().numpy()
    out = torch.full((len(lengths), heads * hd), float("nan"), device=device)
    copy = Q8Activation.empty(len(lengths), heads * hd, torch.device(device))
    attention(_write_chunks(q, pool, layer, chunks, device), layer.k, layer.v, pool.meta(chunks), scale=hd ** -0.5,
              window=window, softcap=softcap, out=out, scratch=scratch, q8=copy, int8=layer)
    got = out.cpu().numpy()
    as_stored = np.concatenate([reference(qn[j:j + 1], *_as_stored(pool, layer, j, n), np.array([n - 1]),
                                          hd ** -0.5, window, softcap) for j, n in enumerate(lengths)])
    floats = np.concatenate([reference(qn[j:j + 1], *pool.keys(j, n), np.array([n - 1]), hd ** -0.5, window, softcap)
                             for j, n in enumerate(lengths)])
    np.testing.assert_allclose(got, as_stored, rtol=0, atol=3e-3)
    assert np.abs(got - floats).max() < 0.05
    want = quantize(out)
    assert torch.equal(copy.q, want.q) and torch.equal(copy.d, want.d)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (7, 25.0)])
def test_prefill_chunks_over_the_int8_pool(window: int, softcap: float, device: str) -> None:
    """One prefill launch (a whole prompt, a chunk after a cached prefix, a longer chunk, a decode token) over the
    int8 pool: the float64 attention of the pool as stored, and of the float pool within the int8 error."""
    h, hkv, hd, block = 4, 2, 64, 8
    chunks = [(0, 9), (21, 6), (5, 70), (40, 1)]
    lengths = [f + n for f, n in chunks]
    rng = np.random.default_rng(window)
    pool = Pool(lengths, hkv, hd, block, device, rng)
    layer = _int8_pool(pool, hd, device)
    _stored(pool, layer, chunks, hd, device)
    n = sum(c for _, c in chunks)
    q = torch.from_numpy(rng.standard_normal((n, h, hd)).astype(np.float32)).to(device)
    out = torch.full((n, h * hd), float("nan"), device=device)
    attention(_write_chunks(q, pool, layer, chunks, device), layer.k, layer.v, pool.meta(chunks), scale=hd ** -0.5,
              window=window, softcap=softcap, out=out, int8=layer)
    qn, o, as_stored, floats = q.cpu().numpy(), 0, [], []
    for j, (first, count) in enumerate(chunks):
        p = np.arange(first, first + count)
        as_stored.append(reference(qn[o:o + count], *_as_stored(pool, layer, j, first + count), p, hd ** -0.5,
                                   window, softcap))
        floats.append(reference(qn[o:o + count], *pool.keys(j, first + count), p, hd ** -0.5, window, softcap))
        o += count
    got = out.cpu().numpy()
    np.testing.assert_allclose(got, np.concatenate(as_stored), rtol=0, atol=3e-3)
    assert np.abs(got - np.concatenate(floats)).max() < 0.05


@pytest.mark.parametrize("exact", [True, False])
def test_forwards_on_the_int8_pool_match_the_cpu_backends(exact: bool, tmp_path: Path, device: str,
                                                          few_programs: None) -> None:
    """Prefills, a chunk after a cached prefix and decode steps of two sequences on the int8 pool: the CPU
    backend's int8 pool (exact mode; fp32 scales there, fp16 here) gives the same logits up to that rounding; the
    default mode stays within its int8 activations' error of them."""
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=1,
                            vocab=64, n_heads=4, n_kv_heads=2, head_dim=64)
    g = gguf.open(path)
    cpu = CPUBackend(exact=True)
    want = run_steps(cpu, load_model(g, cpu, 32), TOKENS, STEPS, kv_dtype="q8")
    floats = run_steps(cpu, load_model(g, cpu, 32), TOKENS, STEPS)
    be = CUDABackend(device, exact=exact)
    got = run_steps(be, load_model(g, be, 32), TOKENS, STEPS, kv_dtype="q8")
    for gs, w, f in zip(got, want, floats):
        err = np.linalg.norm(gs - w) / np.linalg.norm(w)
        assert err < (1e-3 if exact else 0.03), err
        assert np.linalg.norm(w - f) / np.linalg.norm(f) < 0.05  # the int8 pool is close to the float one


@pytest.mark.parametrize("neox, rot", [(False, 64), (True, 64), (True, 32)])
def test_write_applies_rope_as_rope_qk_does(neox: bool, rot: int, device: str) -> None:
    """With the rope table (the backend's rope_qk on an int8 pool: one launch), the stored codes and the rotated
    queries are those of rope.rope_qk followed by a plain write (``rot``: rotary dims; 32 of 64: a partial rope)."""
    from quanta.backends.cuda import rope

    rng = np.random.default_rng(rot + neox)
    n, h, hkv, hd, n_slots = 3, 4, 2, 64, 16
    q, k, v = (torch.from_numpy(rng.standard_normal((n, heads, hd)).astype(np.float32)).to(device)
               for heads in (h, hkv, hkv))
    positions = torch.tensor([0, 5, 200], dtype=torch.int32, device=device)
    slots = torch.tensor([3, 9, 14], dtype=torch.int32, device=device)
    inv_freq = 10000.0 ** (-np.arange(0, rot, 2) / rot)
    table = rope.rope_table(inv_freq, 256, torch.device(device))
    pool = Pool([n_slots], hkv, hd, n_slots, device, rng)
    fused, plain = _int8_pool(pool, hd, device), _int8_pool(pool, hd, device)
    qf = q.clone()
    kv_q8.write(qf, k.clone(), v, fused, slots, rope=(positions, table, neox))
    qp, kp = q.clone(), k.clone()
    rope.rope_qk(qp, kp, positions, table, neox)
    kv_q8.write(qp, kp, v, plain, slots)
    np.testing.assert_allclose(qf.cpu().numpy(), qp.cpu().numpy(), rtol=1e-5, atol=1e-5)
    for a, b in ((fused.k, plain.k), (fused.v, plain.v)):
        assert np.abs(a.cpu().numpy().astype(int) - b.cpu().numpy().astype(int)).max() <= 1  # rounding ties
    for a, b in ((fused.k_scale, plain.k_scale), (fused.v_scale, plain.v_scale)):
        np.testing.assert_allclose(a.cpu().numpy(), b.cpu().numpy(), rtol=2e-3)


def test_the_int8_pool_takes_17_32_of_the_fp16_pools_bytes(tmp_path: Path, device: str) -> None:
    """A byte per value and an fp16 scale per 32 (what the model runner sizes the pool by: 1.88x the tokens of an
    fp16 pool in the same memory); head sizes the rotation cannot take are refused with a clear error."""
    from quanta.backends.cuda.backend import CUDABackend

    be = CUDABackend(device)
    g = gguf.open(write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256,
                                   n_layers=2, head_dim=64))
    model = load_model(g, be, 48)
    shape, padded = model.kv_shape(5, 16), model.kv_shape(6, 16)  # the pool has one block more: the pad block
    assert be.kv_nbytes(shape, "q8") * 32 == be.kv_nbytes(shape, "f16") * 17
    pool = be.kv_cache(shape, "q8")
    assert pool.nbytes == be.kv_nbytes(padded, "q8")
    assert isinstance(pool[1], kv_q8.Int8Layer) and pool[1].k.dtype == torch.int8
    assert pool[1].k_scale.shape == (shape.n_kv_heads, 6 * 16, 2)
    odd = load_model(gguf.open(write_tiny_model(tmp_path / "odd.gguf", "llama", d_model=96, n_heads=4,
                                                head_dim=24)), be, 48).kv_shape(5, 16)
    with pytest.raises(ValueError, match="power-of-two head size"):
        be.kv_cache(odd, "q8")
