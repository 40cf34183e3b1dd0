"""The decode attention's run intrinsics against numpy in float64: a run's scores and their maximum, the weighted
sum of its values, for float32, f16 and int8 rows, head sizes with and without a tail past the 16 lanes, runs of
every length around the four keys of a step (0 to 17), and runs that are views into a larger pool."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from quanta.backends.cpu.kernels.key_runs import add_weighted_run, prefetch_run, scores_of_run


@numba.njit
def _scores(scores, q, keys, scale):
    return scores_of_run(scores, q, keys, scale)


@numba.njit
def _add_weighted(o, weights, values):
    prefetch_run(values)
    add_weighted_run(o, weights, values)


def _pool(rng, dtype, slots, d):
    if dtype == np.int8:
        return rng.integers(-127, 128, (slots, d)).astype(np.int8), lambda a: a
    pool = rng.standard_normal((slots, d)).astype(dtype)
    return (pool.view(np.uint16), lambda a: a.view(np.float16)) if dtype == np.float16 else (pool, lambda a: a)


@pytest.mark.parametrize("d", [64, 40, 7, 256])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_scores_and_weighted_sum_match_numpy(d, dtype):
    rng = np.random.default_rng(d)
    pool, as_values = _pool(rng, dtype, 40, d)
    q = rng.standard_normal(d).astype(np.float32)
    for n in (0, 1, 3, 4, 5, 8, 13, 17):
        run = pool[11:11 + n]  # a run in the middle of the pool
        keys = as_values(run).astype(np.float64)
        scores = np.full(n + 2, 7.0, np.float32)
        best = _scores(scores[1:n + 1], q, run, np.float32(0.3))
        expected = 0.3 * (keys @ q.astype(np.float64))
        np.testing.assert_allclose(scores[1:n + 1], expected, rtol=2e-5, atol=1e-4 * np.sqrt(d))
        assert scores[0] == scores[n + 1] == 7.0  # nothing written outside the run's scores
        assert best == -np.inf if n == 0 else best == pytest.approx(expected.max(), rel=2e-5, abs=1e-4 * np.sqrt(d))

        weights = rng.random(n).astype(np.float32)
        out = rng.standard_normal(d + 3).astype(np.float32)
        expected_out = out.astype(np.float64)
        expected_out[2:2 + d] += weights.astype(np.float64) @ keys
        _add_weighted(out[2:2 + d], weights, run)
        np.testing.assert_allclose(out, expected_out, rtol=2e-5, atol=1e-4 * np.sqrt(max(n, 1)))
