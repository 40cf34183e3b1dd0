"""The decode attention's run intrinsics against numpy in float64: a run's scores for 1 to 4 query heads at once
and each head's maximum, the weighted sums of its values, for float32, f16 and int8 rows, head sizes with and
without a tail past the vectors, runs of every length around the keys of a step (0 to 17), runs that are views into
a larger pool, and scores written at an offset of their rows."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from quanta.backends.cpu.kernels.key_runs import HEADS_PER_PASS, add_weighted_run, prefetch_run, scores_of_run


@numba.njit
def _scores(scores, start, q, keys, scale, best):
    scores_of_run(scores, start, q, keys, scale, best)


@numba.njit
def _add_weighted(o, weights, start, values):
    prefetch_run(values)
    add_weighted_run(o, weights, start, values)


def _pool(rng, dtype, slots, d):
    if dtype == np.int8:
        return rng.integers(-127, 128, (slots, d)).astype(np.int8), lambda a: a
    pool = rng.standard_normal((slots, d)).astype(dtype)
    return (pool.view(np.uint16), lambda a: a.view(np.float16)) if dtype == np.float16 else (pool, lambda a: a)


@pytest.mark.parametrize("heads", range(1, HEADS_PER_PASS + 1))
@pytest.mark.parametrize("d", [64, 40, 7, 256])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_scores_and_weighted_sums_match_numpy(heads, d, dtype):
    rng = np.random.default_rng(d + heads)
    pool, as_values = _pool(rng, dtype, 40, d)
    q = rng.standard_normal((heads, d)).astype(np.float32)
    for n in (0, 1, 2, 3, 4, 5, 8, 13, 17):
        run = pool[11:11 + n]  # a run in the middle of the pool
        keys = as_values(run).astype(np.float64)
        scores = np.full((heads, n + 3), 7.0, np.float32)
        best = np.full(heads, -1.5, np.float32)
        _scores(scores, 2, q, run, np.float32(0.3), best)
        expected = 0.3 * (q.astype(np.float64) @ keys.T)
        np.testing.assert_allclose(scores[:, 2:n + 2], expected, rtol=2e-5, atol=1e-4 * np.sqrt(d))
        assert (scores[:, :2] == 7.0).all() and (scores[:, n + 2:] == 7.0).all()  # nothing outside the run's scores
        top = np.maximum(-1.5, expected.max(axis=1)) if n else np.full(heads, -1.5)
        np.testing.assert_allclose(best, top, rtol=2e-5, atol=1e-4 * np.sqrt(d))

        weights = np.full((heads, n + 4), 9.0, np.float32)  # the run's weights start at column 3
        weights[:, 3:3 + n] = rng.random((heads, n))
        out = rng.standard_normal((heads, d)).astype(np.float32)
        expected_out = out.astype(np.float64) + weights[:, 3:3 + n].astype(np.float64) @ keys
        _add_weighted(out, weights, 3, run)
        np.testing.assert_allclose(out, expected_out, rtol=2e-5, atol=1e-4 * np.sqrt(max(n, 1)))
