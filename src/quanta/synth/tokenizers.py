"""Synthetic tokenizers of the right kind and size: byte-level BPE (GPT-2 style) and SentencePiece (llama).

Both are complete and valid: every byte has a token (so any text round-trips), BPE merges only join existing
tokens into new ones, SPM pieces carry decreasing scores. The vocabulary is random but shaped like a real one
(short pieces of letters, with and without the word-start marker), which is all speed work needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quanta.gguf import ValueType, typed
from quanta.synth.presets import BYTE, CONTROL, NORMAL, UNUSED, TokenizerPreset

_MAX_PIECE_CHARS = 12


def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character standing for each byte, in GPT-2's token order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in printable] + [chars[b] for b in range(256) if b not in printable]


def _grow(base: list[str], left: list[str], right: list[str], n_total: int, rng: np.random.Generator
          ) -> tuple[list[str], list[tuple[str, str]]]:
    """Append joins ``a + b`` of a word-like token ``a`` and a short letter-like token ``b`` to ``base`` until
    ``n_total`` tokens; returns the tokens and the (a, b) pairs in order (the BPE merges)."""
    tokens = list(base)
    seen = set(tokens)
    left, right = list(left), list(right)
    pairs: list[tuple[str, str]] = []
    while len(tokens) < n_total:
        for i, j in zip(rng.integers(0, len(left), 4096).tolist(), rng.integers(0, len(right), 4096).tolist()):
            a, b = left[i], right[j]
            t = a + b
            if len(t) > _MAX_PIECE_CHARS or t in seen:
                continue
            seen.add(t)
            tokens.append(t)
            left.append(t)
            pairs.append((a, b))
            if len(t) <= 3 and t.isascii() and t.isalpha() and t.islower():
                right.append(t)
            if len(tokens) == n_total:
                break
    return tokens, pairs


def _layout(spec: TokenizerPreset, n_regular_slots: int, vocab_size: int) -> int:
    n = vocab_size - len(spec.specials) - spec.pad_tokens
    if n < n_regular_slots:
        raise ValueError(f"vocabulary of {vocab_size} is too small for {len(spec.specials)} special tokens "
                         f"and {n_regular_slots} byte tokens")
    return n


def _ids(spec: TokenizerPreset, tokens: list[str]) -> dict[str, Any]:
    index = {t: i for i, t in enumerate(tokens)}
    out: dict[str, Any] = {"tokenizer.ggml.bos_token_id": index[spec.bos], "tokenizer.ggml.eos_token_id": index[spec.eos]}
    if spec.unk is not None:
        out["tokenizer.ggml.unknown_token_id"] = index[spec.unk]
    if spec.pad is not None:
        out["tokenizer.ggml.padding_token_id"] = index[spec.pad]
    out["tokenizer.ggml.add_bos_token"] = spec.add_bos
    if spec.add_space_prefix is not None:
        out["tokenizer.ggml.add_space_prefix"] = spec.add_space_prefix
    if spec.chat_template is not None:
        out["tokenizer.chat_template"] = spec.chat_template
    return out


def bpe_tokenizer(spec: TokenizerPreset, vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """GGUF tokenizer metadata of a byte-level BPE vocabulary (tokens, token_type, merges) of ``vocab_size``."""
    rng = np.random.default_rng(seed)
    alphabet = gpt2_byte_alphabet()
    n_regular = _layout(spec, len(alphabet), vocab_size)
    letters = list("abcdefghijklmnopqrstuvwxyzeeeaaiioonnrrsstt")
    left = list("abcdefghijklmnopqrstuvwxyzĠĠĠĠĠĠABCDEFGHIJKLMNOPRSTW")
    regular, pairs = _grow(alphabet, left, letters, n_regular, rng)
    specials = [t for t, _ in spec.specials]
    special_types = [ty for _, ty in spec.specials]
    pads = [f"[PAD{n_regular + len(specials) + i}]" for i in range(spec.pad_tokens)]
    if spec.specials_first:
        tokens = specials + regular + pads
        types = special_types + [NORMAL] * len(regular) + [UNUSED] * len(pads)
    else:
        tokens = regular + specials + pads
        types = [NORMAL] * len(regular) + special_types + [UNUSED] * len(pads)
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": spec.pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": typed(np.array(types, dtype=np.int32), ValueType.INT32),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in pairs], **_ids(spec, tokens),
    }


def spm_tokenizer(spec: TokenizerPreset, vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """GGUF tokenizer metadata of a SentencePiece vocabulary: specials, <0xNN> byte tokens, scored pieces."""
    rng = np.random.default_rng(seed)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    n_pieces = _layout(spec, 256, vocab_size) - 256
    chars = list("▁etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,!?'-:;()")
    letters = list("etaoinshrdlcumwfgypbvkjxqzeeeaaiioonnrrsstt")
    pieces, _ = _grow(chars[: min(n_pieces, len(chars))], list("▁▁▁▁▁▁▁▁TAISCMW"), letters, n_pieces, rng)
    tokens = [t for t, _ in spec.specials] + byte_tokens + pieces
    types = [ty for _, ty in spec.specials] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = np.concatenate([np.where(np.array([ty for _, ty in spec.specials]) == CONTROL, -1000.0, 0.0),
                             np.zeros(256), -np.arange(len(pieces), dtype=np.float64)]).astype(np.float32)
    return {
        "tokenizer.ggml.model": "llama", **({"tokenizer.ggml.pre": spec.pre} if spec.pre else {}),
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": typed(scores, ValueType.FLOAT32),
        "tokenizer.ggml.token_type": typed(np.array(types, dtype=np.int32), ValueType.INT32), **_ids(spec, tokens),
    }


def synthetic_tokenizer(spec: TokenizerPreset, vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """The tokenizer metadata for a preset: BPE or SPM by ``spec.kind``."""
    return (bpe_tokenizer if spec.kind == "gpt2" else spm_tokenizer)(spec, vocab_size, seed)
