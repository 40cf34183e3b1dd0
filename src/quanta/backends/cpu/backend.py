"""The CPU backend: numpy arrays, quantized matmuls from qmatmul, numba kernels for the other ops.

Intermediates come from named scratch buffers that grow to the largest batch seen, so a warm decode step
allocates no arrays of its own (qmatmul's GEMV writes into ``out``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np

from quanta.backends.base import AttentionMetadata, Backend, KVShape, allowed_tokens
from quanta.backends.cpu import attention as _attention
from quanta.backends.cpu import grouped as _grouped
from quanta.backends.cpu import ops as _ops
from quanta.backends.cpu import qmatmul as _qmatmul
from quanta.backends.cpu.cached_dispatch import load_without_refresh
from quanta.backends.cpu.kernels import gemm_q8 as _gemm_q8
from quanta.backends.cpu.kernels import rows as _rows
from quanta.backends.cpu.kv_cache import CPUKVCache, kv_nbytes
from quanta.gguf import TensorInfo

SERIAL_ATTENTION_MAX_MACS = 1 << 18  # below this much work the decode attention runs on the calling thread alone
# float32s in a 64-byte cache line: the decode attention's per-thread scratch (score maxima, score rows) keeps each
# thread on lines of its own (sharing one, 8 SmolLM2 sequences' attention took 73-75 us a call instead of 60-61)
LINE_FLOATS = 16
BLAS_ATTENTION_MIN_ROWS = 8  # from this many queries on, sgemm over the score matrix beats the numba kernel
MAX_BUFFER_VIEWS = 4096  # scratch views kept (``CPUBackend.buffer``)

load_without_refresh(_attention, _ops, _rows, _gemm_q8)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class CPUBackend(Backend):
    name = "cpu"

    def __init__(self, *, threads: int | None = None, exact: bool = False, isa: str | None = None):
        """``isa``: the int8 kernels' instruction set ("avx2", "avx_vnni", "avx512_vnni"; None = the fastest this
        CPU has, kernels/isa.py)."""
        self.exact = exact
        self.isa = _qmatmul.resolve_isa(isa)
        self.threads = threads or available_cores()
        self.set_threads(self.threads)
        self._buffers: dict[str, np.ndarray] = {}
        self._views: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
        self._scratch = np.zeros((0, 0, 0), np.float32)  # per-thread score rows of the attention kernel
        self._rows = np.zeros(0, np.int32)
        self._plan: _qmatmul.RowPlan | None = None  # prefill and decode rows of the forward metadata() described last

    def set_threads(self, n: int) -> None:
        if getattr(self, "_threads", None) is not None:
            self._threads.close()
        self._threads = _qmatmul.CPUThreads(n, isa=self.isa)  # this backend's GEMV workers and prefill pool

    # ---- loading ---------------------------------------------------------------------------------------------
    def load_weight(self, tensor: TensorInfo) -> _qmatmul.QWeight:
        return _qmatmul.prepare_weight(tensor)

    def load_vector(self, tensor: TensorInfo) -> np.ndarray:
        if tensor.type == "F32":
            return tensor.raw.view(np.float32).reshape(tensor.shape)  # zero-copy view of the mmap
        w = _qmatmul.prepare_weight(tensor)
        return _qmatmul.qembed(w, np.arange(w.shape[0])).reshape(tensor.shape)

    def from_host(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a)

    def to_host(self, a: np.ndarray) -> np.ndarray:
        return np.asarray(a)

    def free_memory(self) -> int | None:
        """The kernel's estimate of memory available without swapping (``MemAvailable``; Linux)."""
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return None

    def rope_table(self, inv_freq: np.ndarray, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
        angles = np.arange(n_ctx, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def kv_cache(self, shape: KVShape, dtype: str = "auto") -> CPUKVCache:
        return CPUKVCache(shape, self._kv_dtype(dtype))

    def kv_nbytes(self, shape: KVShape, dtype: str = "auto") -> int:
        return kv_nbytes(shape, self._kv_dtype(dtype))

    def _kv_dtype(self, dtype: str) -> str:
        """The pool's dtype for ``dtype``, "auto" being f32 in exact mode and f16 otherwise (half the bytes the decode
        attention reads: at a 4,000-token context SmolLM2 decodes 1.37x faster, docs/PERF.md session 51)."""
        return ("f32" if self.exact else "f16") if dtype == "auto" else dtype

    def metadata(self, host: AttentionMetadata) -> CPUAttentionMetadata:
        """``host`` plus which tokens the numba kernel takes and which sequences' chunks go to BLAS. The forward
        it describes picks its matmul kernels by its prefill rows (``qmatmul.RowPlan``)."""
        starts = host.query_starts
        self._plan = _qmatmul.RowPlan(starts, host.prefill) if host.prefill is not None and host.prefill.any() else None
        large = np.flatnonzero(np.diff(starts) >= BLAS_ATTENTION_MIN_ROWS) if host.max_query_len >= \
            BLAS_ATTENTION_MIN_ROWS else ()
        if len(large) == 0:
            rows = self._arange(len(host.positions))
        else:
            small = np.ones(len(host.positions), bool)
            for j in large:
                small[starts[j]:starts[j + 1]] = False
            rows = np.flatnonzero(small).astype(np.int32)
        chunks = tuple((int(starts[j]), int(starts[j + 1]), j) for j in large)
        longest = int(host.positions[rows].max()) + 1 if rows.size else 0
        if self._scratch.shape[2] < longest:  # score rows of a pass's heads, whole cache lines each
            width = -(-max(longest, 2 * self._scratch.shape[2]) // LINE_FLOATS) * LINE_FLOATS
            threads = max(numba.config.NUMBA_NUM_THREADS, self.threads)  # numba's, or the GEMV workers' (tid < threads)
            self._scratch = np.zeros((threads, _attention.HEADS_PER_PASS, width), np.float32)
        return CPUAttentionMetadata(host.positions, host.slots, host.token_seq, host.block_tables, host.seq_lens,
                                    starts, host.n_seqs, host.max_query_len, host.block_size, host.prefill,
                                    kernel_rows=rows, blas_chunks=chunks, kernel_context=longest)

    def _arange(self, n: int) -> np.ndarray:
        if self._rows.size < n:
            self._rows = np.arange(max(n, 2 * self._rows.size), dtype=np.int32)
        return self._rows[:n]

    def buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The scratch array ``name`` viewed as ``shape``; the view is kept, so that a decode step's ~10 requests a
        layer cost one dict lookup each (SmolLM2: ~300 a step)."""
        view = self._views.get((name, shape))
        if view is not None:
            return view
        size = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.size < size:
            buf = self._buffers[name] = np.empty(size, np.float32)
            self._views = {key: v for key, v in self._views.items() if key[0] != name}  # views of the old array
        if len(self._views) >= MAX_BUFFER_VIEWS:  # prompts of ever new lengths
            self._views.clear()
        view = self._views[name, shape] = buf[:size].reshape(shape)
        return view

    # ---- ops -------------------------------------------------------------------------------------------------
    def matmul(self, x: np.ndarray, w: _qmatmul.QWeight, *, out: np.ndarray | None = None,
               residual: np.ndarray | None = None, bias: np.ndarray | None = None) -> np.ndarray:
        if residual is None:
            y = _qmatmul.qmatmul(x, w, self._threads, exact=self.exact, out=out, plan=self._plan)
        else:  # the product goes to scratch first: out may be the residual itself
            scratch = self.buffer("_matmul_residual", (x.shape[0], w.shape[0]))
            y = _qmatmul.qmatmul(x, w, self._threads, exact=self.exact, out=scratch, plan=self._plan)
        if bias is not None:
            _ops.add_rows(y, bias)
        if residual is None:
            return y
        if out is None:
            out = np.empty_like(y)
        if out is not residual:
            out[...] = residual
        _ops.add_rows(out, y)  # same rounding as the separate add: (x @ W.T + bias) + residual
        return out

    def fuse(self, weights: list[_qmatmul.QWeight], biases: list[np.ndarray | None]) -> _grouped.QWeightGroup | None:
        """Weights of one input as one GEMV job (``grouped.py``: no copy; fast mode's q8 GEMV only)."""
        return _grouped.group(weights, biases, self._threads, self.exact)

    def matmul_split(self, x: np.ndarray, w: _grouped.QWeightGroup, outs: list[np.ndarray]) -> list[np.ndarray]:
        return _grouped.matmul_group(x, w, self._threads, outs, plan=self._plan)

    def embed(self, w: _qmatmul.QWeight, token_ids: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        rows = _qmatmul.qembed(w, token_ids)
        if out is None:
            return rows
        out[...] = rows
        return out

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float, *, out: np.ndarray | None = None,
                 residual: np.ndarray | None = None) -> np.ndarray:
        if residual is not None:
            self.add(x, residual)
        if out is None:
            out = np.empty_like(x)
        d = x.shape[-1]
        _ops.rms_norm_rows(x.reshape(-1, d), weight, np.float32(eps), out.reshape(-1, d), self.exact)
        return out

    def rope(self, x: np.ndarray, positions: np.ndarray, table: Any, *, neox: bool) -> np.ndarray:
        cos, sin = table
        _ops.rope_rows(x, positions, cos, sin, neox)
        return x

    def attention(self, q: np.ndarray, k: np.ndarray | None, v: np.ndarray | None, cache: Any,
                  meta: CPUAttentionMetadata, *, scale: float, window: int = 0, softcap: float = 0.0,
                  out: np.ndarray | None = None) -> np.ndarray:
        n, n_heads, hd = q.shape
        if out is None:
            out = np.empty((n, n_heads * hd), np.float32)
        k_cache, v_cache, k_scale, v_scale = cache
        if k is not None:
            _attention.write_kv(k, v, k_cache, v_cache, k_scale, v_scale, meta.slots, self.buffer("_kv_row", (hd,)))
        b = meta.block_size
        for start, stop, j in meta.blas_chunks:
            keys = _attention.sequence_slots(meta.block_tables[j], b, int(meta.seq_lens[j]))
            _attention.attention_blas(q[start:stop], k_cache, v_cache, k_scale, v_scale, meta.positions[start:stop],
                                      keys, float(scale), int(window), float(softcap), out[start:stop], self._threads)
        if meta.kernel_rows.size:
            small = meta.kernel_rows.size * n_heads * meta.kernel_context * hd < SERIAL_ATTENTION_MAX_MACS
            heads_view = out.reshape(n, n_heads, hd)
            assert np.may_share_memory(heads_view, out), "the kernels write out through a view, never a copy"
            best = self.buffer("_best", (self._scratch.shape[0], LINE_FLOATS))
            if not small and self.threads > 1 and k_cache.dtype == np.uint16 and q.flags.c_contiguous and \
                    heads_view.flags.c_contiguous:
                _attention.attention_on_workers(self._threads, q, k_cache, v_cache, meta.kernel_rows, meta.positions,
                                                meta.token_seq, meta.block_tables, b, float(scale), int(window),
                                                float(softcap), self._scratch, best, heads_view, self.threads)
            else:
                kernel = _attention.attention_kernel_serial if small else _attention.attention_kernel
                kernel(q, k_cache, v_cache, k_scale, v_scale, meta.kernel_rows, meta.positions, meta.token_seq,
                       meta.block_tables, b, float(scale), int(window), float(softcap), self._scratch, best,
                       self.buffer("_q_rows", (self._scratch.shape[0], hd)), heads_view, self.threads)
        return out

    def silu_mul(self, gate: np.ndarray, up: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        return self._gated(gate, up, out, gelu=False)

    def gelu_mul(self, gate: np.ndarray, up: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        return self._gated(gate, up, out, gelu=True)

    def _gated(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray | None, gelu: bool) -> np.ndarray:
        """Exact mode: libm's exp per element; fast mode: 16 lanes at a time (2 ulp; ops.gated_mul_rows)."""
        if out is None:
            out = np.empty_like(gate)
        if self.exact:
            (_ops.gelu_mul_flat if gelu else _ops.silu_mul_flat)(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
        else:
            d = gate.shape[-1]
            _ops.gated_mul_rows(gate.reshape(-1, d), up.reshape(-1, d), out.reshape(-1, d), gelu)
        return out

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        rows = a.reshape(-1, a.shape[-1])
        if b.ndim > 1 and b.shape != rows.shape:
            b = b.reshape(rows.shape)  # raises when the sizes differ
        _ops.add_rows(rows, b)
        return a

    def scale(self, x: np.ndarray, s: float) -> np.ndarray:
        x *= np.float32(s)
        return x

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        np.tanh(x / np.float32(cap), out=x)
        x *= np.float32(cap)
        return x

    def gather_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    def argmax_rows(self, logits: np.ndarray, masks: np.ndarray | None = None) -> np.ndarray:
        if masks is not None:  # each row's argmax over its allowed tokens (3x faster than masking the whole row)
            ids = np.full(len(logits), -1, np.int32)
            for r, allowed in enumerate(allowed_tokens(masks, logits.shape[1])):
                tokens = np.flatnonzero(allowed)
                if tokens.size:
                    best = int(logits[r, tokens].argmax())
                    if np.isfinite(logits[r, tokens[best]]):
                        ids[r] = tokens[best]
            return ids
        ids = logits.argmax(axis=1).astype(np.int32)
        best = logits[np.arange(len(ids)), ids]
        ids[~np.isfinite(best)] = -1  # NaN propagates into the argmax: the row's best is then NaN
        return ids


@dataclass(frozen=True)
class CPUAttentionMetadata(AttentionMetadata):
    """The batch's placement plus its split between the attention kernel (``kernel_rows``: tokens of sequences with
    few queries; ``kernel_context``: the longest context among them) and BLAS (``blas_chunks``: (first token, end,
    sequence) of each many-query chunk)."""

    kernel_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    blas_chunks: tuple[tuple[int, int, int], ...] = ()
    kernel_context: int = 0
