"""Pre-tokenizers for byte-level BPE, chosen by ``tokenizer.ggml.pre`` exactly as llama.cpp does.

Each regex is applied in turn inside the pieces the previous one produced; text between matches stays a piece
of its own (``unicode_regex_split`` in llama.cpp, ``Split(..., "isolated")`` in HF tokenizers). The regexes
and the per-name flags (``clean_spaces``, ``ignore_merges``, ``add_bos``) are copied from
``llm_tokenizer_bpe`` and ``llama_vocab::impl::load`` in llama.cpp's ``src/llama-vocab.cpp``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from quanta.tokenizer.errors import TokenizerError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    name: str
    regexes: tuple[str, ...]
    clean_spaces: bool = True  # detokenize removes the space in " ?", " 's", ... (llama.cpp's clean_spaces)
    ignore_merges: bool = False  # a piece that is itself a token is taken whole, before any merge
    add_bos: bool = False  # default for tokenizer.ggml.add_bos_token


_FAMILIES = (
    (PreTokenizer("default", _DEFAULT), ("default",)),
    (PreTokenizer("llama3", (_LLAMA3,), ignore_merges=True, add_bos=True),
     ("llama3", "llama-v3", "llama-bpe", "falcon3")),
    (PreTokenizer("gpt2", (_GPT2,)), ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en",
                                      "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe", "mpt", "olmo",
                                      "jais")),
    (PreTokenizer("qwen2", (_QWEN2,), clean_spaces=False), ("qwen2", "deepseek-r1-qwen")),
    (PreTokenizer("qwen2", (_QWEN2,)), ("stablelm2", "megrez")),
    (PreTokenizer("starcoder", (r"\p{N}", _GPT2)), ("starcoder", "refact", "codeshell", "exaone", "minerva-7b")),
    (PreTokenizer("smollm", (r"\p{N}", _GPT2), clean_spaces=False), ("smollm", "command-r")),
)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for pre, names in _FAMILIES for name in names}


def pre_tokenizer_for(pre: str) -> PreTokenizer:
    """The pre-tokenizer for a ``tokenizer.ggml.pre`` value; a missing one means "default", as in llama.cpp."""
    if not pre:
        warnings.warn("the GGUF names no pre-tokenizer (tokenizer.ggml.pre); using llama.cpp's 'default' regexes, "
                      "which may not match how the model was trained", stacklevel=3)
        return PRE_TOKENIZERS["default"]
    try:
        return PRE_TOKENIZERS[pre]
    except KeyError:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise TokenizerError(f"unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); quanta implements: {known}") \
            from None
