"""Kernel timing for the GPU-machine scripts: calls captured back to back in one CUDA graph (no host launch cost)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_seconds(calls: list[Callable[[], object]], reps: int = 5) -> float:
    """Median seconds per call of ``calls`` (thunks), replayed back to back from one CUDA graph; the first two are
    run once before the capture (compilation, lazy allocations)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(calls))
    return sorted(times)[len(times) // 2]
