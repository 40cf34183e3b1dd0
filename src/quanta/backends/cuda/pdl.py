"""Programmatic dependent launch (Hopper and newer): a kernel may start while the one before it finishes.

Decode launches ~10 small kernels per layer; each pays a launch, a ramp-up and a memory latency before its first
byte arrives. With PDL every kernel first lets the next one launch (``allow_next``), and the next one loads what
no earlier kernel writes (weights, norm weights, the step's host-written metadata) before it waits for its
predecessor (``wait_prev``): the weight stream of one kernel overlaps the tail of the last. Every kernel launched
with PDL must call ``wait_prev`` before it reads or writes any activation, cache or scratch memory; the one
exception is the decode attention, which reads the K/V rows of earlier forwards before it waits
(flash_decode.py's ``_decode_attention_kernel``). The CUDA backend decides (``CUDABackend(pdl=...)``: on from
sm_90, off under the Triton interpreter) and passes the switch to every launcher.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def launch(on: bool) -> dict:
    """Kernel keyword arguments: the ``PDL`` constexpr and Triton's launch option."""
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def allow_next(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_prev(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
