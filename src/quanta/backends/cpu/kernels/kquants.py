"""Scalar block dequantization of Q2_K and Q3_K (256-weight super-blocks) for numba kernels.

Each ``dequant_<fmt>(raw, b, out, o)`` expands the super-block at byte ``b`` of the uint8 array ``raw`` into
``out[o:o+256]``; byte offsets come from ``quanta.quant.formats``. Bit layouts follow ggml-quants.c
``dequantize_row_q*_K``. These two formats (absent from the supported models) have no SIMD kernel: their GEMV
dequantizes a row then takes a dot product. Tested against gguf-py's ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from quanta.backends.cpu.kernels.halfprec import read_f16
from quanta.quant.formats import FORMATS

_Q2, _Q3 = FORMATS["Q2_K"], FORMATS["Q3_K"]
Q2_SC, Q2_QS, Q2_D, Q2_DMIN = (_Q2.offset(f) for f in ("scales", "qs", "d", "dmin"))
Q3_HM, Q3_QS, Q3_SC, Q3_D = (_Q3.offset(f) for f in ("hmask", "qs", "scales", "d"))


@njit
def scale_q3_k(raw, s, j):
    """Q3_K: signed 6-bit scale of sub-block j: low 4 bits are nibbles of bytes 0..7, high 2 bits in bytes 8..11."""
    lo = np.int32(raw[s + j]) & 15 if j < 8 else np.int32(raw[s + j - 8]) >> 4
    hi = (np.int32(raw[s + 8 + (j & 3)]) >> (2 * (j >> 2))) & 3
    return (lo | (hi << 4)) - 32


@njit
def dequant_q2_k(raw, b, out, o):
    # 2-bit weights: byte l of a 32-byte group holds 4 weights at shifts 0,2,4,6, 16 weights per scale byte.
    d = read_f16(raw, b + Q2_D)
    dmin = read_f16(raw, b + Q2_DMIN)
    for half in range(2):
        for shift_i in range(4):
            for g in range(2):
                sc = np.int32(raw[b + Q2_SC + half * 8 + shift_i * 2 + g])
                dl = d * np.float32(sc & 15)
                ml = dmin * np.float32(sc >> 4)
                q0 = b + Q2_QS + half * 32 + g * 16
                y0 = o + half * 128 + shift_i * 32 + g * 16
                for l in range(16):
                    out[y0 + l] = dl * np.float32((np.int32(raw[q0 + l]) >> (2 * shift_i)) & 3) - ml


@njit
def dequant_q3_k(raw, b, out, o):
    # Like Q2_K plus a high bit per weight in hmask (bit set = no -4 offset).
    d = read_f16(raw, b + Q3_D)
    for half in range(2):
        for shift_i in range(4):
            mbit = 1 << (half * 4 + shift_i)
            for g in range(2):
                dl = d * np.float32(scale_q3_k(raw, b + Q3_SC, half * 8 + shift_i * 2 + g))
                q0 = b + Q3_QS + half * 32 + g * 16
                h0 = b + Q3_HM + g * 16
                y0 = o + half * 128 + shift_i * 32 + g * 16
                for l in range(16):
                    q = (np.int32(raw[q0 + l]) >> (2 * shift_i)) & 3
                    q -= 0 if np.int32(raw[h0 + l]) & mbit else 4
                    out[y0 + l] = dl * np.float32(q)


