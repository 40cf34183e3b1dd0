"""Structure of the synthetic vocabularies: complete byte coverage, valid merges, scores, special ids."""

from __future__ import annotations

import numpy as np
import pytest

from quanta.synth import get_preset
from quanta.synth.presets import BYTE, CONTROL, NORMAL, UNUSED
from quanta.synth.tokenizers import gpt2_byte_alphabet, synthetic_tokenizer


def _plain(v):
    return v.value if hasattr(v, "value") else v


def test_gpt2_alphabet_is_the_byte_to_unicode_map():
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = gpt2_byte_alphabet()
    assert len(alphabet) == 256 and sorted(alphabet) == sorted(ByteLevel.alphabet())


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.2-1b", "qwen2.5-0.5b"])
def test_bpe_vocab_full_size(name):
    p = get_preset(name)
    md = synthetic_tokenizer(p.tokenizer, p.vocab_size)
    tokens, types = md["tokenizer.ggml.tokens"], _plain(md["tokenizer.ggml.token_type"])
    merges = md["tokenizer.ggml.merges"]
    assert len(tokens) == len(types) == p.vocab_size == len(set(tokens))
    index = {t: i for i, t in enumerate(tokens)}
    assert set(gpt2_byte_alphabet()) <= set(tokens)
    for m in merges:
        a, b = m.split(" ")
        assert a in index and b in index and a + b in index
        assert index[a + b] > max(index[a], index[b]) or types[index[a]] == CONTROL
    n_special = len(p.tokenizer.specials)
    assert int(np.sum(types == CONTROL)) + int(np.sum(types == 4)) == n_special
    assert int(np.sum(types == UNUSED)) == p.tokenizer.pad_tokens
    assert len(merges) == int(np.sum(types == NORMAL)) - 256
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == p.tokenizer.bos
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == p.tokenizer.eos


@pytest.mark.parametrize("name", ["tinyllama-1.1b", "gemma3-270m"])
def test_spm_vocab_full_size(name):
    p = get_preset(name)
    md = synthetic_tokenizer(p.tokenizer, p.vocab_size)
    tokens, types = md["tokenizer.ggml.tokens"], _plain(md["tokenizer.ggml.token_type"])
    scores = _plain(md["tokenizer.ggml.scores"])
    assert len(tokens) == len(scores) == p.vocab_size == len(set(tokens))
    byte_ids = np.nonzero(types == BYTE)[0]
    assert [tokens[i] for i in byte_ids] == [f"<0x{b:02X}>" for b in range(256)]
    normal = np.nonzero(types == NORMAL)[0]
    assert np.all(np.diff(scores[normal]) < 0)
    assert "▁" in tokens and all(c in tokens for c in "etaoin")
    assert tokens[md["tokenizer.ggml.unknown_token_id"]] == p.tokenizer.unk
