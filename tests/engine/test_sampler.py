"""The sampler against plain math: supports of top-k / top-p / min-p, penalties, bias, seeds, logprobs, checks."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from quanta.engine.sampler import NUCLEUS_FIRST, SamplingParams, apply_penalties, candidates, logprobs_of, sample_row

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 over ids 3, 0, 4, 1, 2
PROBS = np.array([0.3, 0.1, 0.05, 0.4, 0.15])
LOGITS = np.log(PROBS).astype(np.float32)


def draws(params: SamplingParams, n: int, logits: np.ndarray = LOGITS) -> list[int]:
    rng = np.random.default_rng(params.seed)
    return [sample_row(logits.copy(), params, rng, []) for _ in range(n)]


def draw(n: int = 3000, **kw) -> Counter:
    return Counter(draws(SamplingParams(**{"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0, "seed": 5,
                                           **kw}), n))


def test_greedy_is_argmax():
    assert draws(SamplingParams(temperature=0), 1) == [3]


def test_full_distribution_frequencies():
    counts = draw(6000)
    for i, p in enumerate(PROBS):
        assert abs(counts[i] / 6000 - p) < 0.025


@pytest.mark.parametrize("kw,support", [
    ({"top_k": 2}, {3, 0}),
    ({"top_p": 0.7}, {3, 0}),  # 0.4 + 0.3 reaches 0.7
    ({"top_p": 0.71}, {3, 0, 4}),
    ({"min_p": 0.3}, {3, 0, 4}),  # keep p >= 0.12
    ({"top_k": 3, "min_p": 0.5}, {3, 0}),
])
def test_support(kw, support):
    counts = draw(2000, **kw)
    assert set(counts) == support


def test_renormalised_within_support():
    counts = draw(6000, top_k=2)
    assert abs(counts[3] / 6000 - 0.4 / 0.7) < 0.03


def test_temperature_sharpens():
    cold, hot = draw(3000, temperature=0.3), draw(3000, temperature=3.0)
    assert cold[3] > hot[3] and cold[2] < hot[2]


def test_seed_reproduces_and_differs():
    def run(seed):
        return draws(SamplingParams(temperature=1.0, top_k=0, min_p=0.0, seed=seed), 50)

    assert run(7) == run(7)
    assert run(1) != run(2)


@pytest.mark.parametrize("top_k,top_p,min_p", [(50, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.01), (300, 0.8, 0.001),
                                                 (0, 0.3, 0.0), (4000, 1.0, 0.0)])
def test_candidates_equal_a_full_sort(top_k, top_p, min_p):
    """On a large, flat, partly masked vocabulary (a nucleus far past NUCLEUS_FIRST tokens, fewer live tokens than
    a top-k): the same support and probabilities as sorting every live token and cutting in order."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(5000).astype(np.float32)
    logits[rng.choice(5000, 1500, replace=False)] = -np.inf
    t = 0.7
    ids, probs = candidates(logits, SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p))
    live = np.flatnonzero(np.isfinite(logits))
    order = live[np.argsort(-logits[live], kind="stable")]
    if top_k:
        order = order[:top_k]
    w = np.exp((logits[order].astype(np.float64) - logits[order[0]]) / t)
    w /= w.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(w), top_p)) + 1
        order, w = order[:keep], w[:keep]
    if min_p:
        order, w = order[w >= min_p * w[0]], w[w >= min_p * w[0]]
    if (top_k, top_p) == (0, 0.9):
        assert len(order) > 4 * NUCLEUS_FIRST  # the nucleus search grew twice
    assert sorted(ids.tolist()) == sorted(order.tolist())
    want = dict(zip(order.tolist(), w / w.sum()))
    np.testing.assert_allclose(probs, [want[i] for i in ids.tolist()], rtol=1e-9)
    if 0 < top_k < live.size or top_p < 1.0:  # most likely first (else in id order)
        assert (np.diff(logits[ids]) <= 0).all()


def test_penalties_follow_their_formulas():
    logits = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    p = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = logits.copy()
    apply_penalties(out, [0, 1, 1, 9], p)
    np.testing.assert_allclose(out, [2 / 2 - 0.5 - 0.25, -1 * 2 - 0.5 - 0.5, 0.5, 3.0])
    out = logits.copy()
    apply_penalties(out, [], p)
    assert out.tolist() == logits.tolist()


def test_repeat_penalty_window():
    out = np.array([2.0, 2.0, 2.0], np.float32)
    apply_penalties(out, [0, 1, 2], SamplingParams(repeat_penalty=2.0, penalty_last_n=2))
    assert out.tolist() == [2.0, 1.0, 1.0]


def test_logit_bias_moves_the_greedy_token():
    assert draws(SamplingParams(temperature=0, logit_bias={2: 5.0}), 1) == [2]
    counts = draw(500, logit_bias={1: -1e9})  # a huge negative bias bans the token
    assert 1 not in counts


def test_non_finite_rows_are_refused():
    params = SamplingParams(temperature=0)
    assert sample_row(np.array([0.0, np.nan, 1.0], np.float32), params, np.random.default_rng(0), []) == -1
    assert sample_row(np.array([0.0, np.inf], np.float32), SamplingParams(temperature=1.0),
                      np.random.default_rng(0), []) == -1


def test_logprobs_are_the_models_log_softmax():
    lp = logprobs_of(LOGITS, 0, 2)
    assert math.isclose(lp.logprob, math.log(0.3), rel_tol=1e-5)
    assert [t for t, _ in lp.top] == [3, 0]
    assert math.isclose(lp.top[0][1], math.log(0.4), rel_tol=1e-5)
    assert logprobs_of(LOGITS, 4, 0).top == ()


@pytest.mark.parametrize("kw", [{"temperature": -0.1}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": -0.1},
                                {"repeat_penalty": 0}, {"repeat_penalty": 1e-30}, {"seed": "x"}, {"seed": -1},
                                {"seed": 2**64}, {"top_k": 2.5}, {"temperature": "hot"}, {"logprobs": 21},
                                {"logit_bias": {"a": 1.0}}, {"logit_bias": {1: float("nan")}}, {"logit_bias": [1]}])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
