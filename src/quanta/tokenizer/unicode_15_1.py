"""Byte-level pre-tokenizer pieces for text holding characters that Unicode 15.1 leaves unassigned.

llama.cpp classifies characters by its Unicode 15.1 tables, where a character added since (Garay, Egyptian
hieroglyphs from U+13460, Emoji 16.0 such as U+1FAE9) is undefined: neither letter, number nor space. The
``Split`` regexes of HF tokenizers use newer tables, where it may be a letter. Such text is split on a copy with
each of those characters replaced by U+FFFF, a noncharacter every Unicode version leaves unassigned, and the
original text is cut at the same places (character offsets; the replacement keeps every character's position).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_PAGE_BITS = 8  # categories are looked up 256 code points at a time, when a text first reaches them
_UNASSIGNED, _UNKNOWN = 1, 2  # a code point's flags: unassigned in Unicode 15.1, not looked up yet
_NONCHARACTER = 0xFFFF


class Unicode151Splitter:
    """llama.cpp's pre-tokenizer pieces for text its Unicode 15.1 tables classify differently from HF's."""

    def __init__(self, splits: Any):
        self.splits = splits  # pre_tokenizers.Sequence of the Split regexes, without ByteLevel
        self._flags = np.full(0x110000, _UNKNOWN, dtype=np.uint8)

    def pieces(self, text: str) -> list[str] | None:
        """The pieces llama.cpp pre-tokenizes ``text`` into, or None when no character of it is unassigned in
        Unicode 15.1 (the regular ``Split`` pre-tokenizers then give the same pieces)."""
        if text.isascii():
            return None
        try:
            codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        except UnicodeEncodeError:  # lone surrogates: the regular path rejects the text
            return None
        flags = self._flags.take(codepoints)  # take and count_nonzero: the cheapest calls on a short text
        if not np.count_nonzero(flags):  # the common case: every character known to be assigned
            return None
        if (flags & _UNKNOWN).any():
            self._look_up(codepoints[(flags & _UNKNOWN) != 0])
            flags = self._flags.take(codepoints)
            if not np.count_nonzero(flags):
                return None
        masked = np.where(flags != 0, np.uint32(_NONCHARACTER), codepoints).astype("<u4").tobytes()
        splits = self.splits.pre_tokenize_str(masked.decode("utf-32-le"))
        return [text[start:end] for _, (start, end) in splits]

    def _look_up(self, codepoints: np.ndarray) -> None:
        """Flags every page of 256 code points that holds one of ``codepoints``."""
        import unicodedata2  # on first use: ASCII-only and SentencePiece users never need it

        for page in np.unique(codepoints >> _PAGE_BITS).tolist():
            first, end = page << _PAGE_BITS, (page + 1) << _PAGE_BITS
            self._flags[first:end] = [_UNASSIGNED if unicodedata2.category(chr(c)) == "Cn" else 0
                                      for c in range(first, end)]
