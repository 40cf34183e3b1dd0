"""Synthetic models load and run in llama.cpp (llama-cpp-python), and their tokenizers round-trip there."""

from __future__ import annotations

import numpy as np
import pytest

from quanta.synth import get_preset, synthesize

llama_cpp = pytest.importorskip("llama_cpp")

TEXT = "Hello world, this is a test.\n  Ünïcode ✓ 12345 <b>tags</b>\tend"


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory):
    made = {}

    def make(name: str, file_type: str = "Q4_K_M"):
        if (name, file_type) not in made:
            path = tmp_path_factory.mktemp("synth") / f"{name}.gguf"
            synthesize(get_preset(name).with_overrides(layers=2, vocab=2048), path, file_type, seed=1, progress=False)
            made[name, file_type] = llama_cpp.Llama(str(path), n_ctx=64, verbose=False, logits_all=True)
        return made[name, file_type]

    return make


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-0.5b", "smollm2-135m", "tinyllama-1.1b", "gemma3-270m",
                                  "llama-2-7b", "qwen2.5-1.5b"])
def test_loads_and_evaluates_in_llama_cpp(synth_model, name):
    llm = synth_model(name)
    assert llm.n_vocab() == 2048
    tokens = llm.tokenize(b"The quick brown fox")
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[: llm.n_tokens])
    assert logits.shape == (len(tokens), 2048)
    assert np.isfinite(logits).all() and logits.std() > 0.01


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-0.5b", "smollm2-135m", "tinyllama-1.1b", "gemma3-270m"])
def test_tokenizer_round_trips_in_llama_cpp(synth_model, name):
    llm = synth_model(name)
    tokens = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    assert all(0 <= t < 2048 for t in tokens)
    assert len(tokens) < len(TEXT.encode())  # merges/pieces are used, not only single bytes
    text = llm.detokenize(tokens).decode()
    # SentencePiece with add_space_prefix (llama-2, TinyLlama) adds the word-start space in front
    assert text == TEXT or (get_preset(name).tokenizer.add_space_prefix is None
                            and get_preset(name).tokenizer.kind == "llama" and text == " " + TEXT)


@pytest.mark.parametrize("name,special", [("qwen2.5-0.5b", "<|im_start|>"), ("llama-3.2-1b", "<|eot_id|>"),
                                          ("gemma3-270m", "<start_of_turn>"), ("smollm2-135m", "<|im_end|>")])
def test_special_tokens_are_single_tokens(synth_model, name, special):
    llm = synth_model(name)
    tokens = llm.tokenize(special.encode(), add_bos=False, special=True)
    assert len(tokens) == 1
    assert llm.detokenize(tokens, special=True).decode() == special


@pytest.mark.parametrize("file_type", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                                       "Q5_K", "Q6_K", "Q4_K_S", "Q5_K_M"])
def test_every_type_runs_in_llama_cpp(synth_model, file_type):
    llm = synth_model("qwen2.5-0.5b", file_type)
    llm.reset()
    llm.eval(llm.tokenize(b"Hello world"))
    logits = np.array(llm.scores[: llm.n_tokens])
    assert np.isfinite(logits).all() and logits.std() > 0.01
