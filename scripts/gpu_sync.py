"""What one dependency between kernels costs on the GPU: a chain of GEMV phases (each reads the vector the one
before wrote) run as separate launches (plain, or with programmatic dependent launch) and as one persistent
kernel whose phases are separated by a software grid barrier (an atomic arrival counter, polled).

Usage on the GPU machine: PYTHONPATH=src python3 scripts/gpu_sync.py   (prints µs per phase; GPU journal, run 119)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "scripts")
from gpu_timing import graph_seconds

from quanta.backends.cuda import pdl

D = 2048  # a 1B model's hidden size; phases of D x D fp16 weights (8 MB each: the chain streams from HBM)
PHASES = 48


@triton.jit
def _rows_dot(w_ptr, x_ptr, rows, k, D: tl.constexpr, BK: tl.constexpr, w0, w1):
    """The dot products of the program's rows with x: the first two K steps already loaded (w0, w1)."""
    acc = tl.sum(w0.to(tl.float32) * tl.load(x_ptr + k, cache_modifier=".cg")[None, :], axis=1)
    acc += tl.sum(w1.to(tl.float32) * tl.load(x_ptr + BK + k, cache_modifier=".cg")[None, :], axis=1)
    for k0 in range(2 * BK, D, BK):
        w = tl.load(w_ptr + rows[:, None] * D + k0 + k[None, :])
        acc += tl.sum(w.to(tl.float32) * tl.load(x_ptr + k0 + k, cache_modifier=".cg")[None, :], axis=1)
    return acc * (1.0 / 45.25)  # ~1/sqrt(D): the vector keeps its scale along the chain


@triton.jit
def _phase_kernel(w_ptr, x_ptr, y_ptr, D: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BK)
    w0 = tl.load(w_ptr + rows[:, None] * D + k[None, :])
    w1 = tl.load(w_ptr + rows[:, None] * D + BK + k[None, :])
    pdl.wait_prev(PDL)
    tl.store(y_ptr + rows, _rows_dot(w_ptr, x_ptr, rows, k, D, BK, w0, w1))


@triton.jit
def _persistent_kernel(w_ptr, x_ptr, count_ptr, n_phases, D: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
                       BARRIER: tl.constexpr, AHEAD: tl.constexpr):
    """All phases in one launch; x_ptr holds two vectors (ping-pong). BARRIER=False: no synchronisation at all
    (wrong results: the streaming floor). AHEAD: the first two K steps of phase i+1 are loaded before phase i's
    barrier (as a PDL chain's next kernel does), else before phase i+1's."""
    n_prog = tl.num_programs(0)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BK)
    tile = rows[:, None] * D + k[None, :]
    n0 = tl.load(w_ptr + tile)
    n1 = tl.load(w_ptr + BK + tile)
    for i in range(n_phases):
        wi = w_ptr + i * (D * D)
        if AHEAD:
            w0 = n0
            w1 = n1
            more = tile * 0 + i + 1 < n_phases
            n0 = tl.load(wi + D * D + tile, mask=more, other=0.0)
            n1 = tl.load(wi + D * D + BK + tile, mask=more, other=0.0)
        else:
            w0 = tl.load(wi + tile)
            w1 = tl.load(wi + BK + tile)
        if BARRIER:
            if i > 0:  # wait until every program has stored phase i-1
                seen = tl.atomic_add(count_ptr, 0, sem="acquire")
                while seen < i * n_prog:
                    seen = tl.atomic_add(count_ptr, 0, sem="acquire")
            tl.debug_barrier()
        acc = _rows_dot(wi, x_ptr + (i % 2) * D, rows, k, D, BK, w0, w1)
        tl.store(x_ptr + ((i + 1) % 2) * D + rows, acc)
        if BARRIER:
            tl.debug_barrier()
            tl.atomic_add(count_ptr, 1, sem="release")


def _measure(w: torch.Tensor, x0: torch.Tensor, rows: int, bk: int, warps: int) -> None:
    """Print µs per phase of each way to run the chain with programs of ``rows`` rows, K steps of ``bk``."""
    grid = (D // rows,)
    xs = torch.empty(PHASES + 1, D, device="cuda")
    pingpong = torch.empty(2, D, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")

    def chain(use_pdl: bool) -> None:
        xs[0].copy_(x0)
        for i in range(PHASES):
            _phase_kernel[grid](w[i], xs[i], xs[i + 1], D=D, ROWS=rows, BK=bk, PDL=use_pdl, launch_pdl=use_pdl,
                                num_warps=warps)

    def persistent(barrier: bool, ahead: bool = False) -> None:
        pingpong[0].copy_(x0)
        count.zero_()
        _persistent_kernel[grid](w, pingpong, count, PHASES, D=D, ROWS=rows, BK=bk, BARRIER=barrier, AHEAD=ahead,
                                 num_warps=warps)

    chain(True)
    persistent(True, True)
    err = float((pingpong[PHASES % 2] - xs[PHASES]).abs().max() / xs[PHASES].abs().max())
    tag = f"{rows} rows x BK {bk}, {warps} warps, {grid[0]} programs"
    for label, fn in (("launches", lambda: chain(False)), ("launches + PDL", lambda: chain(True)),
                      ("persistent, grid barrier", lambda: persistent(True)),
                      ("persistent, no barrier (floor)", lambda: persistent(False)),
                      ("persistent, barrier, next phase ahead", lambda: persistent(True, True)),
                      ("persistent, no barrier, ahead (floor)", lambda: persistent(False, True))):
        t = graph_seconds([fn] * 4, reps=7) / PHASES
        print(f"{tag:44s} {label:38s} {t * 1e6:6.2f} us/phase ({D * D * 2 / t / 1e12:.2f} TB/s)", flush=True)
    print(f"{tag:44s} persistent vs launches: max relative difference {err:.1e}", flush=True)


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(PHASES, D, D, device="cuda", dtype=torch.float16)
    x0 = torch.randn(D, device="cuda")
    # every program of the persistent kernel must be resident at once (the barrier waits for all): at most 512 here
    for rows, bk, warps in ((16, 512, 4), (4, 1024, 1), (4, 1024, 2), (8, 512, 2), (8, 512, 4)):
        _measure(w, x0, rows, bk, warps)


if __name__ == "__main__":
    main()
