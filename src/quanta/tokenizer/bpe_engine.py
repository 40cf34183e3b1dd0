"""The BPE engine behind ``Tokenizer.encode``: an HF ``tokenizers`` BPE model built from the GGUF vocabulary.

Byte-level BPE ("gpt2"): the GGUF merges in rank order, llama.cpp's pre-tokenizer regexes (on llama.cpp's
Unicode 15.1 classes: ``unicode_15_1``), then GPT-2's byte-to-unicode mapping. SentencePiece BPE ("llama"):
llama.cpp merges the adjacent pair whose concatenation is the highest-scoring token (leftmost first on ties) and
falls back to ``<0xNN>`` byte tokens for characters outside the vocabulary; that is BPE whose merges are every
split ``a + b`` of every token, ranked by the token's score, with byte fallback. Deriving those merges takes
about a second for a 262k vocabulary, so the derived merges are cached (token id pairs, .npy) under
``<quanta home>/tokenizers/``, keyed by a hash of the vocabulary.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from quanta.tokenizer.unicode_15_1 import Unicode151Splitter
from quanta.tokenizer.vocab import Vocab

ENGINE_VERSION = "1"  # bump when the way engines are built changes, to invalidate cached ones
CHUNK_CHARS = 1 << 14
# A space between an ASCII letter or digit and an ASCII letter: every llama.cpp pre-tokenizer regex ends a
# piece before such a space and starts the next piece at it, so text cut there pre-tokenizes the same.
_SAFE_CUT = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")


class Engine:
    """Encodes raw text fragments (already split from special tokens) into ids, in one parallel batch.

    A character missing from the vocabulary still blocks merges across it in llama.cpp and is then dropped
    (its bytes are not tokens); HF drops it before merging, so it is mapped to an extra token, ``unk_id``
    (one past the vocabulary), which is removed from the output. Byte-level engines carry ``unicode151``, which
    splits text holding characters added since Unicode 15.1 as llama.cpp does, and ``unsplit``, a tokenizer
    with the same BPE model and only the ByteLevel pre-tokenizer, which encodes those pieces.
    """

    def __init__(self, tokenizer: Any, unk_id: int, unicode151: Unicode151Splitter | None = None,
                 unsplit: Any = None):
        self.tokenizer, self.unk_id, self.unicode151, self.unsplit = tokenizer, unk_id, unicode151, unsplit

    @property
    def byte_level(self) -> bool:
        return self.unicode151 is not None

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Ids of each fragment; long byte-level fragments are cut where no pre-tokenizer piece can span the
        cut, so their parts encode independently (and in parallel)."""
        if not texts:
            return []
        chunks: list[str] = []
        owners: list[int] = []
        for k, text in enumerate(texts):
            parts = _safe_chunks(text) if self.byte_level else [text]
            chunks.extend(parts)
            owners.extend([k] * len(parts))
        encodings = self._encode_chunks(chunks)
        out: list[list[int]] = [[] for _ in texts]
        unk = self.unk_id
        for k, encoding in zip(owners, encodings):
            ids = encoding.ids
            out[k].extend(ids if unk not in ids else [i for i in ids if i != unk])
        return out

    def _encode_chunks(self, chunks: list[str]) -> list[Any]:
        """Encodings of ``chunks``; those llama.cpp splits by its Unicode 15.1 tables are encoded piece by piece."""
        pieces = [self.unicode151.pieces(c) for c in chunks] if self.unicode151 is not None else []
        if not any(pieces):
            return self.tokenizer.encode_batch_fast(chunks, add_special_tokens=False)
        regular = [i for i, p in enumerate(pieces) if p is None]
        presplit = [i for i, p in enumerate(pieces) if p is not None]
        encodings = dict(zip(regular, self.tokenizer.encode_batch_fast([chunks[i] for i in regular],
                                                                        add_special_tokens=False)))
        encodings.update(zip(presplit, self.unsplit.encode_batch_fast([pieces[i] for i in presplit],
                                                                       is_pretokenized=True, add_special_tokens=False)))
        return [encodings[i] for i in range(len(chunks))]


def _safe_chunks(text: str) -> list[str]:
    if len(text) <= 2 * CHUNK_CHARS:
        return [text]
    chunks, start = [], 0
    while len(text) - start > 2 * CHUNK_CHARS:
        m = _SAFE_CUT.search(text, start + CHUNK_CHARS)
        if m is None:
            break
        chunks.append(text[start:m.start()])
        start = m.start()
    chunks.append(text[start:])
    return chunks


def spm_merge_ids(vocab: Vocab) -> np.ndarray:
    """Every split of every token into two tokens, as (left id, right id) rows, best-scoring token first."""
    token_to_id, tokens = vocab.token_to_id, vocab.tokens
    scores = vocab.scores if vocab.scores is not None else np.zeros(len(tokens), dtype=np.float32)
    order = np.argsort(-scores, kind="stable")  # equal scores: lower id first
    pairs = []
    for token_id in order.tolist():
        text = tokens[token_id]
        if token_to_id[text] != token_id:  # a duplicate text: llama.cpp only ever finds the last one
            continue
        for k in range(1, len(text)):
            left = token_to_id.get(text[:k])
            if left is not None:
                right = token_to_id.get(text[k:])
                if right is not None:
                    pairs.append((left, right))
    return np.array(pairs, dtype=np.int32).reshape(-1, 2)


def bpe_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """The GGUF merges ("left right", split at the first space after the first byte), first rank wins."""
    seen: set[tuple[str, str]] = set()
    merges = []
    token_to_id = vocab.token_to_id
    for line in vocab.merges:
        pos = line.find(" ", 1)
        if pos < 0:
            continue
        pair = (line[:pos], line[pos + 1:])
        if pair in seen or pair[0] not in token_to_id or pair[1] not in token_to_id \
                or pair[0] + pair[1] not in token_to_id:
            continue
        seen.add(pair)
        merges.append(pair)
    return merges


def _unknown_marker(vocab: Vocab) -> str:
    marker = "\x00unknown"
    while marker in vocab.token_to_id:
        marker += "\x00"
    return marker


def build_engine(vocab: Vocab, spm_merges: np.ndarray | None = None) -> Engine:
    """The engine for ``vocab``; ``spm_merges`` are ``spm_merge_ids(vocab)`` when already known."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers  # 35 ms to import: only when encoding

    marker = _unknown_marker(vocab)
    token_to_id = {**vocab.token_to_id, marker: vocab.size}
    if vocab.kind == "spm":
        ids = spm_merge_ids(vocab) if spm_merges is None else spm_merges
        tokens = vocab.tokens
        merges = list(zip(map(tokens.__getitem__, ids[:, 0].tolist()), map(tokens.__getitem__, ids[:, 1].tolist())))
        model = models.BPE(vocab=token_to_id, merges=merges, byte_fallback=True, unk_token=marker)
        return Engine(Tokenizer(model), unk_id=vocab.size)
    model = models.BPE(vocab=token_to_id, merges=bpe_merges(vocab), ignore_merges=vocab.ignore_merges,
                       unk_token=marker)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in vocab.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer, unsplit = Tokenizer(model), Tokenizer(model)  # both hold the one BPE model, not copies of it
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    unsplit.pre_tokenizer = byte_level
    return Engine(tokenizer, vocab.size, Unicode151Splitter(pre_tokenizers.Sequence(splits)), unsplit)


def vocab_key(vocab: Vocab) -> str:
    h = hashlib.sha256(f"{ENGINE_VERSION}\0{vocab.kind}\0{vocab.ignore_merges}\0".encode())
    h.update("\0".join(vocab.regexes).encode())
    h.update("\0".join(vocab.tokens).encode())
    if vocab.scores is not None:
        h.update(vocab.scores.tobytes())
    h.update("\n".join(vocab.merges).encode())
    return h.hexdigest()[:32]


def load_engine(vocab: Vocab, cache_dir: Path | None) -> Engine:
    """The engine for ``vocab``; SentencePiece merges come from the cache when derived before."""
    if cache_dir is None or vocab.kind != "spm":
        return build_engine(vocab)
    path = cache_dir / f"spm-merges-{vocab_key(vocab)}.npy"
    merges = None
    if path.is_file():
        try:
            merges = np.load(path, allow_pickle=False)
        except (OSError, ValueError):  # a damaged cache entry is derived again below
            merges = None
    if merges is None or merges.ndim != 2 or merges.shape[1] != 2 or (merges.size and merges.max() >= vocab.size):
        merges = spm_merge_ids(vocab)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".npy")
            with os.fdopen(fd, "wb") as f:
                np.save(f, merges, allow_pickle=False)
            os.replace(tmp, path)
        except OSError:  # a read-only cache only costs load time
            pass
    return build_engine(vocab, merges)
