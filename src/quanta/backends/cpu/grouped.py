"""Weights of one input (a layer's Q/K/V, its gate and up) multiplied by one GEMV job (``CPUBackend.fuse``,
``matmul_split``): the activations quantized once, one job's row chunks shared out over all the weights' rows.

A decode step of SmolLM2 makes ~210 GEMV calls, most of a few tens of KB, whose fixed cost (the Python call, the
kernel's dispatch, publishing the job to the workers and waiting for the last chunk) is as large as their reading
(docs/PERF.md, session 46); a group turns a layer's seven calls into four. No weight is copied: the group holds
the weights' own mapped bytes. Only the fast mode's q8 GEMV runs groups (the weights' q8 activations must be the
same: ``activation_kind``); prefill rows and exact mode multiply each weight on its own (``qmatmul``). A row's
result is bit for bit the one its weight's own GEMV gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from quanta.backends.cpu import ops as _ops
from quanta.backends.cpu.kernels import workers as _workers
from quanta.backends.cpu.kernels.legacy_dot_q8 import code_offset
from quanta.backends.cpu.kernels.rows import SUPERBLOCK_FORMATS
from quanta.backends.cpu.qmatmul import CPUThreads, QWeight, RowPlan, _q8_buffers, q8_gemm_min_rows, qmatmul


@dataclass(frozen=True, eq=False)
class QWeightGroup:
    """Weights of the same input features, multiplied together; ``biases`` added after (None: none). ``gemm_rows``:
    the activation rows from which its weights take a GEMM (the fewest of theirs)."""

    parts: tuple[QWeight, ...]
    biases: tuple[np.ndarray | None, ...]
    gemm_rows: int
    fmts: tuple[int, ...] = field(repr=False)  # the GEMV's arguments: the parts' format codes and bytes
    raws: tuple[np.ndarray, ...] = field(repr=False)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(w.shape[0] for w in self.parts)

    @property
    def type(self) -> str:
        """The parts' quant types ("Q4_K+Q6_K"), as profiles label matmuls."""
        return "+".join(dict.fromkeys(w.type for w in self.parts))


def activation_kind(isa: str, w: QWeight) -> tuple:
    """What the q8 GEMV makes of the activations for ``w``: the K-quants' one scale per 256, or the legacy
    formats' per-32 blocks with the code offset their dots take off."""
    return ("q8_K",) if w.fmt in SUPERBLOCK_FORMATS else ("q8", code_offset(isa, w.type))


def group(weights: list[QWeight], biases: list[np.ndarray | None], threads: CPUThreads,
          exact: bool) -> QWeightGroup | None:
    """A group of ``weights`` (2 or 3 of the same row length, each with the fast mode's q8 GEMV and the same
    activations), or None: each is then multiplied on its own."""
    if exact or not 2 <= len(weights) <= _workers.MAX_PARTS:
        return None
    if any(w.type not in threads.q8_types or w.shape[1] != weights[0].shape[1] for w in weights):
        return None
    if len({activation_kind(threads.isa, w) for w in weights}) > 1:
        return None
    return QWeightGroup(tuple(weights), tuple(biases), min(q8_gemm_min_rows(threads.isa, w.type) for w in weights),
                        tuple(w.fmt for w in weights), tuple(w.raw2d for w in weights))


def matmul_group(x: np.ndarray, g: QWeightGroup, threads: CPUThreads, outs: list[np.ndarray], *,
                 plan: RowPlan | None = None) -> list[np.ndarray]:
    """``outs[i] = x @ dequantize(parts[i]).T (+ biases[i])``; one job where every row takes the GEMV."""
    n = x.shape[0]
    gemv = n < g.gemm_rows and (plan is None or plan.n != n or plan.n_decode == n)
    if not gemv or not all(o.dtype == np.float32 and o.flags.c_contiguous for o in outs):
        for w, out in zip(g.parts, outs):
            qmatmul(x, w, threads, out=out, plan=plan)
    else:
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        pool = threads.workers
        with threads.gemv_lock:
            window = _workers.gemv_q8_group(threads.token, pool.ctl, pool.job, g.fmts, g.raws, x, tuple(outs),
                                            threads.chunks, *_q8_buffers(n, x.shape[1]))
        if window and threads.n > 1:
            threads.adapt()
    for out, bias in zip(outs, g.biases):
        if bias is not None:
            _ops.add_rows(out, bias)
    return outs
