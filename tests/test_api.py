"""quanta.LLM: argument checking, tokenize/detokenize, chat, logits and perplexity on SmolLM2."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import quanta
from quanta.errors import QuantaError


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return quanta.LLM(smollm2_path, n_ctx=512)


def test_exported():
    from quanta.api import LLM

    assert quanta.LLM is LLM


def test_tokenize_roundtrip(llm):
    ids = llm.tokenize("Hello world")
    assert all(isinstance(i, int) for i in ids)
    assert llm.detokenize(ids) == "Hello world"


@pytest.mark.parametrize("kw", [{"max_tokens": -1}, {"temperature": -1.0}, {"top_p": 2.0}, {"top_k": "5"},
                                {"stop": [1]}, {"min_p": 1.5}, {"max_tokens": 1.5}])
def test_bad_generate_arguments(llm, kw):
    with pytest.raises(ValueError):
        llm.generate("Hi", **kw)


def test_bad_prompts(llm):
    with pytest.raises(ValueError):
        llm.generate(3.5)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([1, -4])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([])
    with pytest.raises(ValueError):
        llm.chat("not a list")


def test_bad_constructor_arguments(smollm2_path):
    with pytest.raises(ValueError, match="n_ctx"):
        quanta.LLM(smollm2_path, n_ctx=0)
    with pytest.raises(QuantaError, match=r"n_ctx 1,000,000,000 needs 2\d,\d{3}\.\d GiB .* lower n_ctx"):
        quanta.LLM(smollm2_path, n_ctx=10**9)  # 23 KB of f16 KV cache per position: 21 TiB
    with pytest.raises(ValueError, match="device"):
        quanta.LLM(smollm2_path, device="tpu")
    with pytest.raises((QuantaError, FileNotFoundError)):
        quanta.LLM("no-such-model")


def test_hostile_api_calls_get_clear_errors(smollm2_path, llm):
    for model in (123, b"path", 1.5):
        with pytest.raises(ValueError, match="model must be a path"):
            quanta.LLM(model)
    for device in ("cuda:abc", "cpu:1", 3):
        with pytest.raises(ValueError, match="device"):
            quanta.LLM(smollm2_path, device=device)
    with pytest.raises(ValueError, match="unknown LLM option"):
        quanta.LLM(smollm2_path, max_seq=4)
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate([1.0, 2.7])
    with pytest.raises(ValueError, match="seed"):
        llm.generate("Hi", seed=-1)
    with pytest.raises(ValueError, match="repeat_penalty"):
        llm.generate("Hi", repeat_penalty=1e-30)
    with pytest.raises(ValueError, match="unknown generation option"):
        llm.generate("Hi", max_new_tokens=3)
    assert llm.generate("Hi", max_tokens=3, repeat_penalty=100.0, seed=0).finish_reason in ("stop", "length")


def test_a_closed_llm_refuses_to_work(smollm2_path):
    with quanta.LLM(smollm2_path, n_ctx=64) as closed:
        pass
    for call in (lambda: closed.generate("Hi"), lambda: closed.tokenize("Hi"), lambda: closed.logits([1, 2])):
        with pytest.raises(QuantaError, match="closed"):
            call()


def test_a_list_of_prompts_returns_a_list(llm):
    prompts = ["Hello", llm.tokenize("The sky is"), "Two plus two is"]
    results = llm.generate(prompts, max_tokens=4, temperature=0, ignore_eos=True)
    assert isinstance(results, list) and len(results) == 3  # batched = alone: tests/engine/test_llm_engine.py
    assert all(len(r.token_ids) == 4 and r.text == llm.detokenize(r.token_ids) for r in results)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])


def test_chat_and_stream_chat(llm):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    r = llm.chat(msgs, max_tokens=16, temperature=0)
    assert r.text and r.finish_reason in ("stop", "length")
    llm.engine.reset_prefix_cache()  # same path as the first call (prefill of the whole prompt, no reused prefix)
    assert "".join(llm.chat(msgs, stream=True, max_tokens=16, temperature=0)) == r.text
    assert llm.chat_prompt(msgs) == llm.tokenizer.encode_chat(msgs)


def test_perplexity_is_plausible(llm):
    natural = llm.perplexity("The cat sat on the mat. The dog lay down by the fire and went to sleep.")
    shuffled = llm.perplexity("mat fire The the. sleep lay cat by on and The went dog to sat down the.")
    assert 1 < natural < shuffled


def test_logits_teacher_forcing_consistent_with_generation(llm):
    ids = llm.tokenize("One, two, three,")
    logits = llm.logits(ids)
    assert logits.shape == (len(ids), llm.model.n_vocab) and np.isfinite(logits).all()
    r = llm.generate(ids, max_tokens=1, temperature=0, ignore_eos=True)
    assert r.token_ids == [int(logits[-1].argmax())]


@pytest.mark.parametrize("enabled", [True, False])
def test_loading_leaves_the_garbage_collector_as_it_found_it(smollm2_path, tmp_path, enabled):
    """The collector is paused while a model loads (a cold-start cost): it must come back as it was, also when
    the load fails."""
    (gc.enable if enabled else gc.disable)()
    try:
        quanta.LLM(smollm2_path, n_ctx=64).close()
        assert gc.isenabled() == enabled
        with pytest.raises(FileNotFoundError):
            quanta.LLM(tmp_path / "missing.gguf")
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
