"""The default mode's decode attention task (f16 KV cache): one token's query heads of one KV head over its paged keys.

A token's query heads that share a KV head (GQA) go in passes of up to ``HEADS_PER_PASS``; a task is a (token, KV
head, pass) triple, run by numba's threads (``attention.attention_kernel``) or by the GEMV's native worker threads
(``workers.attention_f16``). Either way a task's arithmetic is the same, whichever thread runs it and whatever else
is in the batch.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from quanta.backends.cpu.kernels.key_runs import HEADS_PER_PASS, add_weighted_run, prefetch_run, scores_of_run
from quanta.backends.cpu.kernels.vector_rows import exp_shifted

__all__ = ["HEADS_PER_PASS", "attend_runs", "half_passes", "half_task"]


@numba.njit(nogil=True, cache=True)
def half_passes(n_heads: int, n_kv: int, min_tasks: int) -> int:
    """Passes per KV head: its query heads in groups of nearly equal sizes, at most ``HEADS_PER_PASS`` each, more
    where one token would make fewer than ``min_tasks`` tasks (never a function of the batch: a row's arithmetic
    must not be)."""
    group = n_heads // n_kv
    passes = -(-group // HEADS_PER_PASS)
    if n_kv * passes < min_tasks:
        passes = min(group, -(-min_tasks // n_kv))
    return passes


@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def attend_runs(q: np.ndarray, keys: np.ndarray, values: np.ndarray, table: np.ndarray, block_size: int, lo: int,
                p: int, scale: float, softcap: float, s: np.ndarray, best: np.ndarray, o: np.ndarray) -> None:
    """The attention of query heads ``q`` (G, hd) of one KV head (``keys``, ``values``: its (slots, hd) f16 pool
    rows) over positions lo..p into ``o`` (G, hd): a paged block's run of slots at a time (``key_runs``: each key
    and value read once for the G heads); ``s`` (>= G rows of >= p + 1 - lo), ``best``: score and maximum scratch."""
    g_count, n = q.shape[0], p + 1 - lo
    scores = s[:g_count]
    for g in range(g_count):
        best[g] = -np.inf
    j = lo
    while j <= p:  # one run per paged block; the next block's keys and this one's values asked for ahead
        blk = j // block_size
        first, count = table[blk] * block_size + j - blk * block_size, min((blk + 1) * block_size, p + 1) - j
        if j + count <= p:
            after = table[blk + 1] * block_size
            prefetch_run(keys[after:after + min(block_size, p + 1 - j - count)])
        prefetch_run(values[first:first + count])
        scores_of_run(scores, j - lo, q, keys[first:first + count], np.float32(scale), best)
        j += count
    for g in range(g_count):
        row, m = scores[g, :n], best[g]
        if softcap > 0:
            m = -np.inf
            for t in range(n):
                row[t] = np.float32(softcap * math.tanh(row[t] / softcap))
                m = max(m, row[t])
        inv = np.float32(1.0) / exp_shifted(row, m)
        for t in range(n):
            row[t] *= inv
    for g in range(g_count):
        o[g] = 0.0
    j = lo
    while j <= p:
        blk = j // block_size
        first, count = table[blk] * block_size + j - blk * block_size, min((blk + 1) * block_size, p + 1) - j
        add_weighted_run(o, scores, j - lo, values[first:first + count])
        j += count


@numba.njit(nogil=True, cache=True)
def half_task(t: int, passes: int, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, rows: np.ndarray,
              positions: np.ndarray, token_seq: np.ndarray, block_tables: np.ndarray, block_size: int, scale: float,
              window: int, softcap: float, scratch: np.ndarray, best: np.ndarray, out: np.ndarray) -> None:
    """Task ``t`` of the tokens ``rows`` of q (n, heads, hd) into ``out`` (n, heads, hd), ``scratch`` and
    ``best`` being the running thread's (``attention.attention_kernel`` describes the arguments)."""
    n_kv, group = k_cache.shape[0], q.shape[1] // k_cache.shape[0]
    i, kh, part = rows[t // (n_kv * passes)], (t // passes) % n_kv, t % passes
    h0 = kh * group + part * (group // passes) + min(part, group % passes)
    g_count = group // passes + (1 if part < group % passes else 0)
    p = positions[i]
    lo = max(0, p - window + 1) if window > 0 else 0
    attend_runs(q[i, h0:h0 + g_count], k_cache[kh], v_cache[kh], block_tables[token_seq[i]], block_size, lo, p,
                scale, softcap, scratch, best, out[i, h0:h0 + g_count])
