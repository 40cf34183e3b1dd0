"""Greedy token selection on the device: a two-stage argmax over the vocabulary.

Stage one reduces blocks of the logits to (max, index) pairs; stage two, one program, reduces those. Ties go to
the lowest index, as numpy's argmax. Tested against numpy.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quanta.backends.cuda import pdl

_BLOCK = 2048


@triton.jit
def _block_argmax_kernel(x_ptr, vmax_ptr, imax_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=-float("inf"))
    m = tl.max(x, axis=0)
    idx = tl.min(tl.where(x == m, offs, N), axis=0)
    tl.store(vmax_ptr + pid, m)
    tl.store(imax_ptr + pid, idx)


@triton.jit
def _final_argmax_kernel(vmax_ptr, imax_ptr, out_ptr, NB, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_next(PDL)
    pdl.wait_prev(PDL)
    offs = tl.arange(0, BLOCK)
    v = tl.load(vmax_ptr + offs, mask=offs < NB, other=-float("inf"))
    i = tl.load(imax_ptr + offs, mask=offs < NB, other=2147483647)
    m = tl.max(v, axis=0)
    tl.store(out_ptr, tl.min(tl.where(v == m, i, 2147483647), axis=0))


class Argmax:
    """Reusable scratch for the argmax of 1-D float32 arrays of one length (no allocation per call)."""

    def __init__(self, n: int, device: torch.device):
        self.n = n
        self.nb = triton.cdiv(n, _BLOCK)
        self.vmax = torch.empty(self.nb, dtype=torch.float32, device=device)
        self.imax = torch.empty(self.nb, dtype=torch.int32, device=device)
        self.out = torch.empty(1, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The index of the largest element of ``x`` as a (1,) int32 device tensor."""
        assert x.numel() == self.n and x.is_contiguous()
        _block_argmax_kernel[(self.nb,)](x, self.vmax, self.imax, self.n, BLOCK=_BLOCK, **pdl.launch())
        _final_argmax_kernel[(1,)](self.vmax, self.imax, self.out, self.nb,
                                   BLOCK=triton.next_power_of_2(self.nb), **pdl.launch())
        return self.out
