"""quanta: an LLM inference engine for quantized GGUF models, written from scratch in Python."""

from __future__ import annotations

import os
from typing import Any

# numba's OpenMP workers spin for milliseconds after each parallel op, on the core the next kernel needs; a short
# spin made Gemma-3 prefill 0.8× → 1.05× llama.cpp (docs/PERF.md). libgomp reads it once, when it first loads,
# so it is set here, before anything can load it; an explicit setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"
__all__ = ["LLM", "load_tokenizer"]


def __getattr__(name: str) -> Any:
    # imported on first use so that `import quanta` (and the CLI's startup) stays light
    if name == "LLM":
        from quanta.api import LLM

        return LLM
    if name == "load_tokenizer":
        from quanta.tokenizer import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module 'quanta' has no attribute {name!r}")
