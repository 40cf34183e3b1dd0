"""Second oracle: llama.cpp (llama-cpp-python) on the same GGUF. Its own numerics (8-bit activations, fp16 KV
cache) differ from fp32, so the bar is agreement, not equality: top-1 of teacher-forced logits and perplexity."""

from __future__ import annotations

import numpy as np
import pytest

from hf_oracle import SAMPLE_TEXT, perplexity
from quanta.api import LLM

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_fast_mode_agrees_with_llama_cpp(model, smollm2_path, gemma3_path):
    path = smollm2_path if model == "smollm2" else gemma3_path
    llm = LLM(path, n_ctx=512)
    ids = llm.tokenize(SAMPLE_TEXT)
    ours = llm.logits(ids)
    ref_model = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    ref_model.eval(ids)
    ref = np.array(ref_model.scores[: len(ids)], dtype=np.float32)
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.9
    assert abs(perplexity(ours, ids) / perplexity(ref, ids) - 1) < 0.03
