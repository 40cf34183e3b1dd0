"""Greedy token selection on the device: a two-stage argmax of every row of a batch's logits, and the picked tokens
fed into the next step's token ids (``feed``).

Stage one reduces blocks of each row to (max, index, any NaN) triples; stage two, one program per row, reduces those.
With token masks (an output constraint's allowed tokens, packed 32 to an int32 word), stage one reads each row's
disallowed tokens as -inf. Ties go to the lowest index, as numpy's argmax. A row holding a NaN, or whose maximum is
infinite, gives -1 (as the CPU backend: a broken model's logits). Tested against numpy.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl

_BLOCK = 2048


@triton.jit
def _block_argmax_kernel(x_ptr, mask_ptr, vmax_ptr, imax_ptr, nan_ptr, N, NB, stride, W, BLOCK: tl.constexpr,
                         MASKED: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    b = tl.program_id(0)
    r = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride + offs, mask=offs < N, other=-float("inf"))
    if MASKED:
        word = tl.load(mask_ptr + r * W + offs // 32, mask=offs < W * 32, other=0)
        x = tl.where(((word >> (offs % 32)) & 1) != 0, x, -float("inf"))
    m = tl.max(x, axis=0)
    idx = tl.min(tl.where(x == m, offs, N), axis=0)
    tl.store(vmax_ptr + r * NB + b, m)
    tl.store(imax_ptr + r * NB + b, idx)
    tl.store(nan_ptr + r * NB + b, tl.max((x != x).to(tl.int32), axis=0))  # noqa: PLR0124 (the NaN test)


@triton.jit
def _final_argmax_kernel(vmax_ptr, imax_ptr, nan_ptr, out_ptr, NB, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < NB
    v = tl.load(vmax_ptr + r * NB + offs, mask=mask, other=-float("inf"))
    i = tl.load(imax_ptr + r * NB + offs, mask=mask, other=2147483647)
    nan = tl.max(tl.load(nan_ptr + r * NB + offs, mask=mask, other=0), axis=0)
    m = tl.max(v, axis=0)
    best = tl.min(tl.where(v == m, i, 2147483647), axis=0)
    broken = (nan > 0) | (m == float("inf")) | (m == -float("inf"))
    tl.store(out_ptr + r, tl.where(broken, -1, best))


@triton.jit
def _feed_kernel(ids_ptr, prev_ptr, src_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(src_ptr + offs, mask=offs < N, other=-1)
    fed = src >= 0
    tl.store(ids_ptr + offs, tl.load(prev_ptr + tl.where(fed, src, 0), mask=fed), mask=fed)


def feed(ids: torch.Tensor, previous: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """In place, in one launch: ``ids[i] = previous[source[i]]`` where ``source[i] >= 0`` (int32 arrays)."""
    n = ids.numel()
    assert source.numel() == n and ids.is_contiguous() and source.is_contiguous() and previous.is_contiguous()
    _feed_kernel[(triton.cdiv(n, 1024),)](ids, previous, source, n, BLOCK=1024)
    return ids


class ArgmaxRows:
    """Reusable scratch for the row argmax of (rows, n) float32 logits with up to ``rows`` rows. Each call returns
    a new array unless told where to write (``out``): a step queued ahead reads the tokens of the one before while its
    own argmax runs."""

    def __init__(self, rows: int, n: int, device: torch.device):
        self.rows, self.n = rows, n
        self.nb = triton.cdiv(n, _BLOCK)
        self.vmax = torch.empty((rows, self.nb), dtype=torch.float32, device=device)
        self.imax = torch.empty((rows, self.nb), dtype=torch.int32, device=device)
        self.nan = torch.empty((rows, self.nb), dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, pdl_on: bool = False, masks: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The index of each row's largest element (-1 for a broken row) as a (len(x),) int32 device tensor (``out``
        if given); ``masks``: int32 (len(x), words) of packed allowed-token bits, or None."""
        r, n = x.shape
        assert r <= self.rows and n == self.n and x.stride(1) == 1
        assert masks is None or (masks.shape[0] == r and masks.dtype == torch.int32 and masks.is_contiguous())
        words = masks.shape[1] if masks is not None else 0
        _block_argmax_kernel[(self.nb, r)](x, x if masks is None else masks, self.vmax, self.imax, self.nan, n,
                                           self.nb, x.stride(0), words, BLOCK=_BLOCK, MASKED=masks is not None,
                                           **pdl.launch(pdl_on))
        if out is None:
            out = torch.empty(r, dtype=torch.int32, device=x.device)
        assert out.shape == (r,) and out.dtype == torch.int32
        _final_argmax_kernel[(r,)](self.vmax, self.imax, self.nan, out, self.nb,
                                   BLOCK=triton.next_power_of_2(self.nb), **pdl.launch(pdl_on))
        return out
