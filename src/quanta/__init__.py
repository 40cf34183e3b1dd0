"""quanta: an LLM inference engine for quantized GGUF models, written from scratch in Python."""

__version__ = "0.1.0"
