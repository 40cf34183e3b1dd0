"""CUDA graphs of the forward: the decode step (one token) and the prefill, padded to a length bucket.

A graph replays ~300 kernel launches without Python in between. Inputs live in device memory written before the
replay (the decode token and position by ``fill_``; a prefill's ids and positions by one host→device copy), and
every intermediate comes from backend buffers whose addresses never move while a graph reads them.

Prefill padding: ``n`` prompt tokens run as ``bucket(n)`` rows. The ``pad`` extra rows go FIRST and take the
positions after the prompt (``start + n ..``), so the last row is still the last real token and
``Model.logits``' last-row selection needs no change. Rows never mix except through the KV cache, and attention
reads only positions ``p <= pos``: real rows never see the padding's K/V, which lands past the prompt as harmless
garbage (every later token writes its K/V before anything reads that position). Rows of a batch are independent in
every other op (matmul, norms, rope, activations), so the real rows' values equal an unpadded forward's; an op that
mixed rows (say, one activation scale per tensor) would break that (tests/backends/cuda/test_graphs.py checks it).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from quanta.backends.cuda.qmatmul import GEMV_MAX_ROWS

MIN_GRAPH_PREFILL = GEMV_MAX_ROWS + 1  # fewer rows keep the fp32 GEMV of an unpadded eager forward
MAX_GRAPH_PREFILL = 2048  # longer prompts run eagerly (their launch overhead is small next to the kernels)
MIN_STEP = 16  # buckets are multiples of 16: one Triton specialization (divisibility) of the row count
PAD_ID = 0  # any valid token id: the padding rows' values are never read
CAPTURE_AT_USE = 2  # a bucket's graph is captured at its second prefill: the first prompt (time to first token)
# runs eagerly instead of paying a warm-up, a capture and a replay


def bucket(n: int) -> int:
    """Rows a prefill of ``n`` tokens runs as: ``n`` rounded up to a multiple of ``max(16, next_pow2(n) / 16)``.

    Eight buckets per octave above 256 (16, 32, … 256, 288, 320, … 512, 576, … 2048: 40 up to 2048), so the
    padding is under 16 rows, or under 12.5% of ``n`` (step ≤ next_pow2(n) / 16 < n / 8)."""
    step = max(MIN_STEP, (1 << (n - 1).bit_length()) // 16)
    return -(-n // step) * step


def prefill_bucket(n: int, start: int, n_ctx: int) -> int | None:
    """The bucket a prefill of ``n`` tokens at ``start`` replays as a graph, or None when it runs eagerly: too few
    or too many tokens, or padding positions that would pass the context (``start + bucket > n_ctx``)."""
    if not MIN_GRAPH_PREFILL <= n <= MAX_GRAPH_PREFILL:
        return None
    b = bucket(n)
    return b if start + b <= n_ctx else None


def padded_inputs(token_ids: np.ndarray, start: int, rows: int) -> np.ndarray:
    """(2, rows) int32: token ids and positions of a prefill padded at the front (see the module note).

    Row ``r`` has position ``start + (r + n) % rows``: padding rows ``start + n ..``, then the prompt ``start ..``."""
    n = len(token_ids)
    out = np.empty((2, rows), np.int32)
    out[0, :rows - n] = PAD_ID
    out[0, rows - n:] = token_ids
    out[1] = start + (np.arange(rows) + n) % rows
    return out


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


class DecodeGraph:
    """The one-token forward captured for one (model, cache): token id and position live in device memory.

    ``greedy`` replays a second capture of the same step that also writes its argmax into the token id and advances
    the position, so one replay feeds the next without the host: the host queues step i + 1 before it waits for
    step i's token (a 4-byte copy to pinned memory), and the device never idles on the host's read and bookkeeping
    (GPU run 188: those cost 9-10% of a decode step's time)."""

    def __init__(self, model: Any, cache: Any, device: torch.device, token: int, start: int):
        self.model, self.cache = model, cache
        self.ids = torch.full((1,), token, dtype=torch.int32, device=device)
        self.pos = torch.full((1,), start, dtype=torch.int32, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: compiles every kernel; rewrites the same K/V at `start`
            model.forward(self.ids, self.pos, cache, all_logits=False)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with capturing(self.graph):
            self.logits = model.forward(self.ids, self.pos, cache, all_logits=False)
        self.chained: torch.cuda.CUDAGraph | None = None
        self.host = torch.empty(2, dtype=torch.int32, pin_memory=True)  # the last two steps' tokens
        self.done = [torch.cuda.Event(), torch.cuda.Event()]

    def run(self, token: int, start: int) -> torch.Tensor:
        self.ids.fill_(token)
        self.pos.fill_(start)
        self.graph.replay()
        return self.logits

    def greedy(self, argmax: Callable[[torch.Tensor], torch.Tensor], token: int, start: int,
               steps: int) -> Iterator[int]:
        """The greedy tokens of ``steps`` steps from ``token`` at ``start``, one step queued ahead of the host: when
        the consumer stops early, the step after its last token still runs (its K/V lands past that token)."""
        if self.chained is None:
            argmax(self.logits.reshape(-1))  # compiled before the capture
            self.chained = torch.cuda.CUDAGraph()
            with capturing(self.chained):
                logits = self.model.forward(self.ids, self.pos, self.cache, all_logits=False)
                self.ids.copy_(argmax(logits.reshape(-1)))
                self.pos.add_(1)
        self.ids.fill_(token)
        self.pos.fill_(start)
        if steps > 0:
            self._queue(0)
        for i in range(steps):
            if i + 1 < steps:
                self._queue(i + 1)
            self.done[i % 2].synchronize()
            yield int(self.host[i % 2])

    def _queue(self, i: int) -> None:
        assert self.chained is not None
        self.chained.replay()
        self.host[i % 2:i % 2 + 1].copy_(self.ids, non_blocking=True)
        self.done[i % 2].record()


class PrefillGraph:
    """The forward of one bucket of padded rows, captured once for one (model, cache).

    ``forward(ids, positions)`` runs the model with the backend's fixed prefill buffers. The first call's inputs
    serve the warm-up (it compiles this bucket's kernels and writes the K/V the replay rewrites). All prefill
    graphs share one memory pool and one capture stream: they never run concurrently, and what they allocate
    inside the graph (the GEMM's permuted copies of x) is dead by the end of each replay."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], inputs: np.ndarray,
                 device: torch.device, pool: Any, stream: torch.cuda.Stream):
        self.io = torch.from_numpy(inputs).to(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward(self.io[0], self.io[1])
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with capturing(self.graph, pool=pool, stream=stream):
            self.logits = forward(self.io[0], self.io[1])

    def run(self, inputs: np.ndarray) -> torch.Tensor:
        self.io.copy_(torch.from_numpy(inputs))  # ≤ 16 KB from pageable memory: synchronous, allocates nothing
        self.graph.replay()
        return self.logits
