"""Absurd vocabularies fail at load, and texts that cannot fit a token budget are refused before tokenizing."""

from __future__ import annotations

import pytest

from quanta.errors import ContextOverflowError
from quanta.gguf import typed, write_gguf
from quanta.tokenizer import ChatTemplateError, TokenizerError, load_tokenizer
from quanta.tokenizer.vocab import MAX_TOKEN_BYTES

from tok_synthetic import BYTE, CONTROL, NORMAL, UNKNOWN, _llama_keys

FIVE_MB = 5 << 20


def _write_spm(path, extra: list[str]):
    """A SentencePiece vocab: specials, byte fallback, a few letters, then ``extra`` (longer scores higher)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "c"] + extra
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (4 + len(extra))
    scores = [0.0] * 259 + [-10.0] * 4 + [float(len(t)) for t in extra]
    write_gguf(path, {**_llama_keys(), "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                      "tokenizer.ggml.scores": typed(scores, "FLOAT32"),
                      "tokenizer.ggml.token_type": typed(types, "INT32"),
                      "tokenizer.ggml.bos_token_id": typed(1, "UINT32"),
                      "tokenizer.ggml.eos_token_id": typed(2, "UINT32"),
                      "tokenizer.ggml.unknown_token_id": typed(0, "UINT32")}, [])
    return path


def _write_bpe(path, extra: list[str]):
    tokens = [chr(c) for c in range(33, 127)] + extra
    write_gguf(path, {**_llama_keys(), "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
                      "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"]}, [])
    return path


@pytest.mark.timeout(120)  # the 5 MB token used to hang the SentencePiece merge derivation
@pytest.mark.parametrize("write", [_write_spm, _write_bpe])
@pytest.mark.parametrize("token", ["a" * FIVE_MB, "é" * (MAX_TOKEN_BYTES // 2 + 1)])
def test_a_token_longer_than_the_limit_fails_at_load(write, token, tmp_path):
    path = write(tmp_path / "v.gguf", ["ab", token])
    with pytest.raises(TokenizerError, match=f"token .* bytes long.*at most {MAX_TOKEN_BYTES:,}"):
        load_tokenizer(path, cache_dir=tmp_path / "cache")


def test_tokens_up_to_the_limit_tokenize_like_llama_cpp(tmp_path):
    from conftest import LlamaCppVocab

    runs = ["ab" * k for k in range(1, MAX_TOKEN_BYTES // 2 + 1)]  # every merge step up to 1,024 bytes
    path = _write_spm(tmp_path / "long.gguf", ["▁a", "ab▁"] + runs)
    tok, llama = load_tokenizer(path, cache_dir=tmp_path / "cache"), LlamaCppVocab(path)
    for text in ["ab" * 512, "ab" * 700 + " c ab", "c " + "ab" * 511 + "a", "abc" * 300]:
        assert tok.encode(text) == llama.tokenize(text, add_special=True, parse_special=False)
    assert tok.vocab.max_token_chars == MAX_TOKEN_BYTES


def _engine_never_used(monkeypatch, tok):
    def refuse(texts):
        raise AssertionError(f"tokenized {sum(map(len, texts)):,} characters")

    monkeypatch.setattr(tok.engine, "encode", refuse)


def test_a_text_too_long_for_the_budget_is_refused_before_tokenizing(tokenizers, reference, monkeypatch):
    tok = tokenizers["smollm2"]
    budget = 64
    fits = "word " * 40
    assert tok.encode(fits, max_tokens=budget) == tok.encode(fits)
    too_long = "x" * (tok.max_chars(budget) + 1)
    assert len(reference("smollm2").tokenize(too_long, add_special=True, parse_special=False)) > budget
    _engine_never_used(monkeypatch, tok)
    with pytest.raises(ContextOverflowError, match="more than 64 tokens"):
        tok.encode(too_long, max_tokens=budget)


def test_a_chat_too_long_for_the_budget_is_refused_before_tokenizing(tokenizers, monkeypatch):
    tok = tokenizers["smollm2"]
    _engine_never_used(monkeypatch, tok)
    with pytest.raises(ContextOverflowError, match="renders to more than"):
        tok.encode_chat([{"role": "user", "content": "x" * 1_000_000}], max_tokens=256)
    with pytest.raises(ChatTemplateError, match="over 4,194,304 characters"):  # 16M characters: a 2.3 GB encode
        tok.encode_chat([{"role": "user", "content": "x" * (16 << 20)}])
