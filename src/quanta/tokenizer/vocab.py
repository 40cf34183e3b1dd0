"""The tokenizer's vocabulary as llama.cpp reads it from GGUF metadata (``llama_vocab::impl::load``).

Everything llama.cpp derives at load time lives here: the token attributes (from ``tokenizer.ggml.token_type``,
with control-looking tokens such as ``<|im_end|>`` forced to CONTROL), the special ids and their per-kind
defaults, the add-BOS/EOS and space flags, the end-of-generation set, and the special tokens that
``tokenize`` splits out before running the model (longest first).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from quanta.tokenizer.errors import TokenizerError
from quanta.tokenizer.pretokenize import pre_tokenizer_for


class TokenAttr(enum.IntFlag):
    """llama.cpp's ``llama_token_attr`` bits."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# tokenizer.ggml.token_type value -> attribute (anything else is UNDEFINED)
_TYPE_TO_ATTR = {1: TokenAttr.NORMAL, 2: TokenAttr.UNKNOWN, 3: TokenAttr.CONTROL, 4: TokenAttr.USER_DEFINED,
                 5: TokenAttr.UNUSED, 6: TokenAttr.BYTE}

# The longest token text accepted, in UTF-8 bytes. llama.cpp has no limit, but real vocabularies stay under 200
# bytes (SmolLM2: 162, Gemma 3: 48), and deriving SentencePiece merges costs the square of a token's length: a
# 5 MB token would take hours.
MAX_TOKEN_BYTES = 1024

# Texts llama.cpp recognises as end-of-turn / FIM tokens when the GGUF does not name them (forced to CONTROL).
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
             "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "<|code_prefix|>",
                "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "<|code_suffix|>",
                "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "<|code_middle|>",
                "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Texts that end generation wherever they appear in the vocabulary (forced to CONTROL).
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>")

_SPECIAL_ID_KEYS = {
    "bos": ("bos_token_id",), "eos": ("eos_token_id",), "eot": ("eot_token_id",), "eom": ("eom_token_id",),
    "unk": ("unknown_token_id",), "sep": ("seperator_token_id",), "pad": ("padding_token_id",),
    "mask": ("mask_token_id",), "fim_pre": ("fim_pre_token_id", "prefix_token_id"),
    "fim_suf": ("fim_suf_token_id", "suffix_token_id"), "fim_mid": ("fim_mid_token_id", "middle_token_id"),
    "fim_pad": ("fim_pad_token_id",), "fim_rep": ("fim_rep_token_id",), "fim_sep": ("fim_sep_token_id",),
}


@dataclass
class Vocab:
    """The GGUF vocabulary with llama.cpp's derived flags; ``kind`` is "spm" (model "llama") or "bpe" ("gpt2")."""

    kind: str
    pre: str  # tokenizer.ggml.pre as written ("" when absent)
    tokens: list[str]
    scores: np.ndarray | None
    attrs: np.ndarray  # int32 TokenAttr bits per id
    merges: list[str]
    token_to_id: dict[str, int]
    special: dict[str, int | None]  # bos, eos, eot, eom, unk, ... -> id or None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    ignore_merges: bool
    regexes: tuple[str, ...]  # pre-tokenizer regexes (BPE only)
    eog_ids: frozenset[int] = frozenset()
    special_tokens: list[int] = field(default_factory=list)  # partition order: longest text first
    max_token_chars: int = 0  # the longest token text: a text of n characters is at least n / this many tokens

    @property
    def size(self) -> int:
        return len(self.tokens)


def _token_attrs(token_types: Any, n: int) -> np.ndarray:
    if token_types is None:
        return np.full(n, int(TokenAttr.NORMAL), dtype=np.int32)
    types = np.asarray(token_types, dtype=np.int64)
    if types.shape != (n,):
        raise TokenizerError(f"tokenizer.ggml.token_type has {types.size} entries for {n} tokens")
    lut = np.zeros(8, dtype=np.int32)
    for t, a in _TYPE_TO_ATTR.items():
        lut[t] = int(a)
    return np.where((types >= 0) & (types < 8), lut[np.clip(types, 0, 7)], 0).astype(np.int32)


def _c_strings(strings: list[str]) -> list[str]:
    """llama.cpp reads GGUF strings as C strings: a NUL ends them."""
    if "\x00" not in "".join(strings):
        return strings
    return [w.partition("\x00")[0] for w in strings]


def load_vocab(metadata: Mapping[str, Any]) -> Vocab:
    """Build the vocabulary from GGUF metadata, following ``llama_vocab::impl::load`` step by step."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("the GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    pre = metadata.get("tokenizer.ggml.pre", "") or ""
    if model == "llama":
        kind, special = "spm", {"bos": 1, "eos": 2, "unk": 0}
        add_space_prefix, clean_spaces, add_bos, add_eos, ignore_merges = True, False, True, False, False
        regexes: tuple[str, ...] = ()
    elif model == "gpt2":
        kind, special = "bpe", {"bos": 11, "eos": 11, "unk": None}
        add_space_prefix, add_bos, add_eos = False, False, False
        pre_tok = pre_tokenizer_for(pre)
        regexes, clean_spaces, ignore_merges = pre_tok.regexes, pre_tok.clean_spaces, pre_tok.ignore_merges
        add_bos = add_bos or pre_tok.add_bos
    else:
        raise TokenizerError(f"tokenizer model {model!r} is not supported (quanta implements 'llama' (SentencePiece)"
                             " and 'gpt2' (byte-level BPE))")
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", add_space_prefix))

    raw_tokens = metadata.get("tokenizer.ggml.tokens")
    if not raw_tokens:
        raise TokenizerError("the GGUF has no token list (tokenizer.ggml.tokens)")
    raw_tokens = _c_strings(raw_tokens)
    tokens = [w if w else f"[EMPTY_{i}]" for i, w in enumerate(raw_tokens)] if "" in raw_tokens else list(raw_tokens)
    max_token_chars = _check_token_lengths(tokens)
    n = len(tokens)
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is not None:
        scores = np.array(scores, dtype=np.float32)  # a copy: the file may be closed after loading
        if scores.shape != (n,):
            raise TokenizerError(f"tokenizer.ggml.scores has {scores.size} entries for {n} tokens")
    attrs = _token_attrs(metadata.get("tokenizer.ggml.token_type"), n)
    token_to_id = dict(zip(tokens, range(n)))
    merges = _c_strings(list(metadata.get("tokenizer.ggml.merges") or []))
    if kind == "bpe" and "tokenizer.ggml.merges" not in metadata:
        raise TokenizerError("a gpt2 (BPE) tokenizer needs tokenizer.ggml.merges, which the GGUF lacks")

    ids: dict[str, int | None] = {k: special.get(k) for k in _SPECIAL_ID_KEYS}
    ids = {k: v if v is not None and v < n else None for k, v in ids.items()}  # defaults a tiny vocab lacks
    for name, keys in _SPECIAL_ID_KEYS.items():
        for key in keys:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if isinstance(value, (int, np.integer)) and 0 <= int(value) < n:
                ids[name] = int(value)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", add_eos))

    def force_control(token_id: int) -> None:
        attrs[token_id] |= int(TokenAttr.CONTROL)

    detect = {"eot": EOT_TEXTS, "eom": EOM_TEXTS, **FIM_TEXTS}
    for name, texts in detect.items():
        if ids[name] is None:
            found = [token_to_id[t] for t in texts if t in token_to_id]
            if found:
                ids[name] = found[0]
                force_control(found[0])
    for token_id in np.nonzero(attrs & int(TokenAttr.CONTROL))[0].tolist():  # control "unused" tokens are unused
        if "unused" in tokens[token_id]:
            attrs[token_id] |= int(TokenAttr.UNUSED)
    eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
    for text in EOG_TEXTS:
        if text in token_to_id:
            eog.add(token_to_id[text])
            force_control(token_to_id[text])
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
        if text in token_to_id:
            attrs[token_to_id[text]] = int(TokenAttr.USER_DEFINED)
    eog.update(ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None)
    _drop_false_eog(eog, tokens, attrs)

    special_mask = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)
    special_ids = np.nonzero(attrs & special_mask)[0].tolist()
    special_ids.sort(key=lambda i: -len(tokens[i].encode()))
    return Vocab(kind=kind, pre=pre, tokens=tokens, scores=scores, attrs=attrs, merges=merges,
                 token_to_id=token_to_id, special=ids, add_bos=add_bos, add_eos=add_eos,
                 add_space_prefix=add_space_prefix, clean_spaces=clean_spaces, ignore_merges=ignore_merges,
                 regexes=regexes, eog_ids=frozenset(eog), special_tokens=special_ids, max_token_chars=max_token_chars)


def _check_token_lengths(tokens: list[str]) -> int:
    """The longest token's length in characters; a token over ``MAX_TOKEN_BYTES`` is a ``TokenizerError``."""
    longest = max(map(len, tokens))
    if longest * 4 > MAX_TOKEN_BYTES:  # a character is at most 4 bytes: only then count bytes
        for i, token in enumerate(tokens):
            if len(token) * 4 > MAX_TOKEN_BYTES and len(token.encode("utf-8", "surrogatepass")) > MAX_TOKEN_BYTES:
                raise TokenizerError(f"token {i} is {len(token.encode('utf-8', 'surrogatepass')):,} bytes long; "
                                     f"quanta accepts tokens of at most {MAX_TOKEN_BYTES:,} bytes (real vocabularies "
                                     "stay under 200)")
    return longest


def _drop_false_eog(eog: set[int], tokens: list[str], attrs: np.ndarray) -> None:
    """llama.cpp's workarounds: ``<|end|>`` is not EOG next to ``<|return|>``/``<|call|>`` (gpt-oss, solar-open),
    and ``</s>`` is plain text next to ``<|tool_response>`` (Gemma 4)."""
    by_text = {tokens[i]: i for i in eog}
    if "<|end|>" in by_text and (("<|return|>" in by_text and ("<|call|>" in by_text or "<|calls|>" in by_text))
                                 or (("<|call|>" in by_text or "<|calls|>" in by_text) and "<|flush|>" in by_text)):
        eog.discard(by_text["<|end|>"])
        attrs[by_text["<|end|>"]] = int(TokenAttr.USER_DEFINED)
    if "<|tool_response>" in by_text and "</s>" in by_text:
        eog.discard(by_text["</s>"])
        attrs[by_text["</s>"]] = int(TokenAttr.NORMAL)
