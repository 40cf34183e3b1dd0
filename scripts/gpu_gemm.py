"""The prefill GEMM on the GPU (gemm.py, bf16 and
exact modes): max error against a float64 matmul of the dequantized weight, time and TFLOP/s at m = 128/512/2048
on the benchmark models' shapes, and a time-bounded tile sweep of the new kernel. Each call is timed inside a CUDA
graph (host launch cost excluded; the new path's x copy included). Summary table printed last and written to
DIR/gemm.txt. Usage (repo root, GPU machine): PYTHONPATH=src python3 scripts/gpu_gemm.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, "tests/backends/cuda")
from gpu_timing import graph_seconds  # noqa: E402
from random_blocks import random_raw  # noqa: E402

from quanta.backends.cuda import gemm as G  # noqa: E402
from quanta.backends.cuda import qmatmul as qm  # noqa: E402
from quanta.backends.cuda.repack import dequantize_packed, repack  # noqa: E402

ROWS = (128, 512, 2048)
SHAPES = ((2304, 2048), (256, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048), (8960, 1536))
FORMATS = ("Q4_K", "Q6_K", "Q4_0", "Q8_0", "Q5_0")
SWEEP = [  # BM, BN, BK, SWAP, num_warps, num_stages (non-swapped 4-bit tiles fail to compile on triton 3.6)
    (128, 64, 64, True, 4, 3), (128, 64, 64, True, 4, 4), (128, 64, 128, True, 4, 3), (64, 64, 64, True, 4, 3),
    (256, 64, 64, True, 8, 3), (128, 128, 64, True, 8, 3), (256, 128, 64, True, 8, 3), (64, 128, 64, True, 4, 3),
    (32, 64, 64, True, 4, 3), (128, 64, 64, False, 4, 3), (128, 128, 64, False, 8, 3), (256, 128, 64, False, 8, 3),
]
SWEEP_SHAPES = ((2304, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (256, 2048))
LINES: list[str] = []


def say(msg: str = "", table: bool = False) -> None:
    print(msg, flush=True)
    if table:
        LINES.append(msg)


def graph_time(fn, reps: int = 5, calls: int = 10) -> float:
    """Median seconds per call of ``fn()``, ``calls`` calls captured back to back in a CUDA graph."""
    return graph_seconds([fn] * calls, reps)


def new_gemm(x: torch.Tensor, w, out: torch.Tensor, exact: bool = False, tiles: dict | None = None) -> None:
    G.gemm(x, w, qm._Epilogue(out, None, None, None, w.n), exact, tiles)


_WEIGHTS: dict = {}


def weight(t: str, n: int, k: int):
    if (t, n, k) in _WEIGHTS:
        return _WEIGHTS[(t, n, k)]
    if len(_WEIGHTS) > 8:
        _WEIGHTS.clear()
    raw = torch.from_numpy(random_raw(t, n, k, np.random.default_rng(n + k))).cuda()
    _WEIGHTS[(t, n, k)] = repack(raw, t, (n, k))
    return _WEIGHTS[(t, n, k)]


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def errors(quick: bool) -> None:
    """Max |error| / max |y| at m = 77 (not a tile multiple) against float64, every format and shape."""
    say("== errors (m = 77, max|err| / max|y| vs float64)")
    say(f"{'format':6} {'n':>6} {'k':>5} {'bf16':>9} {'exact':>9}", table=True)
    for t in FORMATS:
        for n, k in SHAPES[:3] if quick else SHAPES:
            try:
                w = weight(t, n, k)
                x = torch.randn(77, k, device="cuda")
                want = x.double() @ dequantize_packed(w).double().T
                errs = []
                for exact in (False, True):
                    out = torch.full((77, n), float("nan"), device="cuda")
                    new_gemm(x, w, out, exact)
                    errs.append(max_err(out, want))
                say(f"{t:6} {n:6} {k:5} {errs[0]:9.2e} {errs[1]:9.2e}", table=True)
            except Exception as e:
                say(traceback.format_exc())
                say(f"{t} {n}x{k}: FAILED {type(e).__name__}: {str(e)[:120]}", table=True)


def speed(quick: bool) -> None:
    say("== speed: bf16 (and exact at m = 512), graph-timed, TFLOP/s")
    say(f"{'format':6} {'m':>5} {'n':>6} {'k':>5} {'us':>8} {'TF':>7} {'exact TF':>8}", table=True)
    totals = {m: 0.0 for m in ROWS}
    for t in FORMATS[:2] if quick else FORMATS:
        for n, k in SHAPES:
            w = weight(t, n, k)
            for m in ROWS:
                try:
                    x = torch.randn(m, k, device="cuda")
                    out = torch.empty(m, n, device="cuda")
                    tn = graph_time(lambda: new_gemm(x, w, out))
                    te = graph_time(lambda: new_gemm(x, w, out, True), reps=3, calls=3) if m == 512 else None
                    fl = 2 * m * n * k
                    totals[m] += tn
                    ex = f"{fl / te / 1e12:8.1f}" if te else f"{'':8}"
                    say(f"{t:6} {m:5} {n:6} {k:5} {tn * 1e6:8.1f} {fl / tn / 1e12:7.1f} {ex}", table=True)
                except Exception as e:
                    say(traceback.format_exc())
                    say(f"{t} m={m} {n}x{k}: FAILED {type(e).__name__}: {str(e)[:120]}", table=True)
    for m, tn in totals.items():
        say(f"all shapes/formats at m={m}: {tn * 1e3:.2f} ms", table=True)


def sweep(budget_s: float, quick: bool) -> None:
    """The SWEEP tiles at m = 512 (and 2048) on the main shapes; stops when the time budget is spent."""
    say("== tile sweep of the new kernel (bf16), total time over the sweep shapes; best per shape")
    t0 = time.perf_counter()
    for t in ("Q4_K", "Q6_K") if quick else ("Q4_K", "Q6_K", "Q4_0"):
        for m in (512, 2048):
            per_cfg: dict = {}
            best: dict = {}
            for cfg in SWEEP:
                if time.perf_counter() - t0 > budget_s:
                    say("(sweep time budget spent)", table=True)
                    return
                bm, bn, bk, swap, warps, stages = cfg
                tiles = {"BM": bm, "BN": bn, "BK": bk, "SWAP": swap, "num_warps": warps, "num_stages": stages}
                try:
                    tot = 0.0
                    for n, k in SWEEP_SHAPES:
                        w = weight(t, n, k)
                        x = torch.randn(m, k, device="cuda")
                        out = torch.empty(m, n, device="cuda")
                        dt = graph_time(lambda: new_gemm(x, w, out, False, tiles), reps=3, calls=5)
                        tot += dt
                        if (t, n, k) not in best or dt < best[(t, n, k)][0]:
                            best[(t, n, k)] = (dt, cfg)
                    per_cfg[cfg] = tot
                    say(f"{t} m={m} {cfg}: {tot * 1e6:.1f} us")
                except Exception as e:
                    say(f"{t} m={m} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
            if per_cfg:
                top = sorted(per_cfg.items(), key=lambda kv: kv[1])[:3]
                say(f"sweep {t} m={m} best overall: " + "; ".join(f"{c} {s * 1e6:.0f} us" for c, s in top),
                    table=True)
            for (tt, n, k), (dt, cfg) in best.items():
                say(f"sweep {tt} m={m} {n}x{k}: best {cfg} {2 * m * n * k / dt / 1e12:.1f} TF/s", table=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("gpu_out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep-s", type=float, default=60.0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", table=True)
    for step in (lambda: errors(a.quick), lambda: speed(a.quick), lambda: sweep(a.sweep_s, a.quick)):
        try:
            step()
        except Exception:
            say(f"FAILED\n{traceback.format_exc()}", table=True)
    say(f"total {time.perf_counter() - t0:.0f} s", table=True)
    say("\n==== summary")
    for ln in LINES:
        print(ln)
    (a.out / "gemm.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
