"""Sampled token selection on the device: a batch's rows with temperature, top-k, top-p, min-p, logit bias and
penalties, each row's token drawn with its own uniform (the host's draw from the request's seeded generator), so a
row's token depends on its logits, its settings and its draw alone, as the host sampler's does (engine/sampler.py).

The candidates come in the host sampler's order: a row that cuts by top-k or top-p takes them most likely first
(the batch's largest top-k, or a sort of the whole row for a nucleus without top-k), a row that keeps the whole
distribution in id order. Cut rows of up to TOP_MAX candidates are found and drawn by two kernels (each block of the
row keeps its largest as int64 keys that sort by logit, then by lower id, as the host's ``_largest``; a second
kernel takes the row's largest of those and draws), cut rows of up to FUSED_MAX_K by ``torch.topk`` and one kernel
(``_draw_few_kernel``; only the order of equal logits at the top-k boundary may differ from the host's there), the
others by torch ops (``_draw``, the same arithmetic): at batch 1 the ~35 launches of the torch ops cost more host
time than a small model's whole decode step (GPU run 311). Weights are float64 ``exp((logit - max) / temperature)``;
top-k keeps the first k, top-p each candidate whose predecessors' weight is below p of the kept total (and the
first), min-p each whose weight reaches min_p (the largest weighs 1). The token is the first candidate whose
cumulative weight exceeds ``u`` times the kept total: ``Generator.choice``'s rule. Greedy rows take the argmax of
their adjusted logits; a row whose logits are not finite gives -1. Everything is queued: nothing waits for the
device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from quanta.backends.base import SamplingRows

FUSED_MAX_K = 1024  # candidates up to which a cut row is drawn by one kernel (more: torch ops over a sorted row)
# cut rows of up to TOP_MAX candidates find them without torch.topk, whose host time was most of what a sampled step
# cost beyond a greedy one at batch 1 (GPU run 318): each block of MIN_TOP_BLOCK or more logits keeps its largest,
# as sortable int64 keys, and a second kernel takes the row's from those (TOP_KEYS at most) and draws
TOP_MAX = 128
TOP_KEYS = 4096
MIN_TOP_BLOCK = 1024
WARM_TOP_K = 40  # the top-k whose kernels compile ahead (warm_up): SamplingParams' default

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
def _draw_sorted(v, ids, K, top, p, out_ptr):
    """Write the token drawn from the K candidates ``v`` (most likely first, ``top`` the first; past K: anything)
    with ids ``ids`` under the settings at ``p``: :func:`_draw`'s arithmetic."""
    offs = tl.arange(0, v.shape[0])
    inside = offs < K
    temperature, top_k, top_p = tl.load(p), tl.load(p + 1), tl.load(p + 2)
    min_p, u = tl.load(p + 3), tl.load(p + 4)
    w = tl.exp((v.to(tl.float64) - top.to(tl.float64)) / temperature)
    w = tl.where(inside & (offs < tl.where(top_k <= 0, K, top_k)), w, 0.0)
    before = tl.cumsum(w, 0) - w
    kept = tl.sum(w, 0)
    w = tl.where((before < tl.where(top_p >= 1.0, 2.0 * kept + 1.0, top_p * kept)) | (offs == 0), w, 0.0)
    w = tl.where(w >= min_p, w, 0.0)
    cdf = tl.cumsum(w, 0)
    total = tl.sum(w, 0)
    pick = tl.minimum(tl.sum((inside & (cdf <= u * total)).to(tl.int32), 0),
                      tl.sum((inside & (cdf < total)).to(tl.int32), 0))
    token = tl.sum(tl.where(offs == pick, ids, 0), 0)
    finite = (top == top) & (tl.abs(top) < float("inf"))  # noqa: PLR0124 (the NaN test)
    tl.store(out_ptr, tl.where(finite, token, -1).to(tl.int32))


@triton.jit
def _draw_few_kernel(vals_ptr, ids_ptr, params_ptr, out_ptr, K, N_PARAMS: tl.constexpr, BLOCK: tl.constexpr):
    """One row's draw from its K most likely candidates (sorted by torch.topk)."""
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    v = tl.load(vals_ptr + r * K + offs, mask=offs < K, other=-float("inf"))
    ids = tl.load(ids_ptr + r * K + offs, mask=offs < K, other=0)
    _draw_sorted(v, ids, K, tl.load(vals_ptr + r * K), params_ptr + r * N_PARAMS, out_ptr + r)


@triton.jit
def _keys(x, ids, valid):
    """int64 keys that order logits ``x`` as floats, of two equal ones the lower id first, any NaN above everything
    (as torch.topk puts it first) and the invalid lanes below everything."""
    x = tl.where(x != x, float("nan"), x)  # noqa: PLR0124 (every NaN the positive quiet one)
    bits = x.to(tl.int32, bitcast=True)
    high = tl.where(valid, bits ^ ((bits >> 31) & 0x7FFFFFFF), -2147483648)  # negative floats' magnitude bits flipped
    return (high.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)


@triton.jit
def _key_value(key):
    """The logit of a key (:func:`_keys`)."""
    high = (key >> 32).to(tl.int32)
    return (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _top_block_kernel(x_ptr, keys_ptr, N, stride, NB, BLOCK: tl.constexpr, KB: tl.constexpr):
    """The KB largest keys of block ``program_id(0)`` of row ``program_id(1)``, largest first."""
    b = tl.program_id(0)
    r = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride + offs, mask=offs < N, other=0.0)
    tl.store(keys_ptr + (r * NB + b) * KB + tl.arange(0, KB), tl.topk(_keys(x, offs, offs < N), KB))


@triton.jit
def _draw_top_kernel(keys_ptr, params_ptr, out_ptr, K, N_PARAMS: tl.constexpr, KEYS: tl.constexpr,
                     KB: tl.constexpr):
    """One row's draw from the K largest of its blocks' best keys (:func:`_top_block_kernel`)."""
    r = tl.program_id(0)
    top = tl.topk(tl.load(keys_ptr + r * KEYS + tl.arange(0, KEYS)), KB)
    ids = 0x7FFFFFFF - (top & 0x7FFFFFFF).to(tl.int32)
    _draw_sorted(_key_value(top), ids, K, _key_value(tl.max(top, 0)), params_ptr + r * N_PARAMS, out_ptr + r)


def warm_up(logits: torch.Tensor) -> None:
    """Launch the draw of ``logits``' rows cut to WARM_TOP_K (settings unset): for a compile-ahead dry run, which
    launches nothing and compiles the kernels it records (compile_ahead.py)."""
    n, vocab = logits.shape
    _draw_few(logits, torch.zeros((n, len(_COLUMNS)), dtype=torch.float64, device=logits.device),
              min(WARM_TOP_K, vocab))


def _top_blocks(vocab: int, k: int) -> tuple[int, int, int]:
    """The two-kernel draw's sizes for a row of ``vocab`` logits and ``k`` candidates: keys kept per block (a power
    of two >= k), logits per block, blocks (a power of two; their kept keys at most TOP_KEYS)."""
    kept = max(2, triton.next_power_of_2(k))
    block = max(MIN_TOP_BLOCK, kept, triton.next_power_of_2(triton.cdiv(vocab * kept, TOP_KEYS)))
    return kept, block, triton.next_power_of_2(triton.cdiv(vocab, block))


def _draw_few(x: torch.Tensor, params: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`_draw` of cut rows over their ``k`` (at most FUSED_MAX_K) largest: up to TOP_MAX, each block's k
    largest then the row's (two kernels); beyond, one topk and one kernel."""
    n, vocab = x.shape
    assert x.stride(1) == 1
    out = torch.empty(n, dtype=torch.int32, device=x.device)
    if k <= TOP_MAX and k < vocab:  # (a tiny vocabulary's whole row: one topk)
        kept, block, blocks = _top_blocks(vocab, k)
        keys = torch.empty((n, blocks, kept), dtype=torch.int64, device=x.device)
        _top_block_kernel[(blocks, n)](x, keys, vocab, x.stride(0), blocks, BLOCK=block, KB=kept,
                                       num_warps=4 if block <= 2048 else 8)
        _draw_top_kernel[(n,)](keys, params, out, k, N_PARAMS=params.shape[1], KEYS=blocks * kept, KB=kept,
                               num_warps=4 if blocks * kept <= 1024 else 8)
        return out
    vals, ids = torch.topk(x, k, dim=1)
    _draw_few_kernel[(n,)](vals, ids, params, out, k, N_PARAMS=params.shape[1], BLOCK=triton.next_power_of_2(k))
    return out
