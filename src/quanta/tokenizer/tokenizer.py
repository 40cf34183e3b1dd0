"""``Tokenizer``: text to token ids and back, with the ids llama.cpp's ``llama_tokenize`` produces.

The flow mirrors ``llama_vocab::impl::tokenize``: special-token text is split out first, each raw fragment
goes through the BPE engine (SentencePiece fragments get llama.cpp's space handling: ``' '`` becomes ``'▁'``
and, with ``add_space_prefix``, a fragment at the start or after a special token gets a leading space), and
BOS/EOS are added as the GGUF asks when ``add_special`` is set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from quanta.errors import ContextOverflowError
from quanta.gguf.reader import architecture_of
from quanta.tokenizer.bpe_engine import Engine, load_engine
from quanta.tokenizer.detokenize import StreamDecoder, TokenPieces, clean_spaces
from quanta.tokenizer.errors import RenderTooLongError, TokenizerError
from quanta.tokenizer.special import SpecialSplitter
from quanta.tokenizer.vocab import TokenAttr, Vocab, load_vocab


class Tokenizer:
    """A GGUF's tokenizer: ``encode``/``decode`` with llama.cpp's semantics, streaming decode, chat templates."""

    def __init__(self, vocab: Vocab, chat_template: str | None, architecture: str | None,
                 cache_dir: Path | None = None):
        self.vocab = vocab
        self._cache_dir = cache_dir
        self._engine: Engine | None = None  # built on first encode: generating from token ids never needs it
        self._splitter: SpecialSplitter | None = None  # also built on first encode
        self.pieces = TokenPieces(vocab)
        hidden = vocab.attrs & int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)
        self._hidden = frozenset(hidden.nonzero()[0].tolist())
        self.has_chat_template = bool(chat_template)
        self._template_source, self._architecture = chat_template, architecture
        self._chat: Any = None  # a ChatTemplate compiled on first use: a broken template only breaks chat

    # --- properties -------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def bos_id(self) -> int | None:
        return self.vocab.special["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.special["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.special["eot"]

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation (eos, eot, ``<|im_end|>``, ``<end_of_turn>``, ... as llama.cpp finds them)."""
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    # --- encoding ---------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS/EOS as the GGUF says, ``parse_special`` turns
        control-token text such as ``<|im_start|>`` into that token (user-defined tokens always are).
        ``max_tokens``: a text too long to fit in that many tokens is refused before it is tokenized."""
        self._check_length(text, max_tokens)
        vocab = self.vocab
        if self._splitter is None:
            self._splitter = SpecialSplitter(self.vocab)
        fragments = self._splitter.split(text, parse_special)
        out: list[int] = []
        if add_special and vocab.add_bos:
            self._require("bos")
            out.append(vocab.special["bos"])
        texts = self._spm_texts(fragments) if vocab.kind == "spm" else [f for f in fragments if isinstance(f, str)]
        try:
            encoded = iter(self.engine.encode(texts))
        except TypeError:
            _check_unicode(text)
            raise
        for fragment in fragments:
            out.extend(next(encoded) if isinstance(fragment, str) else (fragment,))
        if add_special and vocab.add_eos:
            self._require("eos")
            out.append(vocab.special["eos"])
        return out

    @property
    def engine(self) -> Engine:
        """The BPE engine (HF ``tokenizers``), built on first use: 0.06 s for 49k tokens, 0.7 s for 262k."""
        if self._engine is None:
            self._engine = load_engine(self.vocab, self._cache_dir)
        return self._engine

    def _spm_texts(self, fragments: list) -> list[str]:
        """SentencePiece fragments as llama.cpp feeds them: spaces escaped, a leading space where needed."""
        texts, prev_special = [], True
        for fragment in fragments:
            if isinstance(fragment, str):
                prefix = " " if self.vocab.add_space_prefix and prev_special else ""
                texts.append((prefix + fragment).replace(" ", "▁"))
                prev_special = False
            else:
                prev_special = True
        return texts

    def max_chars(self, max_tokens: int) -> int:
        """The longest text that could encode to ``max_tokens`` tokens (each at most the longest token's text;
        characters the vocabulary drops as unknown are the one way past it)."""
        return max_tokens * max(self.vocab.max_token_chars, 1)

    def _check_length(self, text: str, max_tokens: int | None) -> None:
        if max_tokens is not None and len(text) > self.max_chars(max_tokens):
            raise ContextOverflowError(
                f"the text has {len(text):,} characters, more than {max_tokens:,} tokens of this vocabulary can "
                f"hold (its longest token has {self.vocab.max_token_chars} characters); shorten it or raise n_ctx")

    def _require(self, name: str) -> None:
        if self.vocab.special[name] is None:
            raise TokenizerError(f"the tokenizer asks for a {name.upper()} token but defines none")

    # --- decoding ---------------------------------------------------------------------------------------
    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes of one token (possibly part of a UTF-8 character); control tokens are b"" unless
        ``special``."""
        if not 0 <= token_id < self.vocab.size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self.vocab.size})")
        return b"" if not special and token_id in self._hidden else self.pieces[token_id]

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        """``decode`` before the UTF-8 decoding (what ``llama_detokenize`` writes)."""
        pieces, n = self.pieces, self.vocab.size
        if len(ids) and not (0 <= min(ids) and max(ids) < n):
            bad = next(i for i in ids if not 0 <= i < n)
            raise TokenizerError(f"token id {bad} is outside the vocabulary (size {n})")
        if skip_special:
            hidden = self._hidden
            data = b"".join(b"" if i in hidden else pieces[i] for i in ids)
            first = b"" if not ids or ids[0] in hidden else pieces[ids[0]]
        else:
            data = b"".join([pieces[i] for i in ids])
            first = pieces[ids[0]] if ids else b""
        if self.vocab.add_space_prefix and first.startswith(b" "):
            data = data[1:]
        return clean_spaces(data) if self.vocab.clean_spaces else data

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ``ids`` (llama.cpp's ``llama_detokenize``); invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False, clean: bool = True) -> StreamDecoder:
        """An incremental decoder whose pieces concatenate to ``decode(all ids, skip_special)``; ``clean=False``
        keeps the spaces a GPT-2 style vocabulary's clean-up removes (" ?", " 's"): constrained output must be the
        exact bytes its grammar accepted."""
        hidden = self._hidden if skip_special else frozenset()
        return StreamDecoder(self.pieces, hidden, self.vocab.add_space_prefix, clean and self.vocab.clean_spaces)

    # --- chat -------------------------------------------------------------------------------------------
    def token_text(self, name: str) -> str:
        token_id = self.vocab.special.get(name)
        return self.vocab.tokens[token_id] if token_id is not None else ""

    @property
    def chat_template(self) -> str:
        """The GGUF's template source, else the built-in one for the architecture."""
        if self._template_source:
            return self._template_source
        from quanta.tokenizer.chat_template import builtin_template  # jinja2 loads only for chat

        return builtin_template(self._architecture, self.vocab.token_to_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None) -> str:
        """The prompt text for ``messages`` (the GGUF's template, else a built-in one for the architecture);
        with ``max_tokens``, a render too long for that many tokens stops as soon as it gets there."""
        from quanta.tokenizer.chat_template import MAX_OUTPUT, ChatTemplate  # jinja2 loads only for chat

        if self._chat is None:
            self._chat = ChatTemplate(self.chat_template)
        limit = MAX_OUTPUT if max_tokens is None else min(MAX_OUTPUT, self.max_chars(max_tokens))
        try:
            return self._chat.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     bos_token=self.token_text("bos"), eos_token=self.token_text("eos"),
                                     max_chars=limit)
        except RenderTooLongError:
            if max_tokens is None or limit == MAX_OUTPUT:
                raise
            raise ContextOverflowError(
                f"the chat renders to more than {limit:,} characters, more than {max_tokens:,} tokens of this "
                "vocabulary can hold; shorten the conversation or raise n_ctx") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids of the rendered chat, special tokens parsed; no second BOS when the template wrote one.
        ``max_tokens``: a chat that cannot fit in that many tokens is refused before it is tokenized."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, max_tokens)
        ids = self.encode(text, add_special=True, parse_special=True)
        bos = self.bos_id
        if self.vocab.add_bos and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            del ids[0]
        return ids


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"text is not valid Unicode: {e.reason} at character {e.start}") from None


def load_tokenizer(model: Any, *, cache_dir: str | os.PathLike | None = None,
                   home: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer of ``model``: a GGUF path, a known model name, or an open ``quanta.gguf.GGUFFile``;
    derived merges are cached in ``cache_dir`` (default: ``tokenizers/`` in the quanta ``home``)."""
    from quanta import gguf
    from quanta.hub import quanta_home, resolve_model

    cache = Path(cache_dir) if cache_dir is not None else quanta_home(home) / "tokenizers"
    if isinstance(model, gguf.GGUFFile):
        return _from_metadata(model.metadata, cache)
    with gguf.open(resolve_model(model, home=home)) as f:
        return _from_metadata(f.metadata, cache)


def _from_metadata(metadata: dict[str, Any], cache: Path) -> Tokenizer:
    vocab = load_vocab(metadata)
    return Tokenizer(vocab, metadata.get("tokenizer.chat_template"), architecture_of(metadata, required=False), cache)
