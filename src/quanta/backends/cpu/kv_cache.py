"""The CPU KV pool: one K and one V array per layer of (n_kv_heads, n_slots, head_dim) float32.

Allocated once with np.zeros, so the OS maps pages only as slots are written: resident memory grows with the
blocks actually used, not with the pool's size.
"""

from __future__ import annotations

import numpy as np

from quanta.backends.base import KVShape


class CPUKVCache:
    def __init__(self, shape: KVShape):
        self.shape = shape
        dims = (shape.n_layers, shape.n_kv_heads, shape.n_slots, shape.head_dim)
        self.k = np.zeros(dims, np.float32)
        self.v = np.zeros(dims, np.float32)

    def __len__(self) -> int:
        return self.shape.n_layers

    def __getitem__(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.k[layer], self.v[layer]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
