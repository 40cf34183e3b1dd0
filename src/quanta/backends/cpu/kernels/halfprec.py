"""Reading little-endian f16 scalars out of raw GGUF bytes inside numba kernels.

numba has no float16 type, so the conversion is an LLVM intrinsic: the 16 bits are bitcast to ``half`` and
extended to ``float`` (one ``vcvtph2ps`` with F16C; exact for every value, subnormals, inf and nan included).
Tested against numpy's ``view(np.float16).astype(np.float32)``.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        h = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(h, ir.FloatType())

    return types.float32(types.uint32), codegen


@njit(inline="always")
def read_f16(raw, off):
    """The f16 stored at byte ``off`` of a uint8 array, as float32."""
    return _half_bits_to_f32(types.uint32(raw[off]) | (types.uint32(raw[off + 1]) << 8))

