"""The one table of block formats quanta computes with.

Each format lists the fields of one block in storage order (name, numpy dtype, count). The numpy reference, the
quantizers, the numba CPU kernels and the Triton GPU kernels all read their layout from here. Block and byte sizes
come from ``quanta.gguf.constants`` and are checked against the fields at import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quanta.gguf.constants import ggml_type


class UnsupportedTypeError(ValueError):
    """A tensor is stored in a ggml type quanta cannot compute with."""


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str
    count: int


@dataclass(frozen=True)
class QuantFormat:
    """Layout of one block: ``block_size`` weights in ``type_size`` bytes made of ``fields``."""

    name: str
    block_size: int
    type_size: int
    fields: tuple[Field, ...]

    @property
    def block_dtype(self) -> np.dtype:
        """A packed numpy structured dtype for one block (``raw.view(fmt.block_dtype)``)."""
        return np.dtype([(f.name, f.dtype, (f.count,)) for f in self.fields])

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def offset(self, field_name: str) -> int:
        """Byte offset of a field inside a block."""
        off = 0
        for f in self.fields:
            if f.name == field_name:
                return off
            off += np.dtype(f.dtype).itemsize * f.count
        raise KeyError(field_name)

    def blocks(self, raw: np.ndarray) -> np.ndarray:
        """View raw bytes as an array of blocks (structured dtype), zero-copy."""
        return np.ascontiguousarray(raw).reshape(-1).view(self.block_dtype)

    def pack(self, **fields: np.ndarray) -> np.ndarray:
        """Assemble blocks from one array per field, each ``(n_blocks, count)`` (the inverse of ``blocks``)."""
        n = next(iter(fields.values())).shape[0]
        out = np.empty(n, dtype=self.block_dtype)
        for f in self.fields:
            out[f.name] = fields[f.name].reshape(n, f.count)
        return out


def _fmt(name: str, *fields: tuple[str, str, int]) -> QuantFormat:
    t = ggml_type(name)
    fmt = QuantFormat(name, t.block_size, t.type_size, tuple(Field(*f) for f in fields))
    assert fmt.block_dtype.itemsize == t.type_size, name
    return fmt


# K-quants: a super-block of 256 weights in sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K).
FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        _fmt("F32", ("v", "<f4", 1)),
        _fmt("F16", ("v", "<f2", 1)),
        _fmt("BF16", ("v", "<u2", 1)),
        _fmt("Q4_0", ("d", "<f2", 1), ("qs", "u1", 16)),
        _fmt("Q4_1", ("d", "<f2", 1), ("m", "<f2", 1), ("qs", "u1", 16)),
        _fmt("Q5_0", ("d", "<f2", 1), ("qh", "u1", 4), ("qs", "u1", 16)),
        _fmt("Q5_1", ("d", "<f2", 1), ("m", "<f2", 1), ("qh", "u1", 4), ("qs", "u1", 16)),
        _fmt("Q8_0", ("d", "<f2", 1), ("qs", "i1", 32)),
        _fmt("Q2_K", ("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2", 1), ("dmin", "<f2", 1)),
        _fmt("Q3_K", ("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2", 1)),
        _fmt("Q4_K", ("d", "<f2", 1), ("dmin", "<f2", 1), ("scales", "u1", 12), ("qs", "u1", 128)),
        _fmt("Q5_K", ("d", "<f2", 1), ("dmin", "<f2", 1), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)),
        _fmt("Q6_K", ("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2", 1)),
    )
}


def get_format(type_name: str, tensor_name: str = "") -> QuantFormat:
    """The format for ``type_name``; a clear error for types quanta does not support."""
    try:
        return FORMATS[type_name]
    except KeyError:
        where = f" in tensor {tensor_name}" if tensor_name else ""
        raise UnsupportedTypeError(
            f"unsupported tensor type {type_name}{where} (supported: {', '.join(FORMATS)})"
        ) from None
