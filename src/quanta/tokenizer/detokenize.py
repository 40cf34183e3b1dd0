"""Token ids back to text, as ``llama_detokenize`` (remove_special=False) does, in one go or streamed.

A token's piece is bytes (a byte-fallback token is one byte of a UTF-8 character). Control and unknown tokens
render as their text, or as nothing when special tokens are skipped. With ``add_space_prefix`` one leading
space of the first piece is dropped; with ``clean_spaces`` (GPT-2 style vocabularies) the joined bytes lose
the space in " ?", " !", " .", " ,", " ' ", " 's", " 'm", " 're", " 've". Bytes become text with invalid UTF-8
replaced by U+FFFD.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence

from quanta.tokenizer.vocab import TokenAttr, Vocab

_SPACE_BEFORE_PUNCT = re.compile(rb" (?=[?!.,])")
_SPACED_APOSTROPHE = re.compile(rb" ' ")
_SPACE_BEFORE_CONTRACTION = re.compile(rb" '(?=[sm]|re|ve)")
# Bytes the clean-up patterns are made of: any other byte is never removed and no pattern spans it, so the
# clean-up of text cut right after such a byte is the clean-up of the two parts.
_CLEAN_ALPHABET = frozenset(b" '?!.,smrev")
_GPT2_BYTE_DECODER: dict[str, int] | None = None


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, reversed (llama.cpp's ``unicode_utf8_to_byte``)."""
    global _GPT2_BYTE_DECODER
    if _GPT2_BYTE_DECODER is None:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        chars, n = list(printable), 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                chars.append(256 + n)
                n += 1
        _GPT2_BYTE_DECODER = {chr(c): b for b, c in zip(printable, chars)}
    return _GPT2_BYTE_DECODER


def _bpe_piece(text: str, byte_decoder: dict[str, int]) -> bytes:
    try:
        return bytes([byte_decoder[c] for c in text])
    except KeyError:  # llama.cpp marks characters outside the byte map this way
        out = bytearray()
        for c in text:
            b = byte_decoder.get(c)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + text.encode() + b"]"
        return bytes(out)


_VERBATIM = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN | TokenAttr.USER_DEFINED)
_NORMAL, _BYTE = int(TokenAttr.NORMAL), int(TokenAttr.BYTE)


class TokenPieces:
    """Each token's bytes with special tokens rendered (llama.cpp's ``token_to_piece(special=True)`` cache),
    computed on first use of each id: the first token must not wait for all 262k pieces of a large vocabulary."""

    def __init__(self, vocab: Vocab):
        self._vocab = vocab
        self._pieces: list[bytes | None] = [None] * vocab.size
        self._byte_decoder = gpt2_byte_decoder() if vocab.kind == "bpe" else {}

    def __len__(self) -> int:
        return len(self._pieces)

    def __getitem__(self, token_id: int) -> bytes:
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._render(token_id)
        return piece

    def _render(self, token_id: int) -> bytes:
        vocab = self._vocab
        text, attr = vocab.tokens[token_id], int(vocab.attrs[token_id])
        if attr & _VERBATIM:
            return text.encode()
        if attr & _NORMAL:
            return text.replace("▁", " ").encode() if vocab.kind == "spm" else _bpe_piece(text, self._byte_decoder)
        if attr & _BYTE and vocab.kind == "spm":
            return bytes([int(text[3:5], 16)])
        return b""  # unused, undefined (and byte tokens of a BPE vocabulary) render as nothing


def clean_spaces(data: bytes) -> bytes:
    data = _SPACE_BEFORE_PUNCT.sub(b"", data)
    data = _SPACED_APOSTROPHE.sub(b"'", data)
    return _SPACE_BEFORE_CONTRACTION.sub(b"'", data)


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns the text that is final so far, never a broken character.

    The pieces returned by ``push`` and ``flush`` concatenate to exactly ``decode(all ids)``: bytes of an
    unfinished UTF-8 character, and spaces the clean-up may still remove, are held back until the next token
    decides them.
    """

    def __init__(self, pieces: Sequence[bytes], hidden: frozenset[int], strip_first_space: bool, clean: bool):
        self._pieces, self._hidden = pieces, hidden
        self._strip_space, self._clean = strip_first_space, clean
        self._first = True
        self._pending = b""  # raw bytes the clean-up has not seen yet
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        piece = b"" if token_id in self._hidden else self._pieces[token_id]
        if self._first:
            self._first = False
            if self._strip_space and piece.startswith(b" "):
                piece = piece[1:]
        if not self._clean:
            return self._utf8.decode(piece)
        data = self._pending + piece
        cut = len(data)
        while cut and data[cut - 1] in _CLEAN_ALPHABET:
            cut -= 1
        self._pending = data[cut:]
        return self._utf8.decode(clean_spaces(data[:cut]) if cut else b"")

    def flush(self) -> str:
        """The text still held back; call once at the end of the stream."""
        rest = clean_spaces(self._pending) if self._clean else b""
        self._pending = b""
        return self._utf8.decode(rest, final=True)
