"""qmatmul / qembed against gguf-py's dequantize (an independent oracle) and float64 numpy matmul."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import quanta.gguf as qgguf
import threading

from quanta.backends.cpu.kernels.isa import ISAS, UnsupportedISAError, host_isas, resolve_isa
from quanta.backends.cpu.qmatmul import (
    GEMM_MIN_ROWS, Q8_ACTIVATION_TYPES, SPLIT_MIN_ROWS, TILE_BYTES, CPUThreads, prepare_weight, q8_gemm_min_rows,
    qembed, qmatmul as _qmatmul,
)  # fmt: skip
from quanta.gguf.reader import TensorInfo
from quanta.quant.formats import FORMATS, UnsupportedTypeError

FLOAT_TYPES = ("F32", "F16", "BF16")
EXACT_TOL = 1e-5  # relative to max |reference|: fp32 rounding only
# 8-bit activations: each x is rounded by up to d/2 = max|x_block|/254, a relative error of ~0.5% per output on
# Gaussian data (max over outputs up to ~1.5%); per 256 (the K-quants' GEMV, llama.cpp's q8_K) d is ~1.3x larger.
# RMS bound 2% leaves room for small samples.
FAST_MAX_TOL, FAST_RMS_TOL = 3e-2, 2e-2


THREADS = CPUThreads(2)  # a GEMV worker and a prefill thread beside the caller, whatever the machine has
ON_ISA = {isa: CPUThreads(2, isa=isa) for isa in host_isas()}  # every int8 path this CPU runs (AVX2 everywhere)


def qmatmul(x, w, threads: CPUThreads = THREADS, **kwargs):
    return _qmatmul(x, w, threads, **kwargs)


def random_tensor(type_name: str, m: int, k: int, seed: int = 0) -> TensorInfo:
    """Random blocks of ``type_name``: random bytes for the quants, random finite f16 scales."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[type_name]
    if type_name in FLOAT_TYPES:
        values = rng.standard_normal(m * k).astype(np.float32)
        if type_name == "F16":
            values = values.astype(np.float16)
        elif type_name == "BF16":
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        raw = values.view(np.uint8)
    else:
        raw = rng.integers(0, 256, m * k // fmt.block_size * fmt.type_size, dtype=np.uint8)
        blocks = raw.view(fmt.block_dtype)
        for f in fmt.fields:
            if f.dtype == "<f2":
                blocks[f.name] = rng.uniform(-1, 1, blocks[f.name].shape).astype(np.float16)
    return TensorInfo("random", type_name, (m, k), 0, raw.nbytes, raw)


def oracle(t: TensorInfo) -> np.ndarray:
    m = t.shape[0]
    return gguf.quants.dequantize(t.raw.reshape(m, -1), gguf.GGMLQuantizationType[t.type]).astype(np.float64)


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def assert_fast_close(y: np.ndarray, ref: np.ndarray, what) -> None:
    assert rel_err(y, ref) < FAST_MAX_TOL, what
    assert np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2)) < FAST_RMS_TOL, what


def q8_round_trip(x: np.ndarray, block: int = 32) -> np.ndarray:
    """llama.cpp's q8_0 activation quantization in plain numpy: per 32 values d = max|x|/127, q = round(x/d)
    (``block`` 256: its q8_K, as the K-quant GEMVs quantize)."""
    blocks = x.reshape(x.shape[0], -1, block)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(blocks * inv) * d).reshape(x.shape).astype(np.float64)


def gemv_round_trip(x: np.ndarray, type_name: str) -> np.ndarray:
    """The activations as the fast GEMV for ``type_name`` rounds them: per 256 for the K-quants, else per 32."""
    return q8_round_trip(x, 256 if type_name in ("Q4_K", "Q5_K", "Q6_K") else 32)


def shapes_for(type_name: str) -> list[tuple[int, int]]:
    bs = FORMATS[type_name].block_size
    if bs == 256:
        return [(37, 512), (5, 256)]
    return [(37, 160), (6, 96)]  # 5 and 3 blocks: odd block counts


@pytest.mark.parametrize("type_name", list(FORMATS))
def test_qmatmul_matches_gguf_dequantize(type_name):
    for m, k in shapes_for(type_name):
        t = random_tensor(type_name, m, k)
        ref_w = oracle(t)
        w = prepare_weight(t)
        assert w.shape == (m, k) and w.type == type_name
        assert w.raw2d.nbytes == t.nbytes  # the file's bytes, no copy
        rng = np.random.default_rng(1)
        for n in (1, 2, 7, 33):
            x = rng.standard_normal((n, k)).astype(np.float32)
            ref = x.astype(np.float64) @ ref_w.T
            assert rel_err(qmatmul(x, w, exact=True), ref) < EXACT_TOL, (m, k, n)
            fast = qmatmul(x, w)
            assert_fast_close(fast, ref, (m, k, n))
            # GEMV: exactly q8(x) @ W.T (minimums meet the quantized activations' sums, as llama.cpp's q8_1)
            if type_name in Q8_ACTIVATION_TYPES and n < q8_gemm_min_rows(THREADS.isa, type_name):
                assert rel_err(fast, gemv_round_trip(x, type_name) @ ref_w.T) < 1e-4, (m, k, n)


@pytest.mark.parametrize("type_name", list(FORMATS))
def test_qembed_rows_equal_gguf_dequantize(type_name):
    m, k = shapes_for(type_name)[0]
    t = random_tensor(type_name, m, k, seed=2)
    ids = np.array([0, m - 1, 3, 3])
    np.testing.assert_array_equal(qembed(prepare_weight(t), ids), oracle(t)[ids].astype(np.float32))


def test_out_argument_threads_and_gemm_path_agree():
    t = random_tensor("Q4_1", 64, 256)
    w = prepare_weight(t)
    x = np.random.default_rng(3).standard_normal((GEMM_MIN_ROWS + 1, 256)).astype(np.float32)
    out = np.empty((x.shape[0], 64), np.float32)
    assert qmatmul(x, w, exact=True, out=out) is out
    rows = np.stack([qmatmul(x[i : i + 1], w, exact=True)[0] for i in range(x.shape[0])])  # GEMV path
    np.testing.assert_allclose(out, rows, rtol=0, atol=EXACT_TOL * np.abs(rows).max())
    one = CPUThreads(1)
    try:
        np.testing.assert_allclose(qmatmul(x[:1], w, one, exact=True), rows[:1], rtol=0,
                                   atol=EXACT_TOL * np.abs(rows).max())
    finally:
        one.close()
    strided = np.zeros((2, 128), np.float32)[:, ::2]  # a non-contiguous out view is filled too
    qmatmul(x[:2], w, exact=True, out=strided)
    np.testing.assert_allclose(strided, rows[:2], rtol=0, atol=EXACT_TOL * np.abs(rows).max())


@pytest.mark.parametrize(("m", "n"), [(TILE_BYTES // (4 * 256) + 5, GEMM_MIN_ROWS + 1), (37, 2 * SPLIT_MIN_ROWS + 3)])
def test_gemm_tiles_and_thread_split(m, n):
    """Weights taller than one fp32 tile, and prefill batches split over the sgemm threads."""
    t = random_tensor("Q8_0", m, 256, seed=5)
    x = np.random.default_rng(6).standard_normal((n, 256)).astype(np.float32)
    y = qmatmul(x, prepare_weight(t), exact=True)
    assert rel_err(y, x.astype(np.float64) @ oracle(t).T) < EXACT_TOL


# ---- the fast-mode int8 prefill GEMM (q8 activations, VNNI): rounds x exactly as llama.cpp's q8_0, and block
# minimums meet the quantized activations' sums, so it computes q8(x) @ W.T in float64 up to fp32 rounding.
needs_int8 = pytest.mark.skipif(not ON_ISA, reason="the int8 kernels need AVX2")
isas = pytest.mark.parametrize("isa", list(ON_ISA))


@needs_int8
@isas
@pytest.mark.parametrize("type_name", Q8_ACTIVATION_TYPES)
def test_int8_gemm_matches_q8_reference(type_name, isa):
    m, k = (37, 512) if FORMATS[type_name].block_size == 256 else (37, 160)  # a partial 16-row tile
    t = random_tensor(type_name, m, k, seed=7)
    w, ref_w = prepare_weight(t), oracle(t)
    rng = np.random.default_rng(8)
    for n in (1, 3, 8, 21, 33, 75):  # the GEMV, and token counts around the GEMM's register tiles
        x = rng.standard_normal((n, k)).astype(np.float32)
        x[0, :32] = 0  # an all-zero activation block (scale 0)
        y = qmatmul(x, w, ON_ISA[isa])
        if isa == "avx2" and type_name == "Q8_0" and n >= q8_gemm_min_rows(isa, type_name):  # the fp32 GEMM
            assert rel_err(y, x.astype(np.float64) @ ref_w.T) < EXACT_TOL
            continue
        gemv = n < q8_gemm_min_rows(isa, type_name)
        q8_ref = (gemv_round_trip(x, type_name) if gemv else q8_round_trip(x)) @ ref_w.T
        assert rel_err(y, q8_ref) < 1e-5, (n, rel_err(y, q8_ref))
        assert_fast_close(y, x.astype(np.float64) @ ref_w.T, n)


@needs_int8
@isas
@pytest.mark.parametrize("type_name", ["Q5_0", "Q6_K", "Q4_K"])
def test_int8_gemm_prefill_shape_two_threads_and_out(type_name, isa):
    """A prefill-sized batch split over two threads, written into a given ``out``."""
    m, k, n = 96, 512, 509
    t = random_tensor(type_name, m, k, seed=9)
    x = np.random.default_rng(10).standard_normal((n, k)).astype(np.float32)
    out = np.full((n, m), np.nan, np.float32)
    assert qmatmul(x, prepare_weight(t), ON_ISA[isa], out=out) is out
    ref_w = oracle(t)
    assert rel_err(out, q8_round_trip(x) @ ref_w.T) < 1e-5
    exact = qmatmul(x, prepare_weight(t), exact=True)  # exact mode keeps the fp32 path
    assert rel_err(exact, x.astype(np.float64) @ ref_w.T) < 1e-5


def test_two_thread_sets_of_different_sizes_run_side_by_side():
    """Two backends' threads (one with a worker, one without) used at once from two threads stay independent."""
    t = random_tensor("Q4_K", 300, 512, seed=11)
    w, ref_w = prepare_weight(t), oracle(t)
    x = np.random.default_rng(12).standard_normal((2, 512)).astype(np.float32)
    want = gemv_round_trip(x, "Q4_K") @ ref_w.T
    one, two = CPUThreads(1), CPUThreads(2)
    errors: list[float] = []

    def work(threads: CPUThreads) -> None:
        for _ in range(200):
            errors.append(rel_err(qmatmul(x, w, threads), want))

    runners = [threading.Thread(target=work, args=(th,)) for th in (one, two, one, two)]
    for r in runners:
        r.start()
    for r in runners:
        r.join()
    assert len(errors) == 800 and max(errors) < 1e-4
    assert (one.n, len(one.workers._workers), two.n, len(two.workers._workers)) == (1, 0, 2, 1)
    assert one.workers.window_share() == 0.0  # it has no workers: the caller ran every chunk
    one.close()
    two.close()


def test_isa_choice():
    have = host_isas()
    assert resolve_isa(None) == (have[-1] if have else None)
    for isa in have:
        assert CPUThreads(1, isa=isa).isa == isa
    with pytest.raises(UnsupportedISAError, match="choose one of"):
        resolve_isa("sse4")
    for missing in set(ISAS) - set(have):
        with pytest.raises(UnsupportedISAError, match="cannot run"):
            resolve_isa(missing)


def test_errors_are_clear():
    raw = np.zeros(64, np.uint8)
    with pytest.raises(UnsupportedTypeError, match="IQ2_XXS"):
        prepare_weight(TensorInfo("blk.0.q", "IQ2_XXS", (1, 256), 0, 64, raw))
    w = prepare_weight(random_tensor("Q8_0", 4, 64))
    with pytest.raises(ValueError, match="expects"):
        qmatmul(np.zeros((1, 32), np.float32), w)
    with pytest.raises(ValueError, match="out has shape"):
        qmatmul(np.zeros((1, 64), np.float32), w, out=np.zeros((1, 5), np.float32))
    with pytest.raises(IndexError):
        qembed(w, [4])


def first_rows(t: TensorInfo, rows: int) -> TensorInfo:
    """A view of the first ``rows`` rows (keeps big tables like token_embd cheap for the oracle)."""
    rows = min(rows, t.shape[0])
    nbytes = t.nbytes // t.shape[0] * rows
    return TensorInfo(t.name, t.type, (rows, *t.shape[1:]), t.offset, nbytes, t.raw[:nbytes])


@pytest.mark.parametrize(
    ("model", "names"),
    [
        ("smollm2_path", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"]),
        ("gemma3_path", ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                         "blk.0.ffn_down.weight", "token_embd.weight"]),
    ],
)  # fmt: skip
def test_real_tensors(model, names, request):
    f = qgguf.open(request.getfixturevalue(model))
    rng = np.random.default_rng(4)
    for name in names:
        t = first_rows(f.tensors[name], 1024)
        ref_w = oracle(t)
        w = prepare_weight(t)
        for n in (1, 21):
            x = rng.standard_normal((n, t.shape[1])).astype(np.float32)
            ref = x.astype(np.float64) @ ref_w.T
            assert rel_err(qmatmul(x, w, exact=True), ref) < EXACT_TOL, (name, n)
            fast = qmatmul(x, w)
            assert_fast_close(fast, ref, (name, n))
            if w.type in Q8_ACTIVATION_TYPES:  # the GEMV and the int8 GEMM: each exactly q8(x) @ W.T, its rounding
                gemv = n < q8_gemm_min_rows(THREADS.isa, w.type)
                rounded = gemv_round_trip(x, w.type) if gemv else q8_round_trip(x)
                assert rel_err(fast, rounded @ ref_w.T) < 1e-5, (name, n)
        np.testing.assert_array_equal(qembed(w, [0, 5]), ref_w[[0, 5]].astype(np.float32))
