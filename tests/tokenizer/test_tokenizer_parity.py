"""Every token id identical to llama.cpp (llama-cpp-python) on a broad corpus, for real and synthetic vocabularies."""

from __future__ import annotations

import random

import pytest
import unicodedata2
from hypothesis import given, settings
from hypothesis import strategies as st

from tok_corpus import SAMPLES, mixed_text

NAMES = ["smollm2", "gemma3", "synth-llama-bpe", "synth-qwen2", "synth-gpt-2", "synth-smollm", "synth-default",
         "synth-spm"]
FLAGS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_llama_cpp_on_corpus(name, tokenizers, reference):
    tok, ref = tokenizers[name], reference(name)
    texts = SAMPLES + [mixed_text(2500, seed=s) for s in range(6)]
    for text in texts:
        for add_special, parse_special in FLAGS:
            assert tok.encode(text, add_special, parse_special) == ref.tokenize(text, add_special, parse_special), \
                (text, add_special, parse_special)


@pytest.mark.parametrize("name", ["smollm2", "gemma3", "synth-llama-bpe", "synth-spm"])
def test_encode_matches_llama_cpp_on_long_text(name, tokenizers, reference):
    """Long fragments take the chunked, batched path of the engine."""
    text = mixed_text(200_000, seed=11) + "<|im_start|><start_of_turn>" + mixed_text(60_000, seed=12)
    tok, ref = tokenizers[name], reference(name)
    for parse_special in (False, True):
        assert tok.encode(text, True, parse_special) == ref.tokenize(text, True, parse_special)


def test_ignore_merges_is_exercised(tokenizers):
    """The llama-bpe vocab holds whole-word tokens no merge produces; only ignore_merges reaches them."""
    tok = tokenizers["synth-llama-bpe"]
    no_merge = {i for i, t in enumerate(tok.vocab.tokens) if i >= tok.vocab_size - 40}
    assert no_merge & set(tok.encode(mixed_text(5000, seed=3)))
    assert not no_merge & set(tokenizers["synth-qwen2"].encode(mixed_text(5000, seed=3)))


@pytest.mark.parametrize("name", NAMES)
def test_special_ids_and_attributes_match(name, tokenizers, reference):
    tok, ref = tokenizers[name], reference(name)
    assert tok.vocab_size == ref.n_tokens()
    assert tok.bos_id == ref.lib.llama_vocab_bos(ref.vocab)
    assert tok.eos_id == ref.lib.llama_vocab_eos(ref.vocab)
    ids = range(tok.vocab_size)
    assert tok.eog_ids == {i for i in ids if ref.is_eog(i)}
    assert [int(a) for a in tok.vocab.attrs] == [ref.attr(i) for i in ids]


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_llama_cpp(name, tokenizers, reference):
    tok, ref = tokenizers[name], reference(name)
    rng = random.Random(5)
    cases = [tok.encode(t, True, True) for t in SAMPLES]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))] for _ in range(300)]
    cases += [[i] for i in range(0, tok.vocab_size, max(1, tok.vocab_size // 3000))]
    for ids in cases:
        for skip_special in (False, True):
            expected = ref.detokenize(ids, special=not skip_special)
            assert tok.decode_bytes(ids, skip_special) == expected, ids
            assert tok.decode(ids, skip_special) == expected.decode("utf-8", errors="replace")


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_round_trip_of_plain_text(name, tokenizers):
    tok = tokenizers[name]
    for text in SAMPLES:
        if any(ord(c) < 32 and c not in "\t\n\r" for c in text):
            continue  # SmolLM2 has no token for some control bytes: llama.cpp drops them, so do we
        assert tok.decode(tok.encode(text, add_special=False)) == text


# Every character but lone surrogates, unassigned ones included: llama.cpp classifies by Unicode 15.1, so a
# character added since (U+13460, Unicode 16.0) is neither letter, number nor space to it, whatever newer tables say
_ALPHABET = st.one_of(
    st.characters(codec="utf-8", exclude_categories=["Cs"]),
    st.sampled_from([" ", "  ", "\n", "\r\n", "\t", "'s", "'", "1", "123", "\u00a0", "\u3000", "\u0085", "\u200d",
                     "\u0301", "👍", "🏽", "<|im_start|>", "<|im_end|>", "<end_of_turn>", "<bos>", "\n\n", "é", "東"]),
)


# Letters, digits, marks and symbols added in Unicode 16.0 and 17.0, in the BMP and beyond (Garay, Tulu-Tigalari,
# Kirat Rai, Sunuwar, Ol Onal, Gurung Khema, Sidetic, Tolong Siki, Beria Erfe, Tai Yo, Emoji 16 and 17)
_ADDED_SINCE_15_1 = ("\u0897\u1c89\ua7cb\u2427\U00013460\U00010d40\U00010d4a\U00010d50\U00010d70\U00010d8e"
                     "\U00011380\U000113b8\U00016d40\U00016d43\U00016d70\U00011bc0\U00011be1\U00011bf0\U0001e5d0"
                     "\U0001e5f1\U00016100\U00016130\U0001cc00\U0001ccf0\U0001fae9\U0001fa89\U0001f8d0\U00010940"
                     "\U00011db0\U00011de0\U00016ea0\U0001e6c0\U0001faea")
_CONTEXTS = ("{c}'s", "a{c}b", "1{c}2", "12{c}345", " {c}{c} ", "{c}\n\n", "x {c}!", "👍{c}é", "東{c}'S", "{c}  \t{c}",
             "?{c}?", "{c}\r\n ", "Ω{c}'ll")


@pytest.mark.parametrize("name", NAMES)
def test_characters_added_since_unicode_15_1_match_llama_cpp(name, tokenizers, reference):
    """llama.cpp's Unicode 15.1 tables leave these unassigned (neither letter, number nor space); HF's do not."""
    assert {unicodedata2.category(c) for c in _ADDED_SINCE_15_1} == {"Cn"}
    tok, ref = tokenizers[name], reference(name)
    rng = random.Random(9)
    pool = list(_ADDED_SINCE_15_1) + [" ", "\n", "'s", "7", "42", "a", "Zé", "東", "!", ".", "👍🏽", "\t", "\u00a0"]
    texts = [ctx.format(c=c) for c in _ADDED_SINCE_15_1 for ctx in _CONTEXTS]
    texts += ["".join(rng.choices(pool, k=rng.randrange(1, 40))) for _ in range(300)]
    long_text = list(mixed_text(120_000, seed=4))  # several chunks: only some hold a new character
    for pos in rng.sample(range(len(long_text)), 6):
        long_text[pos] = rng.choice(_ADDED_SINCE_15_1)
    texts.append("".join(long_text))
    for text in texts:
        assert tok.encode(text, add_special=False) == ref.tokenize(text, False, False), text[:500]


@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_llama_cpp_on_random_text(name, tokenizers, reference):
    tok, ref = tokenizers[name], reference(name)

    @settings(max_examples=150, deadline=None)
    @given(parts=st.lists(_ALPHABET, max_size=24), add_special=st.booleans(), parse_special=st.booleans())
    def check(parts, add_special, parse_special):
        text = "".join(parts)
        assert tok.encode(text, add_special, parse_special) == ref.tokenize(text, add_special, parse_special)

    check()
