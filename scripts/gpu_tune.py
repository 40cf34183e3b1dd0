"""Sweep the decode GEMVs' tile configurations on the GPU (the prefill GEMM has its own sweep: gpu_gemm.py): each
config's calls are captured back to back in a CUDA graph (host launch cost excluded) over rotating weight copies
(HBM, not L2).

Prints, per (shape, format), the best configurations and their GB/s. Used to choose the
defaults in quanta/backends/cuda/qmatmul.py; the results are recorded in docs/PERF.md, GPU journal.
Usage: PYTHONPATH=src python3 scripts/gpu_tune.py [gemv] [q8]   (q8: the int8-activation GEMV of q8gemv.py,
with the float GEMV's time at its chosen tile beside it)
"""

from __future__ import annotations

import sys

import numpy as np
import torch

sys.path.insert(0, "scripts")
from gpu_common import random_raw  # noqa: E402
from gpu_timing import graph_seconds  # noqa: E402

from quanta.backends.cuda import pdl, q8gemv as q8m, qmatmul as qm  # noqa: E402
from quanta.backends.cuda.repack import repack  # noqa: E402



def weights(t: str, n: int, k: int, copies: int) -> list:
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(random_raw(t, n, k, rng)).cuda()
    return [repack(raw.clone(), t, (n, k)) for _ in range(copies)]


GEMV_SHAPES = {  # (code width, class): decode shapes of the benchmark models (TinyLlama, Llama-3.2-1B, Qwen2.5-1.5B)
    (4, "small"): [((256, 2048), "Q4_K"), ((512, 2048), "Q4_K"), ((256, 1536), "Q4_0")],
    (4, "base"): [((2048, 2048), "Q4_K"), ((5632, 2048), "Q4_K"), ((8192, 2048), "Q4_K"), ((1536, 1536), "Q4_0"),
                  ((8960, 1536), "Q4_0")],
    (4, "long"): [((2048, 5632), "Q4_K"), ((2048, 8192), "Q4_K"), ((1536, 8960), "Q4_0")],
    (6, "long"): [((2048, 5632), "Q6_K"), ((2048, 8192), "Q6_K")],
    (6, "head"): [((32000, 2048), "Q6_K"), ((128256, 2048), "Q6_K"), ((151936, 1536), "Q6_K")],
}
GEMV_CONFIGS = {  # (BN, BJ, num_warps)
    4: [(1, 64, 2), (2, 64, 2), (4, 64, 2), (4, 32, 1), (8, 32, 2), (4, 128, 4), (8, 64, 4), (16, 64, 4)],
    8: [(1, 64, 2), (2, 32, 1), (2, 64, 2), (2, 128, 4), (4, 128, 4), (4, 64, 2), (8, 64, 4)],
}
GEMV_CONFIGS[6] = GEMV_CONFIGS[4]


def graph_time(fn, ws, reps: int = 5) -> float:
    """Seconds per call of ``fn(w)`` over the rotating weights ``ws`` (HBM, not L2, serves them), from one graph."""
    return graph_seconds([lambda w=w: fn(w) for w in ws], reps)


Q8_CONFIGS = {  # (BN, BJ, num_warps)
    4: [(1, 64, 2), (2, 64, 2), (4, 64, 2), (4, 32, 1), (8, 32, 2), (4, 128, 4), (8, 64, 4), (16, 32, 4),
        (16, 64, 4), (8, 128, 8)],
    8: [(1, 64, 2), (2, 32, 1), (2, 64, 2), (2, 128, 4), (4, 128, 4), (4, 64, 2), (8, 64, 4), (8, 32, 2)],
    6: [(1, 64, 2), (1, 256, 4), (2, 32, 1), (2, 64, 2), (4, 64, 1), (4, 32, 1), (2, 128, 4), (4, 64, 2),
        (8, 32, 2), (4, 128, 4), (8, 64, 4)],
}


def sweep(label: str, table: dict, configs: dict, int8: bool, widths: tuple[int, ...] = (4, 6, 8)) -> dict:
    """Per (code width, class): the config with the least total graph time over that class's shapes, for the
    float GEMV (tiles in ``table`` = qmatmul.GEMV_CONFIG) or the int8 one (q8gemv.Q8_CONFIG; the float GEMV's time
    at its current tile is printed beside it). Sets ``table`` and returns the choices; prints each shape's best
    configs with their GB/s."""
    chosen = {}
    pre = {"PRE": 2} if int8 else {}  # the int8 GEMV's first two K steps before its wait, as shipped
    for (bits, cls), shapes in GEMV_SHAPES.items():
        if bits not in widths:
            continue
        totals: dict = {}
        for (n, k), t in shapes:
            ws = weights(t, n, k, max(4, min(64, int(400e6 // (n * k)))))
            nbytes = ws[0].nbytes
            x = torch.randn(1, k, device="cuda")
            xq = q8m.quantize(x) if int8 else None
            y = torch.empty(1, n, device="cuda")
            base = f"float {graph_time(lambda w: qm.qmatmul(x, w, out=y), ws) * 1e6:.1f}us | " if int8 else ""
            res = []
            for cfg in configs[bits]:
                bn, bj, nw = cfg
                table[(bits, cls)] = {"BN": bn, "BJ": bj, "num_warps": nw, **pre}
                try:
                    s = graph_time(lambda w: qm.qmatmul(x, w, out=y, xq=xq), ws)
                except Exception as e:  # a config the compiler rejects
                    print("  skip", cfg, repr(e)[:80])
                    continue
                res.append((s, cfg))
                totals[cfg] = totals.get(cfg, 0.0) + s
            res.sort()
            best = ", ".join(f"{c}: {nbytes / s / 1e9:.0f} GB/s {s * 1e6:.1f}us" for s, c in res[:3])
            print(f"{label} {t} n={n} k={k} ({nbytes / 1e6:.1f} MB): {base}{best}", flush=True)
            del ws
        cfg, tot = min(totals.items(), key=lambda kv: kv[1])
        print(f"{label} {bits}-bit {cls}: best {cfg} ({tot * 1e6:.1f} us for {len(shapes)} shapes)", flush=True)
        chosen[(bits, cls)] = table[(bits, cls)] = {"BN": cfg[0], "BJ": cfg[1], "num_warps": cfg[2], **pre}
    return chosen


def gemv() -> dict:
    """The float GEMV's tiles (qmatmul.GEMV_CONFIG)."""
    return sweep("GEMV", qm.GEMV_CONFIG, GEMV_CONFIGS, int8=False)


def q8(widths: tuple[int, ...] = (4, 6, 8)) -> dict:
    """The int8 GEMV's tiles (q8gemv.Q8_CONFIG) of the code widths ``widths``."""
    return sweep("Q8 GEMV", q8m.Q8_CONFIG, Q8_CONFIGS, int8=True, widths=widths)


if __name__ == "__main__":
    pdl.enable(True)
    for what in sys.argv[1:] or ["gemv"]:
        print({"gemv": gemv, "q8": q8}[what](), flush=True)
