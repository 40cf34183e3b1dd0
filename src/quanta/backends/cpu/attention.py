"""Causal GQA attention over the paged KV pool, with sliding window and score soft-capping (numba and BLAS).

Pool layout per layer: K and V of (n_kv_heads, n_slots, head_dim), float32, f16 (as uint16 bits: numba has no
float16 arrays; converted by the ``vector_rows`` helpers) or int8 codes with a float32 scale per (slot, head)
(``k_scale``/``v_scale``; None otherwise: numba compiles those cases without them); position p of a
sequence sits at slot ``table[p // B] * B + p % B`` (B = block size).

int8 rows are stored rotated by the normalised Walsh-Hadamard matrix H (orthogonal and symmetric, H·H = I), one
scale per 32 values: the rotation spreads a head's few large channels over all of them, so a shared scale loses
far less (exact mode, 2 x 1,024 tokens of real text, teacher-forced top-1 agreement with the float cache: SmolLM2
97.7% with one scale per head and no rotation, 99.3% rotated; Gemma-3's 256-wide heads rotated 97.3% with one
scale per head, 98.0% with one per 64 values, above 98% with one per 32; docs/PERF.md). Scores need no un-rotation
(q·k = qH·kH, so the query is rotated once), and the weighted sum of rotated values is rotated back once per query
and head. The new tokens' K/V are written at their slots first.

Few queries of a sequence (decode): a numba kernel where each (token, head) pair computes its scores into a
per-thread scratch row, a float32 softmax (exp 16 lanes at a time) and the weighted sum of V, reading keys through
the block table: with the default f16 cache a paged block's run of slots at a time for up to four query heads of
one KV head together (``key_runs``: a few keys per step, each key and value loaded and converted once for those
heads, the output held in registers; the next block's keys asked for ahead; its tasks run on the GEMV's worker
threads, ``kernels/paged_decode.py``), a key at a time for the float32 and int8 caches. Many (a prefill chunk): the
same formula with BLAS over each kv head's score matrix, on the sequence's keys (a view when its blocks are
consecutive), a (kv head, query tile) piece per thread at a time. Both are the textbook formula of HF's eager
attention; tests compare them with a naive numpy version. Which heads share a pass depends on the model and the
thread count only, so a token's output does not depend on the other sequences of its batch.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from quanta.backends.cpu.cached_dispatch import renamed
from quanta.backends.cpu.kernels import workers as _workers
from quanta.backends.cpu.kernels.paged_decode import HEADS_PER_PASS, half_passes, half_task
from quanta.backends.cpu.kernels.vector_rows import (
    axpy, exp_shifted, is_half, scaled_axpy, scaled_dot_row, store_row,
)

QUERY_TILE = 128  # prefill queries per score matrix


@numba.njit(nogil=True, cache=True)
def hadamard(x: np.ndarray) -> None:
    """x ← x·H in place (the normalised Walsh-Hadamard transform; len(x) a power of two)."""
    n = x.size
    span = 1
    while span < n:
        for start in range(0, n, 2 * span):
            for i in range(start, start + span):
                a, b = x[i], x[i + span]
                x[i], x[i + span] = a + b, a - b
        span *= 2
    norm = np.float32(1.0 / math.sqrt(n))
    for i in range(n):
        x[i] *= norm


@numba.njit(nogil=True, cache=True)
def _store(x: np.ndarray, cache: np.ndarray, scale: np.ndarray | None, h: int, s: int, row: np.ndarray) -> None:
    """One head's row ``x`` into slot ``s`` of ``cache``: as it is, or rotated (``row``: scratch) as int8 codes
    of ``max|xH| / 127`` steps per group of ``SCALE_GROUP`` values."""
    if scale is None:
        store_row(cache[h, s], x)  # float32, or rounded to f16
    else:
        for d in range(x.size):
            row[d] = x[d]
        hadamard(row)
        g = row.size // scale.shape[2]
        for j in range(scale.shape[2]):
            m = np.float32(0.0)
            for d in range(j * g, (j + 1) * g):
                m = max(m, abs(row[d]))
            step = m / np.float32(127.0)
            scale[h, s, j] = step
            inv = np.float32(1.0) / step if step > 0 else np.float32(0.0)
            for d in range(j * g, (j + 1) * g):
                cache[h, s, d] = np.int8(round(row[d] * inv))


@numba.njit(nogil=True, cache=True)
def write_kv(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray | None,
             v_scale: np.ndarray | None, slots: np.ndarray, row: np.ndarray) -> None:
    """Store the new tokens' K and V (n, n_kv, hd) at their pool slots of the (n_kv, n_slots, hd) caches (``row``:
    hd floats of scratch; no allocation inside the kernel, which would load numba's allocation module)."""
    n, n_kv = k.shape[0], k.shape[1]
    for i in range(n):
        for h in range(n_kv):
            _store(k[i, h], k_cache, k_scale, h, slots[i], row)
            _store(v[i, h], v_cache, v_scale, h, slots[i], row)


@numba.njit(nogil=True, cache=True)
def _next_slot(table: np.ndarray, block_size: int, blk: int, off: int) -> tuple[int, int, int]:
    """The pool slot of the key at offset ``off`` of block ``blk`` (the next block's first once ``off`` reaches the
    block size), and the block and offset of the key after it."""
    if off == block_size:
        blk, off = blk + 1, 0
    return table[blk] * block_size + off, blk, off + 1


@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _attend_keys(qrow: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray | None,
                 v_scale: np.ndarray | None, kh: int, table: np.ndarray, block_size: int, lo: int, p: int,
                 scale: float, softcap: float, s: np.ndarray, o: np.ndarray) -> None:
    """The same, a key at a time: the float32 cache (exact mode) and the int8 one (scales per slot and group)."""
    m = -np.inf
    # slots block by block, without an integer division per key (numba's floor division: 8 sequences x 160
    # keys 143 -> 126-139 us, one sequence x 1,024 keys 118 -> 100 us; SmolLM2's shapes, 2 threads, Zen 2)
    first_block, first_offset = lo // block_size, lo % block_size
    blk, off = first_block, first_offset
    for j in range(lo, p + 1):
        slot, blk, off = _next_slot(table, block_size, blk, off)
        if k_scale is None:
            acc = np.float32(0.0)
            for d in range(qrow.size):
                acc += qrow[d] * k_cache[kh, slot, d]
        else:
            acc = scaled_dot_row(qrow, k_cache[kh, slot], k_scale[kh, slot])
        acc *= np.float32(scale)
        if softcap > 0:
            acc = np.float32(softcap * math.tanh(acc / softcap))
        s[j - lo] = acc
        m = max(m, acc)
    total = exp_shifted(s[:p + 1 - lo], m)
    for d in range(qrow.size):
        o[d] = 0.0
    blk, off = first_block, first_offset
    for j in range(lo, p + 1):
        slot, blk, off = _next_slot(table, block_size, blk, off)
        w = s[j - lo] / total
        if v_scale is None:
            axpy(o, w, v_cache[kh, slot])
        else:
            scaled_axpy(o, w, v_cache[kh, slot], v_scale[kh, slot])


@numba.njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc", "contract"})  # vectorised dot products
def attention_kernel(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray | None,
                     v_scale: np.ndarray | None, rows: np.ndarray, positions: np.ndarray, token_seq: np.ndarray,
                     block_tables: np.ndarray, block_size: int, scale: float, window: int, softcap: float,
                     scratch: np.ndarray, best: np.ndarray, q_rows: np.ndarray, out: np.ndarray,
                     min_tasks: int) -> None:
    """Attention of the tokens ``rows`` of q (n, heads, hd) → their rows of ``out`` (n, heads, hd). ``scratch``
    (threads, ``HEADS_PER_PASS``, >= the longest context), ``best`` (threads, >= ``HEADS_PER_PASS``) and ``q_rows``
    (threads, hd): per-thread score rows, their maxima and rotated query rows (each thread's on cache lines of its
    own: the backend pads them). With the f16 cache a task is a token and up to ``HEADS_PER_PASS`` query heads of
    one KV head, fewer where one token would make under ``min_tasks`` tasks (the threads: Gemma-3's one KV head and
    four query heads go in two passes of two)."""
    n_heads, hd = q.shape[1], q.shape[2]
    group = n_heads // k_cache.shape[0]
    if k_scale is None and is_half(k_cache):  # the default mode's f16 cache: a KV head's query heads together
        passes = half_passes(n_heads, k_cache.shape[0], min_tasks)
        for t in numba.prange(rows.size * k_cache.shape[0] * passes):
            half_task(t, passes, q, k_cache, v_cache, rows, positions, token_seq, block_tables, block_size, scale,
                      window, softcap, scratch[numba.get_thread_id()], best[numba.get_thread_id()], out)
        return
    for t in numba.prange(rows.size * n_heads):
        i, h = rows[t // n_heads], t % n_heads
        kh = h // group
        p = positions[i]
        table = block_tables[token_seq[i]]
        lo = max(0, p - window + 1) if window > 0 else 0
        s = scratch[numba.get_thread_id(), 0]
        o = out[i, h]
        qrow = q[i, h]
        if k_scale is not None:  # the keys are stored rotated
            qrow = q_rows[numba.get_thread_id()]
            qrow[:] = q[i, h]
            hadamard(qrow)
        _attend_keys(qrow, k_cache, v_cache, k_scale, v_scale, kh, table, block_size, lo, p, scale, softcap, s, o)
        if v_scale is not None:
            hadamard(o)  # back from the values' rotation


# the same kernel without an OpenMP region, for a decode batch too small to pay for waking the other threads. It
# still calls numba.get_thread_id(): loaded from the disk cache into a process whose threading layer has not started,
# it crashes (CPUThreads starts it, with numba.set_num_threads, before any forward)
attention_kernel_serial = numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})(
    renamed(attention_kernel.py_func, "attention_kernel_serial"))


def attention_on_workers(threads: Any, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, rows: np.ndarray,
                         positions: np.ndarray, token_seq: np.ndarray, block_tables: np.ndarray, block_size: int,
                         scale: float, window: int, softcap: float, scratch: np.ndarray, best: np.ndarray,
                         out: np.ndarray, min_tasks: int) -> None:
    """``attention_kernel`` of the f16 cache on the GEMV's native worker threads (``threads``: a
    ``qmatmul.CPUThreads``) instead of numba's OpenMP team: the same tasks, whichever thread is free taking the next,
    so a thread kept off its core stalls nobody (an OpenMP region waits for its whole team)."""
    pool = threads.workers
    with threads.gemv_lock:
        window_ended = _workers.attention_f16(threads.token, pool.ctl, pool.job, q, k_cache, v_cache, rows, positions,
                                              token_seq, block_tables, block_size, scale, window, softcap, scratch,
                                              best, out, min_tasks)
    if window_ended and threads.n > 1:
        threads.adapt()


def hadamard_matrix(n: int) -> np.ndarray:
    """The normalised (n, n) Walsh-Hadamard matrix (n a power of two): symmetric, its own inverse."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.float32(np.sqrt(n))).astype(np.float32)


def sequence_slots(table: np.ndarray, block_size: int, n_keys: int) -> np.ndarray | slice:
    """The pool slots of positions 0..n_keys-1 of a sequence: a slice when its blocks are consecutive."""
    n_blocks = -(-n_keys // block_size)
    first = int(table[0])
    if n_blocks == 1 or np.array_equal(table[:n_blocks], np.arange(first, first + n_blocks)):
        return slice(first * block_size, first * block_size + n_keys)
    slots = (table[:n_blocks, None].astype(np.int64) * block_size + np.arange(block_size)).reshape(-1)
    return slots[:n_keys]


def attention_blas(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray | None,
                   v_scale: np.ndarray | None, positions: np.ndarray, keys: np.ndarray | slice, scale: float,
                   window: int, softcap: float, out: np.ndarray, threads: Any = None) -> None:
    """The same attention for many queries of one sequence (a prefill chunk; q, positions and out are that
    sequence's rows): per kv head, scores = Q·Kᵀ and P·V through BLAS sgemm over its keys (``keys``: the pool slots
    of positions 0.. of the sequence), with the causal / sliding-window mask applied to the score matrix; queries
    go ``QUERY_TILE`` at a time, so the scores take O(tile x context) memory, not O(chunk x context). The (kv head,
    tile) pieces are shared out over ``threads`` (a ``qmatmul.CPUThreads``; numpy lets the GIL go in each sgemm
    and ufunc); a piece's arithmetic does not depend on which thread runs it."""
    n, n_heads, hd = q.shape
    n_keys = int(positions.max()) + 1
    lo = max(0, int(positions.min()) - window + 1) if window > 0 else 0  # keys no query of the chunk sees
    if isinstance(keys, slice):
        keys = slice(keys.start + lo, keys.start + n_keys)
    else:
        keys = keys[lo:n_keys]
    pieces = [(h, a) for h in range(k_cache.shape[0]) for a in range(0, n, QUERY_TILE)]
    key_pos, o = np.arange(lo, n_keys, dtype=np.int32), out.reshape(n, n_heads, hd)

    def run(i: int, j: int) -> None:
        for h, a in pieces[i:j]:
            _blas_piece(q, k_cache, v_cache, k_scale, v_scale, positions, keys, key_pos, scale, window, softcap, o, h,
                        a, min(n, a + QUERY_TILE))

    if threads is None:
        run(0, len(pieces))
    else:
        threads.run_parts(run, [(i, i + 1) for i in range(len(pieces))])


def _blas_piece(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray | None,
                v_scale: np.ndarray | None, positions: np.ndarray, keys: np.ndarray | slice, key_pos: np.ndarray,
                scale: float, window: int, softcap: float, o: np.ndarray, h: int, a: int, b: int) -> None:
    """``attention_blas`` of queries a..b-1 and kv head ``h`` (``keys``, ``key_pos``: the slots and positions of the
    keys the chunk sees)."""
    hd, group = q.shape[2], q.shape[1] // k_cache.shape[0]
    pos = positions[a:b]
    seen = int(pos.max()) + 1 - int(key_pos[0])  # causal: the tile's keys end at its last query
    kh, vh = _keys_and_values(k_cache, v_cache, k_scale, v_scale, h, keys, seen)
    allowed = key_pos[None, :seen] <= pos[:, None]
    if window > 0:
        allowed &= key_pos[None, :seen] > pos[:, None] - window
    qh = q[a:b, h * group:(h + 1) * group].reshape((b - a) * group, hd)
    s = qh @ kh.T
    s *= np.float32(scale)
    if softcap > 0:
        np.tanh(s / np.float32(softcap), out=s)
        s *= np.float32(softcap)
    s[np.repeat(~allowed, group, axis=0)] = -np.inf  # rows: (token, head in group)
    s -= s.max(axis=1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=1, keepdims=True)
    o[a:b, h * group:(h + 1) * group] = (s @ vh).reshape(b - a, group, hd)


def _keys_and_values(k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray | None,
                     v_scale: np.ndarray | None, h: int, keys: np.ndarray | slice,
                     seen: int) -> tuple[np.ndarray, np.ndarray]:
    """Kv head ``h``'s first ``seen`` keys and values of ``keys`` as float32 (seen, hd)."""
    keys = slice(keys.start, keys.start + seen) if isinstance(keys, slice) else keys[:seen]
    kh, vh = k_cache[h, keys], v_cache[h, keys]
    if kh.dtype == np.uint16:  # f16 bits
        return kh.view(np.float16).astype(np.float32), vh.view(np.float16).astype(np.float32)
    if k_scale is not None:  # rotated int8 codes: dequantized and rotated back
        hd, groups = kh.shape[1], k_scale.shape[2]
        rot = hadamard_matrix(hd)
        kh = (kh.reshape(-1, groups, hd // groups) * k_scale[h, keys][:, :, None]).reshape(-1, hd).astype(np.float32)
        vh = (vh.reshape(-1, groups, hd // groups) * v_scale[h, keys][:, :, None]).reshape(-1, hd).astype(np.float32)
        return kh @ rot, vh @ rot
    return kh, vh
