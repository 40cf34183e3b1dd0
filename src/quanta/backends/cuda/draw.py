"""Sampled token selection on the device: a batch's rows with temperature, top-k, top-p, min-p, logit bias and
penalties, each row's token drawn with its own uniform (the host's draw from the request's seeded generator), so a
row's token depends on its logits, its settings and its draw alone, as the host sampler's does (engine/sampler.py).

The candidates come in the host sampler's order: a row that cuts by top-k or top-p takes them most likely first
(``torch.topk`` of the batch's largest top-k, or a sort of the whole row for a nucleus without top-k), a row that
keeps the whole distribution in id order. Cut rows of up to FUSED_MAX_K candidates are drawn by one kernel
(``_draw_few_kernel``), the others by torch ops (``_draw``, the same arithmetic): at batch 1 the ~35 launches of the
torch ops cost more host time than a small model's whole decode step (GPU run 311). Weights are float64 ``exp((logit - max) / temperature)``; top-k keeps the first k,
top-p each candidate whose predecessors' weight is below p of the kept total (and the first), min-p each whose
weight reaches min_p (the largest weighs 1). The token is the first candidate whose cumulative weight exceeds ``u``
times the kept total: ``Generator.choice``'s rule. Only the order of equal logits at a top-k boundary may differ from
the host's (lowest id first there). Greedy rows take the argmax of their adjusted logits; a row whose logits are not
finite gives -1. Everything is queued: nothing waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from quanta.backends.base import SamplingRows

FUSED_MAX_K = 1024  # candidates up to which a cut row is drawn by one kernel (more: torch ops over a sorted row)

# the per-row columns of the one uploaded float64 array
_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "uniform", "repeat_penalty", "presence_penalty",
            "frequency_penalty")


def sample_rows(logits: torch.Tensor, rows: SamplingRows, argmax: Callable[[torch.Tensor], torch.Tensor],
                upload: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:
    """int32 (n,): each row's token (module docstring); ``argmax``: Backend.argmax_rows, ``upload``: a host array's
    copy on the device, queued."""
    n, vocab = logits.shape
    sampled = np.flatnonzero(rows.temperature > 0)
    no_cut = (rows.top_k[sampled] <= 0) | (rows.top_k[sampled] >= vocab)
    whole = sampled[no_cut & (rows.top_p[sampled] >= 1.0)]
    cut = sampled[~(no_cut & (rows.top_p[sampled] >= 1.0))]
    per_row = np.stack([np.asarray(getattr(rows, c), np.float64) for c in _COLUMNS], axis=1)
    entries = np.stack([rows.adjust_rows.astype(np.float64) * vocab + rows.adjust_ids, rows.bias, rows.counts,
                        rows.adjust_rows], axis=1) if rows.adjust_rows.size else np.zeros((0, 4))
    packed = upload(np.concatenate([per_row.reshape(-1), entries.reshape(-1), whole, cut]).astype(np.float64))
    params = packed[:per_row.size].view(n, len(_COLUMNS))
    o = per_row.size + entries.size
    x = logits
    if entries.size:
        x = logits.clone()
        _adjust(x.view(-1), packed[per_row.size:o].view(-1, 4), params)
    # greedy rows: the argmax; sampled ones are written over it
    tokens = argmax(x) if sampled.size < n else torch.empty(n, dtype=torch.int32, device=x.device)
    for group, in_order in ((whole, True), (cut, False)):
        if not group.size:
            continue
        top = int(rows.top_k[group].max())
        k = vocab if in_order or (rows.top_k[group] <= 0).any() or top >= vocab else top
        fused = not in_order and k <= FUSED_MAX_K
        if group.size == n:  # every row (the groups are in row order)
            return _draw_few(x, params, k) if fused else _draw(x, params, k, in_order)
        idx = packed[o:o + group.size].long()
        o += group.size
        xs, ps = x.index_select(0, idx), params.index_select(0, idx)
        tokens.index_copy_(0, idx, _draw_few(xs, ps, k) if fused else _draw(xs, ps, k, in_order))
    return tokens


def _adjust(flat: torch.Tensor, entries: torch.Tensor, params: torch.Tensor) -> None:
    """In place on the flattened logits: each entry's bias, then its row's penalties where its count is positive."""
    at = entries[:, 0].long()
    counts = entries[:, 2].float()
    row = params.index_select(0, entries[:, 3].long()).float()
    v = flat[at] + entries[:, 1].float()
    rp, presence, frequency = row[:, 5], row[:, 6], row[:, 7]
    penalised = torch.where(v > 0, v / rp, v * rp) - presence - frequency * counts
    flat[at] = torch.where(counts > 0, penalised, v)


def _draw(x: torch.Tensor, params: torch.Tensor, k: int, in_order: bool) -> torch.Tensor:
    """The drawn token (int32) of each row of ``x`` (its rows' settings ``params``), -1 where its largest logit is
    not finite; candidates: the whole row in id order (``in_order``), else its ``k`` largest, most likely first
    (a NaN sorts first)."""
    if in_order:
        vals, ids = x, None
        top = vals.max(dim=1, keepdim=True).values  # (NaN where the row holds one)
    else:  # (torch.topk of a whole row is many times slower than a sort)
        vals, ids = torch.sort(x, dim=1, descending=True) if k == x.shape[1] else torch.topk(x, k, dim=1)
        top = vals[:, :1]
    weights = torch.exp((vals.double() - top.double()) / params[:, 0:1])
    if not in_order:
        j = torch.arange(k, device=x.device)
        top_k, top_p = params[:, 1:2], params[:, 2:3]
        weights = weights * ((top_k <= 0) | (j < top_k))
        before = weights.cumsum(dim=1) - weights
        weights = weights * ((top_p >= 1.0) | (before < top_p * (before[:, -1:] + weights[:, -1:])) | (j == 0))
    weights = weights * (weights >= params[:, 3:4])
    cdf = weights.cumsum(dim=1)
    total = cdf[:, -1:]
    pick = torch.searchsorted(cdf, params[:, 4:5] * total, right=True)
    last = (cdf < total).sum(dim=1, keepdim=True)  # the last candidate with weight (rounding may reach the total)
    pick = torch.minimum(pick, last)
    token = (pick if ids is None else ids.gather(1, pick)).view(-1)
    return torch.where(torch.isfinite(top.view(-1)), token, -1).to(torch.int32)


@triton.jit
def _draw_few_kernel(vals_ptr, ids_ptr, params_ptr, out_ptr, K, N_PARAMS: tl.constexpr, BLOCK: tl.constexpr):
    """One row's draw from its K most likely candidates (sorted): :func:`_draw`'s arithmetic in one program."""
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inside = offs < K
    v = tl.load(vals_ptr + r * K + offs, mask=inside, other=-float("inf")).to(tl.float64)
    top = tl.load(vals_ptr + r * K)
    p = params_ptr + r * N_PARAMS
    temperature, top_k, top_p = tl.load(p), tl.load(p + 1), tl.load(p + 2)
    min_p, u = tl.load(p + 3), tl.load(p + 4)
    w = tl.exp((v - top.to(tl.float64)) / temperature)
    w = tl.where(inside & (offs < tl.where(top_k <= 0, K, top_k)), w, 0.0)
    before = tl.cumsum(w, 0) - w
    kept = tl.sum(w, 0)
    w = tl.where((before < tl.where(top_p >= 1.0, 2.0 * kept + 1.0, top_p * kept)) | (offs == 0), w, 0.0)
    w = tl.where(w >= min_p, w, 0.0)
    cdf = tl.cumsum(w, 0)
    total = tl.sum(w, 0)
    pick = tl.minimum(tl.sum((inside & (cdf <= u * total)).to(tl.int32), 0),
                      tl.sum((inside & (cdf < total)).to(tl.int32), 0))
    token = tl.sum(tl.where(offs == pick, tl.load(ids_ptr + r * K + offs, mask=inside, other=0), 0), 0)
    finite = (top == top) & (tl.abs(top) < float("inf"))  # noqa: PLR0124 (the NaN test)
    tl.store(out_ptr + r, tl.where(finite, token, -1).to(tl.int32))


def _draw_few(x: torch.Tensor, params: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`_draw` of cut rows over their ``k`` (at most FUSED_MAX_K) largest: one topk, one kernel."""
    vals, ids = torch.topk(x, k, dim=1)
    out = torch.empty(x.shape[0], dtype=torch.int32, device=x.device)
    _draw_few_kernel[(x.shape[0],)](vals, ids, params, out, k, N_PARAMS=params.shape[1],
                                    BLOCK=triton.next_power_of_2(k))
    return out
