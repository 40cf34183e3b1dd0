"""Small vocab-only GGUFs written with our writer: byte-level BPE vocabularies trained here, and a SentencePiece one.

Merges are learned by plain greedy BPE on the test corpus, pre-tokenized with the ``regex`` module (an
implementation independent of both llama.cpp and HF tokenizers). The files carry the minimal ``llama.*`` keys
llama.cpp needs to open them with ``vocab_only=True``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import regex

from quanta.gguf import typed, write_gguf
from quanta.tokenizer.detokenize import gpt2_byte_decoder
from quanta.tokenizer.pretokenize import PRE_TOKENIZERS

from tok_corpus import SAMPLES, mixed_text

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def _train(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    words = Counter({tuple(w): c for w, c in words.items()})
    merges = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        merged = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return merges


def _training_text() -> str:
    return mixed_text(24_000, seed=7) + " ".join(SAMPLES)


def _llama_keys() -> dict:
    return {"general.architecture": "llama", "general.name": "synthetic", "llama.context_length": typed(256, "UINT32"),
            "llama.embedding_length": typed(64, "UINT32"), "llama.block_count": typed(1, "UINT32"),
            "llama.feed_forward_length": typed(128, "UINT32"), "llama.attention.head_count": typed(4, "UINT32"),
            "llama.attention.head_count_kv": typed(4, "UINT32"), "llama.rope.dimension_count": typed(16, "UINT32"),
            "llama.attention.layer_norm_rms_epsilon": typed(1e-5, "FLOAT32")}


def write_bpe_vocab(path: Path, pre: str, n_merges: int = 300, whole_words: int = 40) -> Path:
    """A byte-level BPE vocab: byte symbols (a few missing), trained merges, specials; plus ``whole_words`` frequent
    pieces added as tokens without merges (only an ``ignore_merges`` pre-tokenizer can produce them)."""
    byte_chars = sorted(gpt2_byte_decoder(), key=gpt2_byte_decoder().get)
    # like real vocabularies, some bytes never seen in training have no token
    missing = {byte_chars[b] for b in (0x04, 0x06, 0x13, 0x7F, 0xC0, 0xC1, *range(0xF5, 0x100))}
    pieces: Counter = Counter()
    text = _training_text()
    for piece in _pretokenize(text, PRE_TOKENIZERS[pre].regexes):
        encoded = "".join(byte_chars[b] for b in piece.encode())
        if not missing.intersection(encoded):
            pieces[encoded] += 1
    merges = _train(pieces, n_merges)
    specials = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                ("<|begin_of_text|>", CONTROL), ("<tool>", USER_DEFINED), ("<|eot_id|>", CONTROL)]
    tokens = [t for t, _ in specials] + [c for c in byte_chars if c not in missing]
    types = [ty for _, ty in specials] + [NORMAL] * (256 - len(missing))
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(NORMAL)
    extra = [w for w, _ in pieces.most_common() if w not in tokens and len(w) > 3][:whole_words]
    tokens += extra
    types += [NORMAL] * len(extra)
    metadata = {**_llama_keys(), "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": typed(types, "INT32"),
                "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
                "tokenizer.ggml.bos_token_id": typed(tokens.index("<|begin_of_text|>"), "UINT32"),
                "tokenizer.ggml.eos_token_id": typed(0, "UINT32")}
    write_gguf(path, metadata, [])
    return path


def _pretokenize(text: str, regexes: tuple[str, ...]) -> list[str]:
    pieces = [text]
    for pattern in regexes:
        compiled = regex.compile(pattern)
        out = []
        for piece in pieces:
            last = 0
            for m in compiled.finditer(piece):
                if m.start() > last:
                    out.append(piece[last:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                last = m.end()
            if last < len(piece):
                out.append(piece[last:])
        pieces = out
    return pieces


def write_spm_vocab(path: Path, n_merges: int = 400, add_space_prefix: bool = True) -> Path:
    """A SentencePiece-style vocab: <unk> <s> </s>, 256 byte tokens, the training text's characters, then
    pieces merged across '▁'-prefixed words, scored by merge order (byte fallback covers everything else)."""
    text = _training_text()
    words = Counter("▁" + w for w in text.replace("\n", " ").split(" ") if w)
    merges = _train(words, n_merges)
    chars = sorted({ch for w in words for ch in w})
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for ch in chars[:400]:
        tokens.append(ch)
        types.append(NORMAL)
        scores.append(-1e4)
    for rank, (a, b) in enumerate(merges):
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(NORMAL)
            scores.append(-float(rank))
    tokens.append("\n\n")
    types.append(USER_DEFINED)
    scores.append(0.0)
    metadata = {**_llama_keys(), "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": typed(scores, "FLOAT32"), "tokenizer.ggml.token_type": typed(types, "INT32"),
                "tokenizer.ggml.bos_token_id": typed(1, "UINT32"), "tokenizer.ggml.eos_token_id": typed(2, "UINT32"),
                "tokenizer.ggml.unknown_token_id": typed(0, "UINT32"),
                "tokenizer.ggml.add_space_prefix": add_space_prefix}
    write_gguf(path, metadata, [])
    return path
