"""Fidelity gates on the real models (SmolLM2-135M Q4_1, Gemma-3-270M Q4_K_M) against HF transformers in fp32.

exact mode: teacher-forced logits within 1e-3 relative error (max |Δ| / max |logit|), top-1 agreement >= 99%,
greedy 32-token continuations equal to HF's on most prompts. fast mode: top-1 agreement >= 94% and perplexity
within 1.5% of HF's.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf_oracle import PROMPTS, SAMPLE_TEXT, hf_greedy, hf_logits, hf_model, perplexity, relative_error
from quanta.api import LLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def case(request, smollm2_path, gemma3_path):
    path = smollm2_path if request.param == "smollm2" else gemma3_path
    exact = LLM(path, n_ctx=1024, exact=True)
    ids = exact.tokenize(SAMPLE_TEXT)
    hf = hf_model(path)
    return {"path": path, "exact": exact, "ids": ids, "hf": hf, "ref": hf_logits(hf, ids)}


def test_exact_logits_match_hf(case):
    ids, ref = case["ids"], case["ref"]
    assert len(ids) >= 250
    ours = case["exact"].logits(ids)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert relative_error(ours, ref) < 1e-3
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.99


def test_exact_greedy_continuations_match_hf(case):
    llm, hf = case["exact"], case["hf"]
    same = 0
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        ours = llm.generate(ids, max_tokens=32, temperature=0, ignore_eos=True).token_ids
        same += ours == hf_greedy(hf, ids, 32)
    assert same >= len(PROMPTS) - 1


def test_fast_mode_top1_and_perplexity(case):
    ids, ref = case["ids"], case["ref"]
    fast = LLM(case["path"], n_ctx=1024, exact=False)
    ours = fast.logits(ids)
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.94
    ppl, ppl_ref = perplexity(ours, ids), perplexity(ref, ids)
    assert abs(ppl / ppl_ref - 1) < 0.015
    assert fast.perplexity(ids) == pytest.approx(ppl, rel=1e-6)


def test_exact_logits_past_the_sliding_window(case):
    """700 tokens: Gemma's local layers must forget keys older than 512 positions; ``logits`` runs two chunks."""
    llm = case["exact"]
    ids = llm.tokenize(" ".join([SAMPLE_TEXT] * 3))[:700]
    ref = hf_logits(case["hf"], ids)
    ours = llm.logits(ids)
    assert relative_error(ours, ref) < 1e-3
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.99
