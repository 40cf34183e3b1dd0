"""quanta: an LLM inference engine for quantized GGUF models, written from scratch in Python."""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "load_tokenizer", "prepare_cpu_runtime"]


def prepare_cpu_runtime() -> None:
    """Decide what the CPU libraries read once, when they load; the CLI and ``quanta.LLM`` call it before building
    a backend (calling it again, or after the libraries loaded, changes nothing). An explicit setting wins.

    - libgomp (numba's OpenMP layer): ``OMP_WAIT_POLICY=PASSIVE``, so that a worker sleeps when a region ends
      instead of spinning for milliseconds on the core that quanta's own GEMV and prefill threads need next
      (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set by the user are kept);
    - numpy's OpenBLAS: its AVX-512 kernels where it picked AVX2 ones on an AVX-512 CPU, unless
      ``OPENBLAS_CORETYPE`` is set (``backends/cpu/kernels/openblas.py``).
    """
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from quanta.backends.cpu.kernels import openblas

    openblas.use_avx512_kernels(user_core_type=os.environ.get("OPENBLAS_CORETYPE"))


def __getattr__(name: str) -> Any:
    # imported on first use so that `import quanta` (and the CLI's startup) stays light
    if name == "LLM":
        from quanta.api import LLM

        return LLM
    if name == "load_tokenizer":
        from quanta.tokenizer import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module 'quanta' has no attribute {name!r}")
