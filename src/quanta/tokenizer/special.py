"""Splitting special-token text out of the input before BPE (``tokenizer_st_partition`` in llama.cpp).

Special tokens are taken longest first; each one is searched in every text fragment left so far and cuts it
into text / token / text. User-defined tokens (Gemma's newline and tab runs, ...) are always split out;
control and unknown tokens (``<|im_start|>``, ``<bos>``) only when ``parse_special`` is set.
"""

from __future__ import annotations

import re

from quanta.tokenizer.vocab import TokenAttr, Vocab

Fragment = str | int  # raw text, or a token id already decided


class _Specials:
    """Special tokens in partition order, with a character trie to find which of them occur in a text."""

    def __init__(self, texts_and_ids: list[tuple[str, int]]):
        self.ordered = texts_and_ids
        self.trie: dict = {}
        for text, token_id in texts_and_ids:
            node = self.trie
            for ch in text:
                node = node.setdefault(ch, {})
            node.setdefault(None, token_id)  # duplicate texts: the first in partition order wins the lookup
        starts = "".join(sorted(self.trie))
        self.start = re.compile(f"[{re.escape(starts)}]") if starts else None

    def present(self, text: str) -> set[int]:
        """Ids of the special tokens that occur anywhere in ``text`` (overlaps included)."""
        found: set[int] = set()
        if self.start is None:
            return found
        trie, n = self.trie, len(text)
        for m in self.start.finditer(text):
            node, i = trie, m.start()
            while i < n:
                node = node.get(text[i])
                if node is None:
                    break
                i += 1
                if None in node:
                    found.add(node[None])
        return found


class SpecialSplitter:
    """Partitions text into raw fragments and special token ids, llama.cpp's way."""

    def __init__(self, vocab: Vocab):
        skip = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)
        ordered = [(vocab.tokens[i], i, bool(vocab.attrs[i] & skip)) for i in vocab.special_tokens]
        self._all = _Specials([(text, i) for text, i, _ in ordered])
        self._always = _Specials([(text, i) for text, i, control in ordered if not control])

    def split(self, text: str, parse_special: bool) -> list[Fragment]:
        if not text:
            return []
        specials = self._all if parse_special else self._always
        present = specials.present(text)
        fragments: list[Fragment] = [text]
        if not present:
            return fragments
        for special, token_id in specials.ordered:
            if token_id not in present:
                continue
            out: list[Fragment] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    out.append(fragment)
                    continue
                parts = fragment.split(special)
                for k, part in enumerate(parts):
                    if k:
                        out.append(token_id)
                    if part:
                        out.append(part)
            fragments = out
        return fragments
