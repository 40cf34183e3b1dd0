"""Recording a forward as a CUDA graph (``CUDABackend.capture``): ~300 kernel launches replayed without Python.

A graph replays the kernels with the addresses they had when recorded, so everything it reads must stay where it
was: its inputs (device arrays the caller rewrites in place; the engine's decode graphs, engine/graphs.py), the
weights and the KV pool, and every intermediate. While a forward is recorded, the backend's named buffers come
from the recording (``GraphRecorder.buffer``: storage of that graph's own, kept as long as its replay function),
so the eager path's buffers may grow or move freely; graphs recorded with ``share_rows`` (the prefill graphs) share
one set instead, each buffer sized for that many rows, as they never run at the same time. Other lazily made
scratch (the decode attention's partials, the int8 copies of activations, the dequantizing GEMMs' scratch) is made
by the eager warm-up run that precedes each capture and never replaced. All graphs share one memory pool and one
capture stream: they never run at the same time, and what a graph allocates inside its capture (a GEMM's permuted
copy of x) is dead by the end of each replay.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[None]:
    """``torch.cuda.graph(graph, **kwargs)`` with Python's automatic garbage collection held off: a collection
    during the capture can free another, unreachable graph, and destroying a graph while a stream captures
    invalidates the capture ("operation not permitted when stream is capturing")."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **kwargs):
            yield
    finally:
        if was_enabled:
            gc.enable()


class GraphRecorder:
    """The CUDA backend's graph recording: the shared pool and stream, and the buffers of the graph being recorded."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._buffers: dict[str, torch.Tensor] | None = None  # the recording graph's, while one records
        self._rows: int | None = None  # while recording into the shared set: the rows its buffers hold
        self._shared: dict[str, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # shared storage outgrown, still read by graphs recorded with it

    @property
    def capturing(self) -> bool:
        return self._buffers is not None

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The recording graph's float32 buffer ``name`` (one storage per name, sized at its first request), or the
        shared set's (sized for ``share_rows`` rows of the buffer's width)."""
        assert self._buffers is not None
        size = math.prod(shape)
        if self._rows is not None:
            buf = self._shared.get(name)
            if buf is None or buf.numel() < size:  # a name used at a new width (x_words of d_model, then of d_ff)
                if buf is not None:  # graphs recorded before (and this one's earlier kernels) keep the old storage
                    self._retired.append(buf)
                buf = self._shared[name] = torch.empty(max(size // shape[0] * self._rows, size),
                                                       dtype=torch.float32, device=self.device)
            return buf[:size].view(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size:  # (a smaller one stays with the graph: kernels recorded before use it)
            if buf is not None:
                self._buffers[f"{name}@{buf.numel()}"] = buf
            buf = self._buffers[name] = torch.empty(size, dtype=torch.float32, device=self.device)
        return buf[:size].view(shape)

    def record(self, forward: Callable[[], torch.Tensor], share_rows: int | None = None) -> Callable[[], torch.Tensor]:
        """Run ``forward`` once eagerly (it compiles its kernels and makes the lazily made scratch), then record it;
        returns the replay function (it holds the graph and its buffers). ``share_rows``: the buffers come from
        the shared set, sized for that many rows."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            forward()
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self._buffers, self._rows = {}, share_rows
        try:
            with capturing(graph, pool=self._pool, stream=stream):
                out = forward()
            buffers = self._buffers
        finally:
            self._buffers, self._rows = None, None

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        replay.graph, replay.buffers = graph, buffers  # type: ignore[attr-defined]  (kept alive with the function)
        return replay
