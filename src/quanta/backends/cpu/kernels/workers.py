"""Native worker threads for the GEMV (and the default mode's decode attention): row chunks (attention tasks)
claimed one at a time, so a descheduled thread stalls nobody.

Why not numba's ``prange``: an OpenMP region ends at a barrier that every thread of the team must reach, so when
another process holds a core, each of the ~250 regions of a decode step waits for the thread that shares that
core to be scheduled (issue 32: 0.4 tok/s with two threads against 28 with one). Here the caller publishes a job
and works on it too. The chunks are dealt out in contiguous ranges, one per thread: each thread claims the chunks
of its own range first (``compare_exchange`` on a word of its own holding the job's sequence number and the next
chunk), then whatever is left of the others' ranges, so the caller waits only for chunks already started. While
nobody is late each thread streams its own rows and touches only its own cache lines, as ``prange``'s static split
does; with one shared claim word (before 2026-12-02) every chunk bounced that line and the done counter between
the cores, and two threads were no faster than one (docs/PERF.md, session 40). An idle worker spins for
``SPIN_CYCLES`` (a decode step's GEMVs come every few microseconds), yielding its core to any other runnable
thread at every poll, then sleeps on a futex until the next job.

Protocol (``ctl``, int64 words; only the caller writes the descriptor ``job``): the caller writes ``job``, sets
each thread t's DONE[t] = 0 and NEXT[t] = seq << CLAIM_BITS | the first chunk of t's range, then SEQ = seq, and
wakes sleepers. A thread that sees a new SEQ claims chunks while a NEXT word's upper bits still equal that seq:
``job`` cannot change while a claimed chunk is unfinished, so a successful claim also means the descriptor it
reads is that job's. The caller returns once the DONE words add up to the chunk count.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
from numba import njit

from quanta.backends.cpu.kernels.activations import gemv_activations, superblock_activations
from quanta.backends.cpu.kernels.atomics import (
    atomic_add, atomic_load, atomic_store, compare_exchange, cycles, f32_array_1d, f32_array_2d, f32_array_3d,
    f64_array_1d, futex_wait, futex_wake, i8_array_2d, i32_array_1d, i32_array_2d, i32_array_3d, spin_pause,
    u8_array_2d, u16_array_3d, yield_cpu,
)  # fmt: skip
from quanta.backends.cpu.kernels.paged_decode import HEADS_PER_PASS, half_passes, half_task
from quanta.backends.cpu.kernels.q8_rows import ROWS_PER_PASS
from quanta.backends.cpu.kernels.rows import SUPERBLOCK_FORMATS, dot_offset, rows_dot, rows_dot_q8

SEQ, SLEEPERS, QUIT, CALLER_CHUNKS, ALL_CHUNKS, JOBS = (8 * i for i in range(6))
LINE = 16  # words from one thread's NEXT and DONE to the next thread's: each word on a cache line of its own
NEXT, DONE = 64, 72  # thread t's at + LINE * t: the next chunk of its range (seq in the upper bits), chunks it did
WINDOW = 128  # jobs between two looks at how the work was shared (a decode step has ~100-250)
CLAIM_BITS = 20  # chunks per job < 2**20
SPIN_CYCLES = 300_000  # an idle worker polls ~100 us (TSC at 2-4 GHz) before it sleeps
GEMV_Q8, GEMV_F32, ATTEND_F16 = 1, 2, 3
# job descriptor: kind, chunks, the activations (rows, k, then the addresses of x or its q8 codes, scales, sums,
# dot starting values; the q8 statistics' groups of rows), Q2_K/Q3_K scratch, threads, and the weights of one
# input (parts: a Q/K/V or gate/up group shares its activations), each at PART + PART_WORDS * p: format code,
# address, rows, bytes per row, output address, first chunk (a part's chunks run to the next part's first)
KIND, CHUNKS, N, K, X, XD, XSUM, XSTART, GROUPS, BUF, THREADS, PARTS = range(12)
PART, PART_WORDS, MAX_PARTS = 12, 6, 3
FMT, W, M, ROW_BYTES, OUT, FIRST = range(6)
# an attention job (f16 cache, ``attention_f16``) from word PART on: the addresses and sizes of its arrays (q and out
# (n, heads, hd), the K and V pools (kv heads, slots, hd), the rows, positions and sequences of the tokens, the
# block tables, the per-thread scratch and maxima), the block size, window, passes, and two float64 words
(A_Q, A_OUT, A_N, A_HEADS, A_HD, A_K, A_V, A_KV_HEADS, A_SLOTS, A_ROWS, A_N_ROWS, A_POSITIONS, A_TOKEN_SEQ, A_TABLES,
 A_SEQS, A_TABLE_WIDTH, A_SCRATCH, A_SCRATCH_WIDTH, A_BEST, A_BEST_WIDTH, A_BLOCK_SIZE, A_WINDOW, A_PASSES, A_SCALE,
 A_SOFTCAP) = range(PART, PART + 25)
JOB_WORDS = max(PART + PART_WORDS * MAX_PARTS, A_SOFTCAP + 1)


@njit(nogil=True)
def _attend_chunk(job, t, tid):
    """Task ``t`` of an attention job (``paged_decode.half_task``) on thread ``tid``'s scratch."""
    n, heads, hd = job[A_N], job[A_HEADS], job[A_HD]
    pools = (job[A_KV_HEADS], job[A_SLOTS], hd)
    width, best_width = job[A_SCRATCH_WIDTH], job[A_BEST_WIDTH]
    scratch = f32_array_2d(job[A_SCRATCH] + 4 * tid * HEADS_PER_PASS * width, (HEADS_PER_PASS, width))
    best = f32_array_1d(job[A_BEST] + 4 * tid * best_width, best_width)
    tables = i32_array_2d(job[A_TABLES], (job[A_SEQS], job[A_TABLE_WIDTH]))
    floats = f64_array_1d(job.ctypes.data, JOB_WORDS)  # (job.view would import numba's arrayobj at start)
    q, out = f32_array_3d(job[A_Q], (n, heads, hd)), f32_array_3d(job[A_OUT], (n, heads, hd))
    half_task(t, job[A_PASSES], q, u16_array_3d(job[A_K], pools), u16_array_3d(job[A_V], pools),
              i32_array_1d(job[A_ROWS], job[A_N_ROWS]), i32_array_1d(job[A_POSITIONS], n),
              i32_array_1d(job[A_TOKEN_SEQ], n), tables, job[A_BLOCK_SIZE], floats[A_SCALE], job[A_WINDOW],
              floats[A_SOFTCAP], scratch, best, out)


@njit(nogil=True)
def _run_chunk(job, c, tid, isa, gemv, attend):
    """Chunk ``c`` of the job. ``gemv``, ``attend``: None where the caller's jobs are never of that kind (numba then
    leaves that kind's code out of the caller's compilation), True otherwise (the workers: every kind)."""
    if attend is None:
        _gemv_chunk(job, c, tid, isa)
    elif gemv is None or job[KIND] == ATTEND_F16:
        _attend_chunk(job, c, tid)
    else:
        _gemv_chunk(job, c, tid, isa)


@njit(nogil=True)
def _gemv_chunk(job, c, tid, isa):
    """Chunk ``c`` of a GEMV job: of the part it falls in, its share of the part's rows, every activation row."""
    p = 0
    while p + 1 < job[PARTS] and c >= job[PART + PART_WORDS * (p + 1) + FIRST]:
        p += 1
    w = PART + PART_WORDS * p
    end = job[CHUNKS] if p + 1 == job[PARTS] else job[w + PART_WORDS + FIRST]
    chunks, c = end - job[w + FIRST], c - job[w + FIRST]
    m, n, k, fmt = job[w + M], job[N], job[K], job[w + FMT]
    r0, r1 = c * m // chunks, (c + 1) * m // chunks
    raw2d = u8_array_2d(job[w + W], (m, job[w + ROW_BYTES]))
    out = f32_array_2d(job[w + OUT], (n, m))
    if job[KIND] == GEMV_Q8:  # k: the length of a row of codes, 64 per pair of blocks (q8_rows.py)
        xq = i8_array_2d(job[X], (n, k))
        xd = f32_array_3d(job[XD], (job[GROUPS], k // 64, 2 * ROWS_PER_PASS))
        xsum = f32_array_3d(job[XSUM], (job[GROUPS], k // 64, 2 * ROWS_PER_PASS))
        xstart = i32_array_3d(job[XSTART], (n, k // 64, 8))
        rows_dot_q8(isa, fmt, raw2d, r0, r1, xq, xd, xsum, xstart, out)
    else:
        xsum = f32_array_2d(job[XSUM], (n, k // 32))
        x = f32_array_2d(job[X], (n, k))
        buf = f32_array_1d(job[BUF] + 4 * k * tid, k)
        for t in range(n):
            rows_dot(fmt, raw2d, r0, r1, x[t], xsum[t], out[t], buf)


@njit(nogil=True)
def _claim_and_run(ctl, job, tid, seq, isa, gemv, attend):
    """Run chunks of job ``seq`` until none is left, those of this thread's own range first (a contiguous run of
    rows, claimed on a word only this thread touches while nobody is late), then what is left of the others'.
    ``gemv``, ``attend``: the kinds of job to compile for (``_run_chunk``). Returns how many this thread ran."""
    ran = 0
    nth = job[THREADS]
    for k in range(nth):
        r = (tid + k) % nth
        end = (r + 1) * job[CHUNKS] // nth
        word = NEXT + LINE * r
        while True:
            cur = atomic_load(ctl, word)
            c = cur & ((1 << CLAIM_BITS) - 1)
            if cur >> CLAIM_BITS != seq:
                return ran  # the job is over
            if c >= end:
                break
            if compare_exchange(ctl, word, cur, cur + 1):
                _run_chunk(job, c, tid, isa, gemv, attend)
                atomic_add(ctl, DONE + LINE * tid, 1)
                ran += 1
    return ran


@njit(nogil=True)
def _run_job(ctl, job, isa, gemv, attend):
    """Publish the descriptor in ``job``, work on it, wait for the chunks other threads started. Returns True
    every ``WINDOW`` jobs, when the caller may look at how the chunks were shared (``WorkerPool.window_share``)."""
    seq = ctl[SEQ] + 1
    nth, chunks = job[THREADS], job[CHUNKS]
    for r in range(nth):  # every chunk of the last job is done: nobody adds to these any more
        atomic_store(ctl, DONE + LINE * r, 0)
        atomic_store(ctl, NEXT + LINE * r, (seq << CLAIM_BITS) | (r * chunks // nth))
    atomic_store(ctl, SEQ, seq)
    if atomic_load(ctl, SLEEPERS) > 0:
        futex_wake(ctl, SEQ)
    ran = _claim_and_run(ctl, job, 0, seq, isa, gemv, attend)
    spins = 0
    while True:  # a started chunk's thread may share our core: let it run
        done = 0
        for r in range(nth):
            done += atomic_load(ctl, DONE + LINE * r)
        if done >= chunks:
            break
        spins += 1
        if spins % 64 == 0:
            yield_cpu()
        else:
            spin_pause()
    ctl[CALLER_CHUNKS] += ran
    ctl[ALL_CHUNKS] += chunks
    ctl[JOBS] += 1
    return ctl[JOBS] % WINDOW == 0


@njit(nogil=True, cache=True)
def worker_loop(ctl, job, tid, spin_cycles, isa):
    """A worker thread's life: run the chunks of each new job; sleep after ``spin_cycles`` without one. ``isa``
    (a token of ``isa.py``) selects the int8 kernels, as for the caller's ``gemv_q8``."""
    seen = 0  # SEQ's value when the pool was made: a job published before this thread first ran is still new
    idle_since = cycles()
    while atomic_load(ctl, QUIT) == 0:
        seq = atomic_load(ctl, SEQ)
        if seq != seen:
            seen = seq
            _claim_and_run(ctl, job, tid, seq, isa, True, True)
            idle_since = cycles()
        elif cycles() - idle_since < spin_cycles:  # poll, but give the core to any thread that wants it (ours
            yield_cpu()  # or another process's): a spinning worker must never slow the caller down
        else:
            atomic_add(ctl, SLEEPERS, 1)
            if atomic_load(ctl, SEQ) == seen and atomic_load(ctl, QUIT) == 0:
                futex_wait(ctl, SEQ, seen)
            atomic_add(ctl, SLEEPERS, -1)
            idle_since = cycles()


@njit(nogil=True)
def _describe(job, kind, chunks, x, xd, xsum, xstart, groups, buf, parts):
    n, k = x.shape
    job[KIND], job[CHUNKS], job[N], job[K], job[X], job[PARTS] = kind, chunks, n, k, x.ctypes.data, parts
    job[XD], job[XSUM], job[XSTART], job[GROUPS] = xd.ctypes.data, xsum.ctypes.data, xstart.ctypes.data, groups
    job[BUF] = buf.ctypes.data


@njit(nogil=True)
def _describe_part(job, p, fmt, raw2d, out, first):
    w = PART + PART_WORDS * p
    job[w + FMT], job[w + W], job[w + M], job[w + ROW_BYTES] = fmt, raw2d.ctypes.data, raw2d.shape[0], raw2d.shape[1]
    job[w + OUT], job[w + FIRST] = out.ctypes.data, first


@njit(nogil=True)
def _q8_activations(isa, fmt, x, xq, xd, xsum, xstart):
    if fmt in SUPERBLOCK_FORMATS:
        superblock_activations(x, xq, xd, xsum, xstart)
    else:
        gemv_activations(x, xq, xd, xsum, xstart, dot_offset(isa, fmt))


@njit(nogil=True, cache=True)
def gemv_q8(isa, ctl, job, fmt, raw2d, x, out, chunks, xq, xd, xsum, xstart):
    """Fast-mode GEMV ``out = q8(x) @ W.T``: activations quantized on the caller into its scratch (layout in
    ``q8_rows.py``), then the row chunks shared with the workers. All arrays C-contiguous; the kernel allocates
    nothing. Returns ``_run_job``'s flag."""
    _q8_activations(isa, fmt, x, xq, xd, xsum, xstart)
    _describe(job, GEMV_Q8, chunks, xq, xd, xsum, xstart, xd.shape[0], xstart, 1)
    _describe_part(job, 0, fmt, raw2d, out, 0)
    return _run_job(ctl, job, isa, True, None)


@njit(nogil=True, cache=True)
def gemv_q8_group(isa, ctl, job, fmts, raws, x, outs, chunks, xq, xd, xsum, xstart):
    """``gemv_q8`` of 2 or 3 weights of the same input (``fmts``, ``raws``, ``outs``: tuples; formats whose q8
    activations are the same: ``grouped.activation_kind``): x quantized once, one job whose chunks are shared out over the
    weights by their bytes. Returns ``_run_job``'s flag."""
    _q8_activations(isa, fmts[0], x, xq, xd, xsum, xstart)
    parts = len(raws)
    total = 0
    for raw in raws:
        total += raw.size
    chunks = max(chunks, parts)
    first, seen = 0, 0
    for p in range(parts):
        _describe_part(job, p, fmts[p], raws[p], outs[p], first)
        seen += raws[p].size
        first = max(first + 1, min(chunks - (parts - 1 - p), (chunks * seen + total // 2) // total))
    _describe(job, GEMV_Q8, chunks, xq, xd, xsum, xstart, xd.shape[0], xstart, parts)
    return _run_job(ctl, job, isa, True, None)


@njit(nogil=True, cache=True)
def gemv(isa, ctl, job, fmt, raw2d, x, out, chunks, xsum, buf):
    """fp32 GEMV ``out = x @ dequantize(W).T``; ``xsum`` (n, k/32) and ``buf`` (threads, k) are scratch."""
    n, k = x.shape
    for t in range(n):
        for i in range(k // 32):
            s = np.float32(0.0)
            for j in range(32 * i, 32 * i + 32):
                s += x[t, j]
            xsum[t, i] = s
    _describe(job, GEMV_F32, chunks, x, xsum, xsum, xsum, 0, buf, 1)
    _describe_part(job, 0, fmt, raw2d, out, 0)
    return _run_job(ctl, job, isa, True, None)


@njit(nogil=True, cache=True)
def attention_f16(isa, ctl, job, q, k_cache, v_cache, rows, positions, token_seq, block_tables, block_size, scale,
                  window, softcap, scratch, best, out, min_tasks):
    """``attention.attention_kernel``'s f16 tasks (``paged_decode.half_task``) shared with the workers: q and out
    C-contiguous (n, heads, hd) float32, the pools (kv heads, slots, hd) uint16, the index arrays int32, ``scratch``
    (>= threads, ``HEADS_PER_PASS``, w) and ``best`` (>= threads, w') float32, ``min_tasks`` as ``attention_kernel``'s.
    Returns ``_run_job``'s flag."""
    n, heads, hd = q.shape
    passes = half_passes(heads, k_cache.shape[0], min_tasks)
    job[KIND], job[CHUNKS] = ATTEND_F16, rows.size * k_cache.shape[0] * passes
    job[A_Q], job[A_OUT], job[A_N], job[A_HEADS], job[A_HD] = q.ctypes.data, out.ctypes.data, n, heads, hd
    job[A_K], job[A_V], job[A_KV_HEADS], job[A_SLOTS] = (k_cache.ctypes.data, v_cache.ctypes.data, k_cache.shape[0],
                                                          k_cache.shape[1])
    job[A_ROWS], job[A_N_ROWS], job[A_POSITIONS], job[A_TOKEN_SEQ] = (rows.ctypes.data, rows.size,
                                                                      positions.ctypes.data, token_seq.ctypes.data)
    job[A_TABLES], job[A_SEQS], job[A_TABLE_WIDTH] = (block_tables.ctypes.data, block_tables.shape[0],
                                                      block_tables.shape[1])
    job[A_SCRATCH], job[A_SCRATCH_WIDTH], job[A_BEST], job[A_BEST_WIDTH] = (scratch.ctypes.data, scratch.shape[2],
                                                                            best.ctypes.data, best.shape[1])
    job[A_BLOCK_SIZE], job[A_WINDOW], job[A_PASSES] = block_size, window, passes
    floats = f64_array_1d(job.ctypes.data, JOB_WORDS)
    floats[A_SCALE], floats[A_SOFTCAP] = scale, softcap
    return _run_job(ctl, job, isa, None, True)


@njit(nogil=True, cache=True)
def _wake_to_quit(ctl):
    atomic_store(ctl, QUIT, 1)
    atomic_add(ctl, SEQ, 1)
    futex_wake(ctl, SEQ)


def _stop(ctl: np.ndarray, threads: list[threading.Thread]) -> None:
    _wake_to_quit(ctl)
    for t in threads:
        t.join(timeout=1.0)


class WorkerPool:
    """``threads - 1`` native worker threads that share the caller's GEMVs (``gemv``, ``gemv_q8``) and decode
    attention (``attention_f16``), whose int8 kernels are those of ``isa`` (a token of ``isa.py``, the one the caller
    passes too)."""

    def __init__(self, threads: int, isa: np.integer):
        self.threads = threads
        self.isa = isa
        self.ctl = np.zeros(NEXT + LINE * threads, np.int64)
        self.job = np.zeros(JOB_WORDS, np.int64)
        self.job[THREADS] = threads
        self._workers = [threading.Thread(target=worker_loop, args=(self.ctl, self.job, tid, SPIN_CYCLES, isa), daemon=True,
                                          name=f"quanta-cpu-{tid}") for tid in range(1, threads)]
        for t in self._workers:
            t.start()
        self._stop = weakref.finalize(self, _stop, self.ctl, self._workers)
        self._last = (0, 0)

    def window_share(self) -> float:
        """Fraction of the GEMV chunks since the last call that the workers ran (0.0 with none)."""
        mine, total = int(self.ctl[CALLER_CHUNKS]), int(self.ctl[ALL_CHUNKS])
        d_mine, d_total = mine - self._last[0], total - self._last[1]
        self._last = (mine, total)
        return 1.0 - d_mine / d_total if d_total else 0.0

    def close(self) -> None:
        self._stop()
