"""Prefill: the fused-dequantization GEMM against dequantizing the weight to bf16 first (gemm.dequantize_words)
and then multiplying it as a dense matrix: by the GEMM kernel's pointer-based dense path (several tiles; GPU
journal, runs 124-125) or by dense_gemm.py's TMA kernel (as shipped and per tile; runs 137-140), on the benchmark
models' layer shapes; torch's bf16 matmul as a bound. Graph-timed, µs per matmul.

Usage on the GPU machine: PYTHONPATH=src python3 scripts/gpu_dense.py [ROWS ...]   (default 64 512 2048)
"""

from __future__ import annotations

import sys

import numpy as np
import torch

sys.path.insert(0, "scripts")
sys.path.insert(0, "tests/backends/cuda")
from gpu_timing import graph_seconds
from random_blocks import random_raw

from quanta.backends.cuda import gemm as gm
from quanta.backends.cuda import qmatmul as qm
from quanta.backends.cuda.dense_gemm import dense_gemm
from quanta.backends.cuda.repack import PackedWeight, repack

MODELS = {  # (format, layers, [(n, k) of q|k|v, o, gate|up, down])
    "tinyllama": ("Q4_K", 22, [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]),
    "llama-3.2": ("Q4_K", 16, [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]),
    "qwen2.5": ("Q4_0", 28, [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]),
}


POINTER_TILES = [  # BM (activation rows), BN (weight rows), BK, SWAP, warps, stages
    (128, 64, 64, True, 4, 3), (128, 128, 64, False, 8, 3), (128, 256, 64, False, 8, 3), (64, 128, 64, False, 4, 4),
    (128, 128, 64, False, 4, 4), (64, 64, 64, False, 4, 4), (32, 128, 64, False, 4, 4), (32, 64, 64, False, 4, 4),
]
TMA_TILES = [  # BM, BN, warps, stages
    (128, 256, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4),
]


def shape_times(fmt: str, m: int, n: int, k: int) -> dict[str, float]:
    """Seconds per matmul of each way (fused; dequantizing alone; torch's bf16 matmul; the dense GEMMs per tile)."""
    raw = torch.from_numpy(random_raw(fmt, n, k, np.random.default_rng(n + k))).cuda()
    w = repack(raw, fmt, (n, k))
    x = torch.randn(m, k, device="cuda")
    xw = gm.word_order(x, w.kind, torch.bfloat16)
    out = torch.empty(m, n, device="cuda")
    scratch = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
    ep = qm._Epilogue(out, None, None, None, n)
    gm.gemm(x, w, ep, False, xw=xw)
    ref = out.clone()
    times = {"fused": graph_seconds([lambda: gm.gemm(x, w, ep, False, xw=xw)] * 10),
             "dequant": graph_seconds([lambda: gm.dequantize_words(w, scratch)] * 10)}
    wd = gm.dequantize_words(w, scratch)
    dense = PackedWeight("BF16", n, k, "dense", wd)
    times["torch bf16"] = graph_seconds([lambda: torch.matmul(xw, wd.T)] * 10)
    ways = {"tma shipped": lambda: dense_gemm(xw, wd, ep)}
    for bm, bn, bk, swap, warps, stages in POINTER_TILES:
        tiles = {"BM": bm, "BN": bn, "BK": bk, "SWAP": swap, "num_warps": warps, "num_stages": stages}
        label = f"pointer {bm}x{bn}x{bk} {'swap ' if swap else ''}{warps}w{stages}s"
        ways[label] = lambda tiles=tiles: gm.gemm(x, dense, ep, False, tiles, xw=xw)
    for bm, bn, warps, stages in TMA_TILES:
        tiles = {"BM": bm, "BN": bn, "num_warps": warps, "num_stages": stages}
        ways[f"tma {bm}x{bn} {warps}w{stages}s"] = lambda tiles=tiles: dense_gemm(xw, wd, ep, tiles)
    for label, way in ways.items():
        out.zero_()
        way()
        err = float((out - ref).abs().max() / ref.abs().max())
        times[label] = graph_seconds([way] * 10)
        if err > 1e-2:
            print(f"  {label}: differs from the fused GEMM by {err:.1e}", flush=True)
    return times


def main(rows: tuple[int, ...]) -> None:
    for model, (fmt, layers, shapes) in MODELS.items():
        for m in rows:
            totals: dict[str, float] = {}
            for n, k in shapes:
                times = shape_times(fmt, m, n, k)
                print(f"{model} m={m} {n}x{k} {fmt}: " + ", ".join(f"{lab} {t * 1e6:.1f}" for lab, t in times.items()),
                      flush=True)
                for prefix in ("pointer", "tma"):
                    times[f"best {prefix} per shape"] = min(t for lab, t in times.items() if lab.startswith(prefix))
                for lab, t in times.items():
                    dense = lab.startswith(("pointer", "tma", "best"))
                    label = "dequant+" + lab if dense else lab
                    totals[label] = totals.get(label, 0) + t + (times["dequant"] if dense else 0)
            print(f"== {model} m={m}, per layer (x {layers} layers): " + ", ".join(
                f"{lab} {t * 1e6:.0f} us" for lab, t in sorted(totals.items(), key=lambda kv: kv[1])), flush=True)


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (64, 512, 2048))
