"""n-gram speculative decoding: drafting, the gate, the verify rule (exact for greedy, distribution-preserving for
sampling: chi-square), and the engine's output with speculation = without it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from quanta.api import LLM
from quanta.engine.sampler import SamplingParams, candidates, verify
from quanta.engine.speculation import NgramDrafter, SpeculativeConfig


def test_the_longest_earlier_ngram_proposes_what_followed_it():
    d = NgramDrafter(SpeculativeConfig(max_draft=3, max_ngram=3, extra_token_cost=0.0))
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]  # suffix (6, 7) occurred at 1..2, followed by 8, 9, 1
    assert d.propose(tokens, room=10) == [8, 9, 1]
    assert d.propose(tokens, room=2) == [8, 9]
    assert d.propose([1, 2, 3, 4], room=5) == []  # no repeat: nothing to draft
    tokens += [3, 3, 3]  # suffix (3, 3, 3) never seen before; (3, 3) ends at index 10: followed by 3
    assert d.propose(tokens, room=5) == [3]


def test_the_gate_stops_drafting_when_it_cannot_pay():
    cheap = NgramDrafter(SpeculativeConfig(max_draft=4, extra_token_cost=0.05, prior=0.9))
    assert cheap.best_k() == 4
    for _ in range(20):
        cheap.record(4, 0)  # every draft rejected
    assert cheap.best_k() == 0
    costly = NgramDrafter(SpeculativeConfig(max_draft=4, extra_token_cost=1.0, prior=0.9))
    assert costly.best_k() == 0  # a verified token costs a whole step: drafting never wins


def test_greedy_verify_keeps_exactly_the_argmax_chain():
    rows = np.log(np.array([[.1, .7, .2], [.6, .3, .1], [.2, .2, .6], [.5, .4, .1]], np.float32))
    greedy = SamplingParams(temperature=0)
    rng = np.random.default_rng(0)
    assert verify(rows, [1, 0, 2], greedy, rng, []) == [1, 0, 2, 0]  # all kept, plus one
    assert verify(rows, [1, 2, 2], greedy, rng, []) == [1, 0]  # the second draft is wrong: argmax instead
    assert verify(rows, [0, 0, 2], greedy, rng, []) == [1]
    assert verify(np.full((2, 3), np.nan, np.float32), [1], greedy, rng, []) == []


def test_sampled_verify_preserves_the_distribution():
    """A deterministic draft changes nothing about what is sampled: the first token follows p0 whatever the draft,
    and the second, given the first was the draft token, follows p1 (chi-square, 20,000 draws)."""
    rows = np.log(np.array([[.5, .3, .15, .05], [.1, .2, .3, .4], [.25, .25, .25, .25]], np.float32))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p0, p1 = (candidates(r, params) for r in rows[:2])
    rng = np.random.default_rng(1)
    n = 20_000
    outs = [verify(rows, [1, 3], params, rng, []) for _ in range(n)]
    first = Counter(o[0] for o in outs)
    want0 = np.zeros(4)
    want0[p0[0]] = p0[1]
    assert chisquare([first[i] for i in range(4)], want0 * n).pvalue > 1e-3
    second = Counter(o[1] for o in outs if o[0] == 1)
    want1 = np.zeros(4)
    want1[p1[0]] = p1[1]
    m = sum(second.values())
    assert chisquare([second[i] for i in range(4)], want1 * m).pvalue > 1e-3


REPETITIVE = ["Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Repeated: apple,",
              "Copy the sentence: The quick brown fox jumps over the lazy dog. Copy: The quick brown",
              "Count: one two three four five six seven one two three four five six seven one two",
              "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
              "Summarize: Paris is the capital of France. Paris is known for the Eiffel Tower. Summary: Paris",
              "Hello world! Hello world! Hello world! Hello",
              "Once upon a time there was a king. Once upon a time there was a",
              "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"]


@pytest.fixture(scope="module")
def pair(smollm2_path):
    kw = dict(device="cpu", exact=True, n_ctx=256, max_batched_tokens=64)
    return LLM(smollm2_path, **kw), LLM(smollm2_path, speculative="ngram", **kw)


def test_greedy_with_speculation_is_token_for_token_plain_greedy(pair):
    plain, spec = pair
    kw = dict(max_tokens=40, temperature=0, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(REPETITIVE, **kw)]
    got = spec.generate(REPETITIVE, **kw)
    assert [r.token_ids for r in got] == want
    assert sum(r.stats.accepted_tokens for r in got) > 20  # drafts were proposed and kept
    alone = [spec.generate(p, **kw).token_ids for p in REPETITIVE[:3]]  # one sequence at a time too
    assert alone == want[:3]


def test_speculation_keeps_stops_and_limits(pair):
    plain, spec = pair
    for kw in (dict(max_tokens=7, temperature=0, ignore_eos=True), dict(max_tokens=60, temperature=0),
               dict(max_tokens=30, temperature=0, stop=[" four five"])):
        for p in REPETITIVE[2:4]:
            a, b = plain.generate(p, **kw), spec.generate(p, **kw)
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert spec.engine.blocks.n_used == 0
