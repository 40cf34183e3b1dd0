"""Loading: the accepted model arguments, the engine cache, and clear errors for tokenizers quanta cannot run."""

from __future__ import annotations

import time
import warnings

import pytest

import quanta.gguf as gguf
from quanta.errors import QuantaError, is_user_error
from quanta.gguf import typed, write_gguf
from quanta.tokenizer import TokenizerError, load_tokenizer


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


def test_sentencepiece_merges_are_cached_and_a_damaged_cache_is_rebuilt(gemma3_path, tmp_path):
    first = load_tokenizer(gemma3_path, cache_dir=tmp_path)
    cached = list(tmp_path.glob("*.npy"))
    assert len(cached) == 1
    text = "Caching should not change a single id: 東京 👍🏽"
    cached[0].write_bytes(b"garbage")
    again = load_tokenizer(gemma3_path, cache_dir=tmp_path)
    assert again.encode(text) == first.encode(text)
    start = time.perf_counter()
    load_tokenizer(gemma3_path, cache_dir=tmp_path)
    assert time.perf_counter() - start < 4.0  # about 0.6 s on an idle machine; CI runners are slower


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
