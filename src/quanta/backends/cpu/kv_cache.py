"""The CPU KV pool: per layer one K and one V array of (n_kv_heads, n_slots, head_dim).

``f32`` stores the values; ``f16`` rounds them to half precision (uint16 bits: half the bytes a decode attention
reads); ``q8`` stores int8 codes with a float32 scale per 32 values of a (slot, KV head) row (``max|x| / 127``,
symmetric, of the row rotated by a Walsh-Hadamard matrix: attention.py): 1.125 bytes per value instead of 4. q8
needs a power-of-two head size.

The arrays live in anonymous maps without transparent huge pages, so the OS maps 4 KiB pages only as slots are
written: resident memory grows with the blocks actually used, not with the pool's size (numpy's own large arrays
ask for huge pages: one written slot per layer and head then made a 2 MiB page resident, and the whole pool with it).
"""

from __future__ import annotations

import math
import mmap

import numpy as np

from quanta.backends.base import KVShape

KV_DTYPES = ("f32", "f16", "q8")
SCALE_GROUP = 32  # int8 values sharing a scale


def kv_nbytes(shape: KVShape, dtype: str) -> int:
    """Bytes of a pool of ``shape`` stored as ``dtype``."""
    if dtype == "q8":
        groups = -(-shape.head_dim // SCALE_GROUP)
        return 2 * shape.n_layers * shape.n_kv_heads * shape.n_slots * (shape.head_dim + 4 * groups)
    return shape.nbytes(2 if dtype == "f16" else 4)


def lazy_zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A zero array in its own anonymous map, paged in 4 KiB at a time as it is written."""
    size = max(1, math.prod(shape) * np.dtype(dtype).itemsize)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count=math.prod(shape)).reshape(shape)


class CPUKVCache:
    def __init__(self, shape: KVShape, dtype: str = "f32"):
        if dtype not in KV_DTYPES:
            raise ValueError(f"the CPU backend stores the KV cache as {', '.join(KV_DTYPES)}, not {dtype!r}")
        if dtype == "q8" and shape.head_dim & (shape.head_dim - 1):
            raise ValueError(f"an int8 KV cache needs a power-of-two head size, not {shape.head_dim}")
        self.shape, self.dtype = shape, dtype
        dims = (shape.n_layers, shape.n_kv_heads, shape.n_slots, shape.head_dim)
        codes = {"f32": np.float32, "f16": np.uint16, "q8": np.int8}[dtype]
        self.k = lazy_zeros(dims, codes)
        self.v = lazy_zeros(dims, codes)
        scales = (*dims[:3], -(-shape.head_dim // SCALE_GROUP))
        self.k_scale = lazy_zeros(scales, np.float32) if dtype == "q8" else None
        self.v_scale = lazy_zeros(scales, np.float32) if dtype == "q8" else None

    def __len__(self) -> int:
        return self.shape.n_layers

    def __getitem__(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The layer's K, V and (q8) their scales."""
        if self.k_scale is None:
            return self.k[layer], self.v[layer], None, None
        return self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]

    @property
    def nbytes(self) -> int:
        return kv_nbytes(self.shape, self.dtype)
