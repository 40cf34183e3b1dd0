"""Sweep the GEMV / GEMM tile configurations on the GPU (weights rotated over > L2 so HBM is measured).

Prints, per (shape, format), the best configurations and their GB/s (GEMV) or TFLOP/s (GEMM). Used to choose the
defaults in quanta/backends/cuda/qmatmul.py; the results are recorded in docs/PERF_gpu.md.
Usage: PYTHONPATH=src python3 scripts/gpu_tune.py [gemv|gemm]...
"""

from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import torch
import triton
import triton.testing

sys.path.insert(0, "scripts")
from gpu_check import random_raw  # noqa: E402

from quanta.backends.cuda import qmatmul as qm  # noqa: E402
from quanta.backends.cuda.repack import repack  # noqa: E402



def weights(t: str, n: int, k: int, copies: int) -> list:
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(random_raw(t, n, k, rng)).cuda()
    return [repack(raw.clone(), t, (n, k)) for _ in range(copies)]


def bench(fn, ws) -> float:
    i = [0]

    def step():
        fn(ws[i[0] % len(ws)])
        i[0] += 1
    return triton.testing.do_bench(step, warmup=10, rep=40, return_mode="median") * 1e-3


def gemv(configs=None) -> dict:
    """Time the GEMV over tile configs on decode shapes; returns the config with the least total time."""
    configs = configs or list(itertools.product((2, 4, 8), (8, 16), (1, 2, 4)))
    totals: dict = {}
    for (n, k), t in (((2048, 2048), "Q4_K"), ((5632, 2048), "Q4_K"), ((2048, 5632), "Q6_K"),
                      ((32000, 2048), "Q6_K")):
        copies = max(2, int(200e6 // (n * k)))
        ws = weights(t, n, k, copies)
        nbytes = ws[0].nbytes
        x = torch.randn(1, k, device="cuda")
        y = torch.empty(1, n, device="cuda")
        res = []
        for bn, bc, nw in configs:
            def fn(w, bn=bn, bc=bc, nw=nw):
                qm._gemv_kernel[(triton.cdiv(n, bn), 1)](
                    x, *qm._planes(w), y, y, n, k, w.q.stride(0), k, n, HAS_RES=False, BN=bn, BC=bc,
                    MASKED=bool(k % (32 * bc) or n % bn), num_warps=nw, **qm._meta(w))
            try:
                s = bench(fn, ws)
            except Exception as e:  # a config the compiler rejects
                print("  skip", bn, bc, nw, repr(e)[:80])
                continue
            res.append((s, bn, bc, nw))
            totals[(bn, bc, nw)] = totals.get((bn, bc, nw), 0.0) + s
        res.sort()
        best = ", ".join(f"BN={b} BC={c} W={w}: {nbytes / s / 1e9:.0f} GB/s {s * 1e6:.1f}us" for s, b, c, w in res[:4])
        print(f"GEMV {t} n={n} k={k} ({nbytes / 1e6:.1f} MB): {best}", flush=True)
    (bn, bc, nw), tot = min(totals.items(), key=lambda kv: kv[1])
    print(f"GEMV best overall: BN={bn} BC={bc} num_warps={nw} ({tot * 1e6:.1f} us for the 4 shapes)", flush=True)
    return {"BN": bn, "BC": bc, "num_warps": nw}


def gemm() -> None:
    m = 512
    for (n, k), t in itertools.product([(5632, 2048), (2048, 5632), (32000, 2048)], ["Q4_K", "Q6_K"]):
        ws = weights(t, n, k, 2)
        x = torch.randn(m, k, device="cuda")
        y = torch.empty(m, n, device="cuda")
        res = []
        for bm, bn, bc, nw, ns, prec in itertools.product((64, 128), (64, 128), (1, 2), (4, 8), (3,),
                                                          ("tf32",)):
            def fn(w, bm=bm, bn=bn, bc=bc, nw=nw, ns=ns, prec=prec):
                qm._gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
                    x, *qm._planes(w), y, y, m, n, k, w.q.stride(0), k, n, HAS_RES=False, BM=bm, BN=bn, BC=bc, num_warps=nw,
                    num_stages=ns, PRECISION=prec, **qm._meta(w))
            try:
                s = bench(fn, ws)
            except Exception as e:
                print("  skip", bm, bn, bc, nw, ns, repr(e)[:80])
                continue
            res.append((s, bm, bn, bc, nw, ns))
        res.sort()
        fl = 2 * m * n * k
        best = ", ".join(f"BM={a} BN={b} BC={c} W={w} S={s_}: {fl / s / 1e12:.1f} TF {s * 1e6:.0f}us"
                         for s, a, b, c, w, s_ in res[:4])
        print(f"GEMM m={m} {t} n={n} k={k}: {best}", flush=True)


if __name__ == "__main__":
    for what in sys.argv[1:] or ["gemv", "gemm"]:
        {"gemv": gemv, "gemm": gemm}[what]()
