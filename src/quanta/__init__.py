"""quanta: an LLM inference engine for quantized GGUF models, written from scratch in Python."""

from __future__ import annotations

from typing import Any

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
