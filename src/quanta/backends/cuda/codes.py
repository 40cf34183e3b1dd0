"""Reading the code planes of repack.py inside the kernels: the high-bit plane of 5- and 6-bit codes, and one code
slot as a float (the GEMV and GEMM dequantize a slot of every word at a time).

A 5- or 6-bit weight is a 4-bit code (the ``q`` plane, read as the 4-bit formats are) plus ``HB`` high bits from
the ``qh`` plane: ``HB`` 32-bit words per 32-weight chunk. :func:`high_fields` turns them into two [R, C, 4] tiles
shaped like the chunk's four code words: byte ``b`` of element ``w`` of tile ``t`` holds, in its low HB bits (the
bits above are other weights'), the high bits of weight ``8b + 4t + w``: the weight that the int8 GEMV pairs with
byte ``b`` of activation word ``4t + w``, and the weight in slot ``2b + t`` of code word ``w``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def high_words(qh_ptr, rows, rmask, j, NU, QHW, HB: tl.constexpr, MASKED: tl.constexpr):
    """The [R, C, HB] high-bit words of the 4-bit units (chunks) ``j`` of ``rows`` (QHW: words per row)."""
    p = qh_ptr + rows[:, None, None] * QHW + (j * HB)[None, :, None] + tl.arange(0, HB)[None, None, :]
    if MASKED:
        return tl.load(p, mask=rmask[:, None, None] & (j < NU)[None, :, None], other=0)
    return tl.load(p)


@triton.jit
def high_fields(hw, HB: tl.constexpr):
    """The two [R, C, 4] high-bit tiles (t = 0, 1) of the module docstring, from the [R, C, HB] words ``hw``."""
    if HB == 2:  # word t, field w
        h0, h1 = tl.split(hw)
        sh = 2 * tl.arange(0, 4)[None, None, :]
        return h0[:, :, None] >> sh, h1[:, :, None] >> sh
    else:  # one word, field 4t + w
        h = tl.reshape(hw, [hw.shape[0], hw.shape[1]])[:, :, None]
        sh = tl.arange(0, 4)[None, None, :]
        return h >> sh, h >> (sh + 4)


@triton.jit
def slot_value(words, hi_words, hws0, hws1, s: tl.constexpr, BITS: tl.constexpr, HB: tl.constexpr,
               QOFF: tl.constexpr):
    """Slot ``s`` of every code word as the float32 ``q - QOFF``, exactly. The code stays in place (bits
    pos..pos+BITS-1) under the exponent 23 - pos, so a LOP3 makes the float 2^(23-pos) + q; slots that would reach
    bit 23 come from the shifted copy ``hi_words`` (words >> 12, or >> 16 for 8-bit codes). With high bits (HB > 0,
    4-bit codes, ``hws0``/``hws1`` from :func:`high_fields`) they are moved in above the 4 code bits."""
    CODE: tl.constexpr = (1 << BITS) - 1
    SHIFT: tl.constexpr = 12 if BITS == 4 else 16
    LOW: tl.constexpr = BITS * s + BITS <= 23
    pos: tl.constexpr = BITS * s if LOW else BITS * s - SHIFT
    if LOW:
        bits = words & (CODE << pos)
    else:
        bits = hi_words & (CODE << pos)
    if HB > 0:
        HMASK: tl.constexpr = ((1 << HB) - 1) << (pos + 4)
        UP: tl.constexpr = pos + 4 - 8 * (s // 2)  # the high bits sit at bit 8 * (s // 2) of the tile
        if s % 2 == 0:
            hws = hws0
        else:
            hws = hws1
        if UP >= 0:
            bits = bits | ((hws << UP) & HMASK)
        else:
            bits = bits | ((hws >> -UP) & HMASK)
    bits = bits | ((150 - pos) << 23)
    return bits.to(tl.float32, bitcast=True) - ((1 << (23 - pos)) + QOFF)
