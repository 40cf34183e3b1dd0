"""Small random-weight models of the llama (Llama-3.2: rope_freqs, tied embeddings) and qwen2 (QKV biases,
NEOX rope) presets, written by ``quanta synth``: exact-mode logits against HF transformers on the same file."""

from __future__ import annotations

import numpy as np
import pytest

from quanta.api import LLM
from quanta.synth import get_preset, synthesize

from hf_oracle import hf_logits, hf_model, relative_error

CASES = [("llama-3.2-1b", "Q4_K_M"), ("tinyllama-1.1b", "Q4_0"), ("qwen2.5-0.5b", "Q8_0")]


@pytest.mark.parametrize("preset,file_type", CASES)
def test_synth_exact_matches_hf(tmp_path, preset, file_type):
    p = get_preset(preset).with_overrides(layers=2, vocab=4096)
    path = tmp_path / f"{preset}.gguf"
    synthesize(p, path, file_type, seed=1, std=0.05, progress=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4096, size=96).tolist()
    llm = LLM(path, n_ctx=256, exact=True)
    ours = llm.logits(ids)
    rope = None
    if p.llama3_rope_scaling:
        factor, low, high, original = p.llama3_rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": p.rope_freq_base, "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": original}
    ref = hf_logits(hf_model(path, rope), ids)
    assert ours.shape == ref.shape
    assert relative_error(ours, ref) < 1e-3
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.99
