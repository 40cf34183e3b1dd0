"""Tokenizers and chat templates from GGUF metadata, producing the same token ids as llama.cpp."""

from quanta.tokenizer.chat_template import ChatTemplate
from quanta.tokenizer.detokenize import StreamDecoder
from quanta.tokenizer.errors import ChatTemplateError, TokenizerError
from quanta.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "StreamDecoder", "Tokenizer", "TokenizerError", "load_tokenizer"]
