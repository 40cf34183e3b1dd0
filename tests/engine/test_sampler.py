"""The sampler against plain math: supports of top-k / top-p / min-p, penalties, seeds, argument checks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from quanta.engine.sampler import Sampler, SamplingParams

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 over ids 3, 0, 4, 1, 2
PROBS = np.array([0.3, 0.1, 0.05, 0.4, 0.15])
LOGITS = np.log(PROBS).astype(np.float32)


def draw(n: int = 3000, **kw) -> Counter:
    s = Sampler(SamplingParams(**{"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0, "seed": 5, **kw}))
    return Counter(s.sample(LOGITS, []) for _ in range(n))


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0)).sample(LOGITS, []) == 3


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
        s = Sampler(SamplingParams(temperature=1.0, top_k=0, min_p=0.0, seed=seed))
        return [s.sample(LOGITS, []) for _ in range(50)]

    assert run(7) == run(7)
    assert run(1) != run(2)


def test_penalties_follow_their_formulas():
    logits = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    s = Sampler(SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    out = s.apply_penalties(logits, [0, 1, 1, 9])
    np.testing.assert_allclose(out, [2 / 2 - 0.5 - 0.25, -1 * 2 - 0.5 - 0.5, 0.5, 3.0])
    assert s.apply_penalties(logits, []).tolist() == logits.tolist()


def test_repeat_penalty_window():
    s = Sampler(SamplingParams(repeat_penalty=2.0, penalty_last_n=2))
    assert s.apply_penalties(np.array([2.0, 2.0, 2.0], np.float32), [0, 1, 2])[0] == 2.0


@pytest.mark.parametrize("kw", [{"temperature": -0.1}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": -0.1},
                                {"repeat_penalty": 0}, {"seed": "x"}, {"top_k": 2.5}, {"temperature": "hot"}])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
