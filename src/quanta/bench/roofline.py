"""The memory roofline: how many bytes one decoded token reads, and how fast this machine can read them.

Decode is memory-bound: tok/s ≈ read bandwidth ÷ bytes read per token. Bytes per token count every weight matrix
once (the embedding table only when it doubles as the output head, since decode reads one row of it), plus the
KV cache read by attention at a given depth.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from quanta.errors import NoCUDAError
from quanta.gguf import GGUFFile


def weight_bytes_per_token(gguf: GGUFFile) -> int:
    """Bytes of weights one decode step reads: all tensors except the embedding table (one row is read),
    which is read whole when it is tied to the output head."""
    tied = "output.weight" not in gguf.tensors
    total = 0
    for name, t in gguf.tensors.items():
        if name == "token_embd.weight" and not tied:
            continue
        total += t.nbytes
    return total


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, depth: int, itemsize: float = 4) -> int:
    """Bytes of K and V attention reads for one token at ``depth`` tokens of context (``itemsize``: per value)."""
    return round(2 * n_layers * n_kv_heads * head_dim * depth * itemsize)


class CPUReadProbe:
    """The read bandwidth of a parallel sum over one ``size_mb`` MB array (numba, ``threads``), sampled on demand:
    on a shared machine it moves within minutes, so a bench samples it beside each measured run."""

    def __init__(self, threads: int, size_mb: int = 512):
        from quanta.bench._probe import parallel_sum

        self.threads = threads
        self.array = np.random.default_rng(0).random(size_mb * (1 << 20) // 4, dtype=np.float32)
        self._sum = parallel_sum
        with self._threads():
            parallel_sum(self.array[:1024])  # compiled (or loaded) before any timing

    def sample(self, repeats: int = 5) -> float:
        """Best-of-``repeats`` read bandwidth in bytes/s."""
        best = float("inf")
        with self._threads():
            for _ in range(repeats):
                t = time.perf_counter()
                self._sum(self.array)
                best = min(best, time.perf_counter() - t)
        return self.array.nbytes / best

    @contextmanager
    def _threads(self) -> Iterator[None]:
        import numba

        previous = numba.get_num_threads()
        numba.set_num_threads(max(1, min(self.threads, numba.config.NUMBA_NUM_THREADS)))
        try:
            yield
        finally:
            numba.set_num_threads(previous)


def cuda_read_bandwidth(size_gb: float = 4.0, repeats: int = 10) -> float:
    """Median read bandwidth in bytes/s of ``x.sum()`` over ``size_gb`` GB of random fp32 on the GPU."""
    import torch

    if not torch.cuda.is_available():
        raise NoCUDAError()

    x = torch.rand(int(size_gb * (1 << 30)) // 4, device="cuda")
    x.sum()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x
    return (int(size_gb * (1 << 30)) // 4 * 4) / float(np.median(times))
