"""Weights of one input in one GEMV job (``grouped.py``, the CPU backend's ``fuse``/``matmul_split``): each part's
rows, bias added, bit for bit what its own ``qmatmul`` gives, on every int8 path of this CPU, for decode rows
(one job) and for prefill rows (each weight alone); and which weights are not grouped."""

from __future__ import annotations

import numpy as np
import pytest

from quanta.backends.cpu.grouped import group, matmul_group
from quanta.backends.cpu.kernels.isa import host_isas
from quanta.backends.cpu.qmatmul import CPUThreads, RowPlan, prepare_weight, qmatmul

from test_qmatmul import random_tensor

ON_ISA = {isa: CPUThreads(2, isa=isa) for isa in host_isas()}
pytestmark = pytest.mark.skipif(not ON_ISA, reason="the int8 kernels need AVX2")
GROUPS = [("Q4_K", "Q4_K", "Q6_K"), ("Q4_1", "Q4_1", "Q4_1"), ("Q5_K", "Q4_K"), ("Q8_0", "Q8_0")]


def _weights(types: tuple[str, ...], k: int) -> list:
    return [prepare_weight(random_tensor(t, m, k, seed=i)) for i, (t, m) in enumerate(zip(types, (96, 32, 40)))]


@pytest.mark.parametrize("isa", list(ON_ISA))
@pytest.mark.parametrize("types", GROUPS)
def test_a_group_is_each_weight_alone(isa, types):
    threads = ON_ISA[isa]
    ws = _weights(types, 512)
    biases = [np.random.default_rng(5).standard_normal(w.shape[0]).astype(np.float32) if i == 0 else None
              for i, w in enumerate(ws)]
    g = group(ws, biases, threads, exact=False)
    assert g is not None and g.widths == tuple(w.shape[0] for w in ws)
    rng = np.random.default_rng(1)
    for n, plan in ((1, None), (3, None), (8, None), (6, RowPlan(np.array([0, 1, 6]), np.array([False, True])))):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        outs = matmul_group(x, g, threads, [np.full((n, w.shape[0]), np.nan, np.float32) for w in ws], plan=plan)
        for w, b, got in zip(ws, biases, outs):
            want = qmatmul(x, w, threads, plan=plan)
            np.testing.assert_array_equal(got, want + b if b is not None else want)


def test_what_is_not_grouped():
    threads = next(iter(ON_ISA.values()))
    q4k = _weights(("Q4_K", "Q4_K"), 512)
    assert group(q4k, [None, None], threads, exact=True) is None  # exact mode: fp32 GEMVs, each alone
    assert group(q4k[:1], [None], threads, exact=False) is None
    assert group([q4k[0], _weights(("Q4_0",), 512)[0]], [None, None], threads, exact=False) is None  # q8_K and q8
    assert group([q4k[0], _weights(("Q4_K",), 1024)[0]], [None, None], threads, exact=False) is None  # row lengths
    assert group([q4k[0], _weights(("F16",), 512)[0]], [None, None], threads, exact=False) is None
    assert group(_weights(("Q4_K",) * 3, 512) + q4k[:1], [None] * 4, threads, exact=False) is None  # at most 3
