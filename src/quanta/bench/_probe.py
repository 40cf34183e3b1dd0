"""The numba kernel of the CPU bandwidth probe (kept apart so importing roofline stays cheap)."""

import numba
import numpy as np


@numba.njit(parallel=True, cache=True, fastmath=True)
def parallel_sum(a: np.ndarray) -> float:
    """Sum of a float32 array: a prange reduction that numba splits over the threads and vectorises."""
    s = np.float32(0.0)
    for i in numba.prange(a.size):
        s += a[i]
    return s
