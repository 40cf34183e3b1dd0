"""Matrix products with quantized GGUF weights on the CPU: ``qmatmul(x, w) = x @ dequantize(W).T``.

Weights stay in their GGUF bytes (a zero-copy view of the mmap: resident memory = the file's bytes). Decode
(few activation rows) runs numba GEMV kernels that dequantize inside the dot product, parallel over output rows.
Prefill (many rows) is compute-bound. Fast mode (the default, with AVX512-VNNI): activations quantized to q8 per
32 and an integer GEMM, each thread unpacking 16 weight rows at a time into VNNI-ready codes reused by every
activation row (``kernels/gemm_q8.py``). Exact mode (and formats without an int8 path): each thread dequantizes a
tile of weight rows into a reused fp32 scratch (a few MB, never the whole weight) and multiplies it with a
single-threaded OpenBLAS sgemm. See docs/PERF.md (CPU journal) for the measurements behind each choice.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numba
import numpy as np

from quanta.backends.cpu.cached_dispatch import load_without_refresh
from quanta.backends.cpu.kernels import gemm_q8 as _gemm_q8
from quanta.backends.cpu.kernels import openblas
from quanta.backends.cpu.kernels import rows as _rows
from quanta.backends.cpu.kernels import workers as _workers
from quanta.backends.cpu.kernels.gemm_q8_pack import TILE_ROWS, UNIT
from quanta.backends.cpu.kernels.isa import PORTABLE, resolve_isa, token
from quanta.backends.cpu.kernels.q8_rows import ROWS_PER_PASS
from quanta.backends.cpu.kernels.workers import WorkerPool
from quanta.quant.formats import get_format

load_without_refresh(_workers)

FLOAT_TYPES = ("F32", "F16", "BF16")
GEMM_MIN_ROWS = 8  # from this many activation rows on, dequantize tiles + sgemm beats the fp32 GEMV kernels
Q8_GEMM_MIN_ROWS = 10  # fast mode: the int8 GEMM from this many rows on (~10 with AVX-512, ~12 with AVX2)
Q6_K_GEMM_MIN_ROWS = 20  # its GEMM is slower (16-weight units)
TILE_BYTES = 4 << 20  # fp32 scratch per weight tile (fits L2+L3 alongside the activations)
# Types whose fast-mode kernels quantize activations to q8 (integer dots) where the CPU has an int8 path
# (kernels/isa.py); the others stay fp32 in both modes.
Q8_ACTIVATION_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True, eq=False)
class QWeight:
    """A weight ready for ``qmatmul``: ``shape`` is (m, k) = (output features, input features)."""

    name: str
    type: str
    shape: tuple[int, int]
    raw2d: np.ndarray = field(repr=False)  # (m, bytes per row) uint8, read-only, the file's bytes
    fmt: int  # kernel format code (-1 for float types)
    block_size: int
    type_size: int


def prepare_weight(tensor) -> QWeight:
    """Wrap a ``quanta.gguf.TensorInfo`` (1-D tensors become one row); no copy, no repack."""
    fmt = get_format(tensor.type, tensor.name)
    shape = tuple(int(s) for s in tensor.shape)
    m, k = (1, shape[0]) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])
    if k % fmt.block_size:
        raise ValueError(f"tensor {tensor.name}: row length {k} is not a multiple of {fmt.name}'s block size")
    raw2d = tensor.raw.reshape(m, (k // fmt.block_size) * fmt.type_size).view()
    raw2d.flags.writeable = False
    code = -1 if fmt.name in FLOAT_TYPES else _rows.FORMAT_CODES[fmt.name]
    return QWeight(tensor.name, fmt.name, (m, k), raw2d, code, fmt.block_size, fmt.type_size)


# activation rows per thread below which the prefill work stays on one thread; above, one part per thread (four
# per thread, claimed by whichever thread was free, cost 7-13% of a 128-token prefill and gained nothing with a
# core held by another process, at 128 or 512 tokens: docs/PERF.md, session 42)
SPLIT_MIN_ROWS = 64


class CPUThreads:
    """The threads of one CPU backend, and the instruction set of their int8 kernels (``isa``: None picks the
    fastest this CPU has; ``kernels/isa.py``): native GEMV workers (``kernels/workers.py``), the prefill pool.

    Both let whichever thread is running take the next piece of work, so a thread that another process keeps off
    its core slows the call down instead of stalling it. OpenBLAS itself stays single-threaded: its idle workers
    spin for ~100 ms after each call (measured: 40-100 ms of CPU burnt while idle), stealing a core from the
    kernels that follow; the prefill work is split over our pool instead (idle threads block, burn 0 ms).
    """

    def __init__(self, n: int, *, isa: str | None = None):
        self.isa = resolve_isa(isa)  # the int8 kernels' instruction set (None: the fp32 kernels only)
        self.q8_types = Q8_ACTIVATION_TYPES if self.isa else ()
        self.token = token(self.isa or PORTABLE)
        self.n = max(1, int(n))
        self.numba_threads = max(1, min(self.n, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(self.numba_threads)
        openblas.set_threads(1)
        self.workers = WorkerPool(self.n, self.token)
        self.gemv_lock = threading.Lock()  # one GEMV at a time on the workers (a backend used from two threads)
        self.chunks = 8 * self.n  # GEMV row chunks per call: a few per thread
        self.pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="quanta-prefill") if self.n > 1 else None
        self.contended = False

    def adapt(self) -> None:
        """Run the other numba kernels (OpenMP regions: exact mode's and the int8 cache's attention, large norms and
        activations) on the calling thread alone while the GEMV workers get much less than their share of the work,
        i.e. while another process holds their cores.

        An OpenMP region waits for every thread of its team, so under contention each would stall for a time
        slice; the GEMVs need no such switch (their chunks go to whoever runs). Hysteresis: below half of the
        expected share switches to one thread, above 70% back to ``n``.
        """
        share = self.workers.window_share() / ((self.n - 1) / self.n)
        contended = share < (0.7 if self.contended else 0.5)
        if contended != self.contended:
            self.contended = contended
            numba.set_num_threads(1 if contended else self.numba_threads)

    def parts(self, work: int, n: int) -> list[tuple[int, int]]:
        """``work`` items in contiguous parts: one per thread when there are enough activation rows."""
        parts = max(1, min(self.n, n // SPLIT_MIN_ROWS, work))
        return [(work * i // parts, work * (i + 1) // parts) for i in range(parts)]

    def run_parts(self, fn, parts: list[tuple[int, int]]) -> None:
        """``fn(a, b)`` for every part, each taken by the next free thread (the caller is one of them)."""
        if self.pool is None or len(parts) == 1:
            for a, b in parts:
                fn(a, b)
            return
        queue = iter(parts)  # next() on a list iterator is atomic under the GIL

        def drain() -> None:
            for a, b in queue:
                fn(a, b)

        helpers = [self.pool.submit(drain) for _ in range(min(self.n, len(parts)) - 1)]
        drain()
        for h in helpers:
            h.result()

    def close(self) -> None:
        self.workers.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False)


def _float_rows(w: QWeight, start: int, stop: int) -> np.ndarray:
    raw = w.raw2d[start:stop]
    if w.type == "F32":
        return raw.view(np.float32)
    if w.type == "F16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_scratch = threading.local()


def _tile_buffer(rows: int, k: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < rows * k:
        buf = _scratch.buf = np.empty(rows * k, np.float32)
    return buf[: rows * k].reshape(rows, k)


def _q8_block_stats(n: int, k: int) -> tuple[np.ndarray, ...]:
    """Scratch for the per-32 scales, sums and integer sums (n, k/32) of n q8-quantized rows of k."""
    return np.empty((n, k // 32), np.float32), np.empty((n, k // 32), np.float32), np.empty((n, k // 32), np.int32)


def _q8_buffers(n: int, k: int) -> tuple[np.ndarray, ...]:
    """The GEMV's q8 activations (layout in ``kernels/q8_rows.py``: codes, block scales and sums, dot starting
    values), reused per thread and shape (a decode step quantizes ~200 activations: allocating them each time
    costs 2% of decode)."""
    per_thread = getattr(_scratch, "q8", None)
    if per_thread is None:
        per_thread = _scratch.q8 = {}
    buffers = per_thread.get((n, k))
    if buffers is None:
        pairs = -(-k // 64)
        stats = (-(-n // ROWS_PER_PASS), pairs, 2 * ROWS_PER_PASS)
        buffers = per_thread[n, k] = (np.zeros((n, 64 * pairs), np.int8), np.zeros(stats, np.float32),
                                      np.zeros(stats, np.float32), np.zeros((n, pairs, 8), np.int32))
    return buffers


def _gemv_buffers(n: int, k: int, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """The fp32 GEMV's per-32 sums of x and one dequantized row per thread (Q2_K/Q3_K), reused per shape."""
    per_thread = getattr(_scratch, "f32", None)
    if per_thread is None:
        per_thread = _scratch.f32 = {}
    buffers = per_thread.get((n, k, threads))
    if buffers is None:
        buffers = per_thread[n, k, threads] = (np.empty((n, k // 32), np.float32), np.empty((threads, k), np.float32))
    return buffers


def _dequant_tile(w: QWeight, start: int, stop: int) -> np.ndarray:
    out = _tile_buffer(stop - start, w.shape[1])  # per thread
    _rows.dequant_tile(w.fmt, w.raw2d, start, w.block_size, w.type_size, out)
    return out


def _gemm(x: np.ndarray, w: QWeight, out: np.ndarray, threads: CPUThreads) -> None:
    """``out = x @ dequantize(W).T``: each thread takes a range of weight rows, dequantizes them tile by tile
    into its own scratch and runs a single-threaded sgemm on it (the tile stays in that core's cache)."""
    m, k = w.shape
    tile = max(16, TILE_BYTES // (4 * k))

    def rows(start: int, stop: int) -> None:
        for a in range(start, stop, tile):
            b = min(stop, a + tile)
            np.matmul(x, _dequant_tile(w, a, b).T, out=out if b - a == m else out[:, a:b])

    threads.run_parts(rows, threads.parts(m, x.shape[0]))


def _gemm_int8(x: np.ndarray, w: QWeight, out: np.ndarray, threads: CPUThreads) -> None:
    """Fast mode: ``out = x @ dequantize(W).T`` with q8 activations and integer dots in ``threads.isa``
    (``kernels/gemm_q8``); the activation rows are quantized in parallel, then the 16-row weight tiles in parts."""
    (n, k), m, unit = x.shape, w.shape[0], UNIT[w.type]
    n_pad = -(-n // _gemm_q8.TOKENS) * _gemm_q8.TOKENS
    xq = np.zeros((n_pad, k), np.int8)  # rows past n stay zero: padded tokens contribute nothing
    xdu = np.zeros((n_pad, k // unit), np.float32)
    xsu = np.zeros((n_pad, k // unit), np.float32)

    def quantize(a: int, b: int) -> None:
        _gemm_q8.quantize_activations(x[a:b], xq[a:b], unit, xdu[a:b], xsu[a:b], *_q8_block_stats(b - a, k))

    def rows(a: int, b: int) -> None:
        _gemm_q8.gemm_q8_rows(threads.token, w.fmt, unit, w.raw2d, a * TILE_ROWS, min(m, b * TILE_ROWS), xq, xdu,
                              xsu, n, out, *_gemm_q8.gemm_scratch(n_pad, k, unit))

    threads.run_parts(quantize, threads.parts(n, n))
    threads.run_parts(rows, threads.parts(-(-m // TILE_ROWS), n))


def _float_gemm(x: np.ndarray, w: QWeight, out: np.ndarray, threads: CPUThreads) -> None:
    """F32/F16/BF16 weights: one conversion, then the activation rows split over the sgemm threads."""
    wt = _float_rows(w, 0, w.shape[0]).T
    threads.run_parts(lambda a, b: np.matmul(x[a:b], wt, out=out[a:b]), threads.parts(x.shape[0], x.shape[0]))


def _has_int8_gemm(isa: str | None, type_name: str) -> bool:
    """Q8_0's +128 codes would saturate AVX2's i16 pair sums in the GEMM (the GEMV keeps them signed)."""
    return isa is not None and not (isa == "avx2" and type_name == "Q8_0")


def q8_gemm_min_rows(isa: str | None, type_name: str) -> int:
    """Fast mode: the activation rows from which a GEMM beats the multi-row q8 GEMV (1 thread, docs/PERF.md).
    Below it a row's result is bit for bit the same whatever rows are multiplied with it (a decode batch of up to
    8 sequences: its logits do not depend on the batch); the GEMMs sum in another order."""
    if not _has_int8_gemm(isa, type_name):
        return 48  # the fp32 GEMM
    return Q6_K_GEMM_MIN_ROWS if type_name == "Q6_K" else Q8_GEMM_MIN_ROWS


class RowPlan:
    """Which rows of one forward are prefill and which are decode, for fast mode to pick each row's kernel by
    what the row is, not by how many rows its batch has: its result then does not depend on the batch.

    Fast mode's q8 GEMV and GEMM round differently (and each layer's q8 requantization amplifies the difference
    into flipped near-ties). By the batch's row count alone, a decode row beside a prefill chunk went through the
    GEMM, and a 5-token prompt through the GEMM when packed with others but the GEMV alone. With a plan, prefill
    rows always take the GEMM and decode rows (a sequence's one new token, plus its drafts) the GEMV, until they
    are enough for a GEMM of their own (a decode batch of that many sequences then goes to the GEMM)."""

    def __init__(self, chunk_starts: np.ndarray, prefill: np.ndarray):
        """``chunk_starts``: ``AttentionMetadata.query_starts``; ``prefill``: (s,) bool, per sequence's chunk."""
        lens = np.diff(chunk_starts)
        self.n = int(chunk_starts[-1])
        mask = np.repeat(np.asarray(prefill, bool), lens)
        self.n_decode = self.n - int(mask.sum())
        if mask[self.n_decode:].all():  # the scheduler puts decodes first
            self.decode, self.prefill = slice(0, self.n_decode), slice(self.n_decode, self.n)
        else:
            self.decode, self.prefill = np.flatnonzero(~mask), np.flatnonzero(mask)

    def groups(self, gemm_rows: int) -> list[tuple[np.ndarray | slice, bool]]:
        """(rows, whether they take the GEMM) for a weight whose GEMM pays from ``gemm_rows`` rows on."""
        if self.n_decode == self.n:
            return [(slice(0, self.n), self.n >= gemm_rows)]
        if self.n_decode == 0 or self.n_decode >= gemm_rows:
            return [(slice(0, self.n), True)]
        return [(self.decode, False), (self.prefill, True)]


def _is_f32_c(a: np.ndarray) -> bool:
    return a.dtype == np.float32 and a.flags.c_contiguous


def qmatmul(x: np.ndarray, w: QWeight, threads: CPUThreads, *, exact: bool = False,
            out: np.ndarray | None = None, plan: RowPlan | None = None) -> np.ndarray:
    """``x @ dequantize(W).T`` for float32 ``x`` of shape (n, k) on ``threads``; returns (n, m) float32.

    ``exact`` keeps activations and accumulation in fp32 (the oracle mode); the default fast mode may quantize
    activations to 8 bits for integer dot products. ``plan``: which of a forward's rows are prefill and which
    decode (fast mode picks each row's kernel by it; applies when ``x`` has the plan's rows).
    """
    m, k = w.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"qmatmul: x has shape {x.shape}, weight {w.name} expects (n, {k})")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    if out is None:
        out = np.empty((n, m), np.float32)
    elif out.shape != (n, m):
        raise ValueError(f"qmatmul: out has shape {out.shape}, expected {(n, m)}")
    q8 = not exact and w.type in threads.q8_types
    if w.fmt < 0:
        _float_gemm(x, w, out, threads)
    elif q8 and plan is not None and plan.n == n:
        for rows, gemm in plan.groups(q8_gemm_min_rows(threads.isa, w.type)):
            if isinstance(rows, slice):
                _quantized_product(x[rows], w, out[rows], threads, q8, gemm)
            else:
                part = np.empty((len(rows), m), np.float32)
                _quantized_product(x[rows], w, part, threads, q8, gemm)
                out[rows] = part
    else:
        _quantized_product(x, w, out, threads, q8, n >= (q8_gemm_min_rows(threads.isa, w.type) if q8 else
                                                          GEMM_MIN_ROWS))
    return out


def _quantized_product(x: np.ndarray, w: QWeight, out: np.ndarray, threads: CPUThreads, q8: bool,
                       gemm: bool) -> None:
    """``out = x @ dequantize(W).T`` by the GEMM kernels (``gemm``) or the GEMV ones, q8 activations or fp32."""
    n, m, k = x.shape[0], *w.shape
    if gemm:
        if q8 and _is_f32_c(out) and _has_int8_gemm(threads.isa, w.type):
            _gemm_int8(x, w, out, threads)
        else:
            _gemm(x, w, out, threads)
        return
    # the GEMV kernels are compiled for C-contiguous float32 outputs only
    target = out if _is_f32_c(out) else np.empty((n, m), np.float32)
    pool, chunks = threads.workers, min(m, threads.chunks)
    isa = threads.token
    with threads.gemv_lock:
        if q8:
            window = _workers.gemv_q8(isa, pool.ctl, pool.job, w.fmt, w.raw2d, x, target, chunks,
                                      *_q8_buffers(n, k))
        else:
            window = _workers.gemv(isa, pool.ctl, pool.job, w.fmt, w.raw2d, x, target, chunks,
                                   *_gemv_buffers(n, k, threads.n))
    if window and threads.n > 1:
        threads.adapt()
    if target is not out:
        out[...] = target


def qembed(w: QWeight, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of the dequantized table, shape (len(ids), k) float32."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    m, k = w.shape
    if ids.size and (ids.min() < 0 or ids.max() >= m):
        raise IndexError(f"qembed: token id out of range [0, {m}) for {w.name}")
    if w.fmt < 0:
        return np.ascontiguousarray(_float_rows(w, 0, m)[ids], dtype=np.float32)
    out = np.empty((ids.size, k), np.float32)
    _rows.dequant_rows(w.fmt, w.raw2d, ids, w.block_size, w.type_size, out)
    return out
