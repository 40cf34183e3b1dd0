"""The instruction sets of the fast-mode int8 kernels, which of them this CPU runs, and how a kernel is told.

Three paths, slowest first, each what llama.cpp's ggml CPU backend builds for the same features:
- ``avx2``: AVX2 + FMA + F16C (AMD Zen 2/3, Intel before Ice Lake, most VMs): u8 x s8 dots with ``vpmaddubsw``
  (pairs into saturating i16) then ``vpmaddwd`` by ones (into i32), 256-bit;
- ``avx_vnni``: AVX-VNNI (Intel client CPUs since Alder Lake): ``vpdpbusd`` on 256-bit registers;
- ``avx512_vnni``: AVX-512 VNNI (+BW, VL): ``vpdpbusd``, 512-bit in the prefill GEMM.

A kernel learns its path from the *type* of an argument (``token(isa)``: a uint8, uint16 or uint32 zero), so
numba compiles one specialisation per path, only for the paths used, and never emits an instruction for a path
the CPU lacks (LLVM could not select it).
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np

from quanta.errors import QuantaError

ISAS = ("avx2", "avx_vnni", "avx512_vnni")
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx_vnni": ("avx2", "fma", "f16c", "avxvnni"),
    "avx512_vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni"),
}
PORTABLE = "portable"  # plain LLVM vector code for the int8 dots: where the CPU has none of the paths (unused there)
_TOKEN_TYPES = {"avx2": np.uint8, "avx_vnni": np.uint16, "avx512_vnni": np.uint32, PORTABLE: np.uint64}
_BY_BITS = {8: "avx2", 16: "avx_vnni", 32: "avx512_vnni", 64: PORTABLE}


class UnsupportedISAError(QuantaError, ValueError):
    """A CPU instruction-set path was asked for that this CPU (or quanta) does not have."""


def host_isas() -> tuple[str, ...]:
    """The paths this CPU can run, slowest first."""
    features = {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}
    return tuple(isa for isa in ISAS if all(f in features for f in _NEEDS[isa]))


def resolve_isa(requested: str | None) -> str | None:
    """``requested`` if this CPU has it, the fastest path it has for ``None``; ``None`` when it has none (the
    fast mode then runs the fp32 kernels)."""
    have = host_isas()
    if requested is None:
        return have[-1] if have else None
    if requested not in ISAS:
        raise UnsupportedISAError(f"unknown CPU instruction set {requested!r}; choose one of {', '.join(ISAS)}")
    if requested not in have:
        raise UnsupportedISAError(f"this CPU cannot run the {requested} kernels (it has: {', '.join(have) or 'none'})")
    return requested


def token(isa: str) -> np.integer:
    """The argument whose type selects ``isa``'s code in a kernel."""
    return _TOKEN_TYPES[isa](0)


def isa_of(token_type) -> str:
    """The path selected by a token's numba type (inside an intrinsic's typer or codegen)."""
    return _BY_BITS[token_type.bitwidth]
