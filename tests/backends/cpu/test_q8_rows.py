"""The fast GEMV over several activation rows (a decode batch, a speculative verify step): every row of a
multi-row call equals that row multiplied alone, bit for bit, and ``q8(x) @ W.T`` (gguf-py's dequantize, numpy
float64) up to fp32 rounding, on every int8 path of this CPU."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from quanta.backends.cpu.kernels.isa import host_isas
from quanta.backends.cpu.qmatmul import (
    Q8_ACTIVATION_TYPES, CPUThreads, RowPlan, prepare_weight, q8_gemm_min_rows, qmatmul,
)  # fmt: skip
from quanta.gguf.reader import TensorInfo
from quanta.quant.formats import FORMATS

from test_qmatmul import random_tensor

ON_ISA = {isa: (CPUThreads(1, isa=isa), CPUThreads(2, isa=isa)) for isa in host_isas()}
pytestmark = pytest.mark.skipif(not ON_ISA, reason="the int8 kernels need AVX2")


def q8_reference(x: np.ndarray, t: TensorInfo) -> np.ndarray:
    """``q8(x) @ W.T`` in float64: llama.cpp's q8_0 rounding of x (per 32: d = max|x|/127, round(x/d)), for the
    K-quants its q8_K (per 256)."""
    w = gguf.quants.dequantize(t.raw.reshape(t.shape[0], -1), gguf.GGMLQuantizationType[t.type]).astype(np.float64)
    blocks = x.reshape(x.shape[0], -1, FORMATS[t.type].block_size if t.type.endswith("_K") else 32)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(blocks * inv) * d).reshape(x.shape).astype(np.float64) @ w.T


def k_for(type_name: str) -> list[int]:
    """Row lengths: for the 32-weight formats an odd block count (a block without a partner) and an even one."""
    return [512, 1024] if FORMATS[type_name].block_size == 256 else [160, 256]


@pytest.mark.parametrize("isa", list(ON_ISA))
@pytest.mark.parametrize("type_name", Q8_ACTIVATION_TYPES)
def test_rows_equal_the_row_alone_and_the_q8_reference(type_name, isa):
    rng = np.random.default_rng(1)
    gemv_rows = range(1, q8_gemm_min_rows(isa, type_name))  # the row counts that take the GEMV
    assert len(gemv_rows) >= 8  # a decode batch of 8 sequences
    for k in k_for(type_name):
        t = random_tensor(type_name, 1600, k, seed=k)  # one thread's chunks take more than one 16 KB pass
        w = prepare_weight(t)
        x = rng.standard_normal((max(gemv_rows), k)).astype(np.float32)
        block = 256 if type_name.endswith("_K") else 32
        x[1, block : 2 * block] = 0  # an all-zero activation block (scale 0)
        x[2] *= 40  # a row of another magnitude
        ref = q8_reference(x, t)
        for threads in ON_ISA[isa]:
            alone = np.stack([qmatmul(x[i : i + 1], w, threads)[0] for i in range(x.shape[0])])
            assert np.abs(alone - ref).max() / np.abs(ref).max() < 1e-5
            for n in gemv_rows:
                np.testing.assert_array_equal(qmatmul(x[:n], w, threads), alone[:n], err_msg=f"k={k} n={n}")


@pytest.mark.parametrize("isa", list(ON_ISA))
def test_formats_sharing_a_shape_share_no_stale_activations(isa):
    """The activation scratch is reused per shape: a format with code offsets after one without, and Q6_K's
    per-lane offsets between them, each still gives the reference."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    threads = ON_ISA[isa][0]
    for i, type_name in enumerate(["Q4_1", "Q4_0", "Q6_K", "Q8_0", "Q4_K", "Q5_0"]):
        t = random_tensor(type_name, 20, 512, seed=i)
        ref = q8_reference(x, t)
        y = qmatmul(x, prepare_weight(t), threads)
        assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5, type_name


@pytest.mark.parametrize("isa", list(ON_ISA))
@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("order", ["decodes first", "interleaved"])
def test_a_rows_kernel_follows_what_it_is_not_its_batch(type_name, isa, order):
    """A mixed batch under a :class:`RowPlan`: each decode row equals that row alone (the GEMV), bit for bit, and
    each prompt chunk equals that chunk alone, however short (the GEMM), whatever else the batch holds."""
    rng = np.random.default_rng(2)
    k = k_for(type_name)[1]
    w = prepare_weight(random_tensor(type_name, 256, k, seed=3))
    chunks = [1, 1, 1, 5, 11, 1, 3] if order == "interleaved" else [1, 1, 1, 1, 5, 11, 3]
    prefill = np.array([c > 1 for c in chunks])
    starts = np.concatenate([[0], np.cumsum(chunks)])
    x = rng.standard_normal((starts[-1], k)).astype(np.float32)
    for threads in ON_ISA[isa]:
        batched = qmatmul(x, w, threads, plan=RowPlan(starts, prefill))
        for j, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            alone = qmatmul(x[a:b], w, threads, plan=RowPlan(np.array([0, b - a]), prefill[j:j + 1]))
            np.testing.assert_array_equal(batched[a:b], alone, err_msg=f"chunk {j} of {chunks}")
        decode_rows = np.flatnonzero(np.repeat(~prefill, chunks))
        np.testing.assert_array_equal(batched[decode_rows], qmatmul(x[decode_rows], w, threads))
        five = slice(starts[chunks.index(5)], starts[chunks.index(5) + 1])
        assert not np.array_equal(qmatmul(x[five], w, threads), batched[five])  # without a plan: the GEMV
