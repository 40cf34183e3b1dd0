"""Loading: the accepted model arguments, the engine cache, and clear errors for tokenizers quanta cannot run."""

from __future__ import annotations

import warnings

import pytest

import quanta.gguf as gguf
from quanta.errors import QuantaError, is_user_error
from quanta.gguf import typed, write_gguf
from quanta.tokenizer import Tokenizer, TokenizerError, bpe_engine, load_tokenizer
from quanta.tokenizer.vocab import load_vocab

from tok_synthetic import write_spm_vocab


def _write(path, **tokenizer_keys):
    metadata = {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                "tokenizer.ggml.token_type": typed([1, 1, 1], "INT32"), **tokenizer_keys}
    write_gguf(path, {k.replace("__", "."): v for k, v in metadata.items()}, [])
    return path


@pytest.mark.parametrize("keys, message", [
    ({}, "no tokenizer"),
    ({"tokenizer.ggml.model": "bert"}, "not supported"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "klingon", "tokenizer.ggml.merges": ["a b"]},
     "unknown pre-tokenizer 'klingon'"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, "merges"),
])
def test_unsupported_tokenizers_raise_clear_errors(tmp_path, keys, message):
    path = tmp_path / "t.gguf"
    write_gguf(path, {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b", "ab"], **keys}, [])
    with pytest.raises(TokenizerError, match=message) as info:
        load_tokenizer(path, cache_dir=tmp_path)
    assert isinstance(info.value, QuantaError) and is_user_error(info.value)


def test_missing_pre_tokenizer_warns_and_uses_default(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
                      "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}, [])
    with pytest.warns(UserWarning, match="default"):
        tok = load_tokenizer(path, cache_dir=tmp_path)
    assert tok.encode("abab", add_special=False) == [2, 2]


def test_accepts_path_name_and_open_file(smollm2_path):
    by_path = load_tokenizer(smollm2_path)
    by_name = load_tokenizer("smollm2-135m")
    with gguf.open(smollm2_path) as f:
        by_file = load_tokenizer(f)
    text = "Hello <|im_start|> world"
    assert by_path.encode(text, parse_special=True) == by_name.encode(text, parse_special=True) \
        == by_file.encode(text, parse_special=True)


def test_sentencepiece_merges_are_cached_and_a_damaged_cache_is_rebuilt(gemma3_path, tmp_path, monkeypatch):
    text = "Caching should not change a single id: 東京 👍🏽"
    first = load_tokenizer(gemma3_path, cache_dir=tmp_path)
    first_ids = first.encode(text)
    cached = list(tmp_path.glob("*.npy"))
    assert len(cached) == 1
    cached[0].write_bytes(b"garbage")
    assert load_tokenizer(gemma3_path, cache_dir=tmp_path).encode(text) == first_ids
    monkeypatch.setattr(bpe_engine, "spm_merge_ids", lambda vocab: pytest.fail("merges derived again"))
    assert load_tokenizer(gemma3_path, cache_dir=tmp_path).encode(text) == first_ids  # from the rebuilt cache


def test_a_rewritten_model_file_does_not_reuse_the_old_merge_cache(tmp_path):
    """The SentencePiece merge cache is keyed by the vocabulary's content: a file rewritten in place with another
    vocabulary encodes as a tokenizer built without any cache does."""
    path, cache = tmp_path / "spm.gguf", tmp_path / "cache"
    text = "the quick brown fox jumps over the lazy dog, again and again"
    write_spm_vocab(path, n_merges=400)
    before = load_tokenizer(path, cache_dir=cache).encode(text)
    write_spm_vocab(path, n_merges=60)
    after = load_tokenizer(path, cache_dir=cache).encode(text)
    with gguf.open(path) as f:
        uncached = Tokenizer(load_vocab(f.metadata), None, "llama", cache_dir=None).encode(text)
    assert after == uncached != before
    assert len(list(cache.glob("*.npy"))) == 2


def test_loading_and_decoding_leave_the_bpe_engine_unbuilt(gemma3_path, tmp_path, reference):
    """Generating from token ids needs no encoder: the engine (0.7 s for Gemma's 262k vocabulary) is only built
    by the first encode; decoding renders only the pieces it is asked for, the same as llama.cpp's."""
    tok = load_tokenizer(gemma3_path, cache_dir=tmp_path)
    ids = [2, 818, 5279, 529, 236743, 236770, 106, 107, 256000]
    decoded = tok.decode(ids)
    streamed = tok.stream_decoder()
    pieces = "".join(streamed.push(i) for i in ids) + streamed.flush()
    assert tok._engine is None and not list(tmp_path.iterdir())  # no engine, so no merge cache written
    llama = reference("gemma3")
    assert decoded == pieces == llama.detokenize(ids, special=True).decode("utf-8", errors="replace")
    assert tok.encode("Hello world") == llama.tokenize("Hello world", add_special=True, parse_special=False)
    assert list(tmp_path.glob("*.npy"))


def test_token_to_piece_and_id_checks(tokenizers):
    tok = tokenizers["gemma3"]
    assert tok.token_to_piece(tok.bos_id) == b"<bos>"
    assert tok.token_to_piece(tok.bos_id, special=False) == b""
    assert tok.token_to_piece(tok.vocab.token_to_id["<0x41>"]) == b"A"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError):
        tok.token_to_piece(-1)
    with pytest.raises(TokenizerError, match="not valid Unicode"):
        tok.encode("lone \ud800 surrogate")


def test_eog_ids_of_the_chat_models(tokenizers):
    smollm, gemma = tokenizers["smollm2"], tokenizers["gemma3"]
    assert smollm.vocab.token_to_id["<|im_end|>"] in smollm.eog_ids
    assert gemma.vocab.token_to_id["<end_of_turn>"] in gemma.eog_ids and gemma.eos_id in gemma.eog_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gemma.is_eog(gemma.bos_id)
