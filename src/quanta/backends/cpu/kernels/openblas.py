"""Control of the OpenBLAS bundled with numpy's wheels, which runs the prefill sgemm (ctypes, as threadpoolctl).

Two fixes, both measured (docs/PERF.md, CPU journal): numpy's OpenBLAS 0.3.31 (DYNAMIC_ARCH) detects AMD Zen 5 as
"Haswell" and runs AVX2 kernels (125 GFLOP/s per core); its AVX-512 "SkylakeX" kernels run 229 GFLOP/s there.
``use_avx512_kernels`` re-runs OpenBLAS's own core selection (``gotoblas_dynamic_quit`` / ``_init``, what the
library does at load) with ``OPENBLAS_CORETYPE=SkylakeX`` when the CPU has AVX-512 but AVX2 kernels were picked
and the user did not choose a core type; called once at the edge (``quanta.prepare_cpu_runtime``), never at
import. Any other BLAS: both functions do nothing.
"""

from __future__ import annotations

import ctypes
import glob
import os

import llvmlite.binding as llvm
import numpy as np

AVX512_FEATURES = ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")  # what SkylakeX kernels use
AVX2_CORES = (b"Haswell", b"Zen")


def _library() -> ctypes.CDLL | None:
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    return ctypes.CDLL(libs[0]) if libs else None


def _symbol(lib: ctypes.CDLL | None, *names: str):
    return next((getattr(lib, n) for n in names if lib is not None and hasattr(lib, n)), None)


def set_threads(n: int) -> None:
    """OpenBLAS's own thread count."""
    fn = _symbol(_library(), "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                 "openblas_set_num_threads")  # fmt: skip
    if fn is not None:
        fn(ctypes.c_int(n))


def use_avx512_kernels(*, user_core_type: str | None) -> str | None:
    """Switch an AVX2-only core choice to SkylakeX on an AVX-512 CPU unless the user chose a core type (the
    ``OPENBLAS_CORETYPE`` read at the edge, ``quanta.prepare_cpu_runtime``); returns the core name in use."""
    lib = _library()
    corename = _symbol(lib, "scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename")
    if corename is None:
        return None
    corename.restype = ctypes.c_char_p
    features = set(llvm.get_host_cpu_features().flatten().split(","))
    switch = (
        corename() in AVX2_CORES
        and user_core_type is None
        and all(f"+{f}" in features for f in AVX512_FEATURES)
        and all(hasattr(lib, s) for s in ("gotoblas_dynamic_quit", "gotoblas_dynamic_init", "gotoblas_SKYLAKEX"))
    )
    if switch:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"  # read by gotoblas_dynamic_init
        try:
            lib.gotoblas_dynamic_quit()
            lib.gotoblas_dynamic_init()
        finally:
            del os.environ["OPENBLAS_CORETYPE"]
    return corename().decode()
