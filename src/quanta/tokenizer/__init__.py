"""Tokenizers and chat templates from GGUF metadata, producing the same token ids as llama.cpp."""

from typing import Any

from quanta.tokenizer.detokenize import StreamDecoder
from quanta.tokenizer.errors import ChatTemplateError, TokenizerError
from quanta.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "StreamDecoder", "Tokenizer", "TokenizerError", "load_tokenizer"]


def __getattr__(name: str) -> Any:
    if name == "ChatTemplate":  # imported on first use: jinja2 costs 30-80 ms of startup
        from quanta.tokenizer.chat_template import ChatTemplate

        return ChatTemplate
    raise AttributeError(f"module 'quanta.tokenizer' has no attribute {name!r}")
