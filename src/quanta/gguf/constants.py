"""GGUF container constants: magic, versions, metadata value types and every ggml tensor type.

The ggml type table (id, name, elements per block, bytes per block) mirrors llama.cpp's ``ggml.h``; it is the
single source of truth for tensor sizes. Which types quanta can compute with is decided in ``quanta.quant``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4


class ValueType(IntEnum):
    """GGUF metadata value types (the on-disk tag)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format and numpy dtype of each fixed-size scalar value type
SCALAR_FORMATS: dict[ValueType, tuple[str, str]] = {
    ValueType.UINT8: ("<B", "<u1"),
    ValueType.INT8: ("<b", "<i1"),
    ValueType.UINT16: ("<H", "<u2"),
    ValueType.INT16: ("<h", "<i2"),
    ValueType.UINT32: ("<I", "<u4"),
    ValueType.INT32: ("<i", "<i4"),
    ValueType.FLOAT32: ("<f", "<f4"),
    ValueType.BOOL: ("<?", "<u1"),
    ValueType.UINT64: ("<Q", "<u8"),
    ValueType.INT64: ("<q", "<i8"),
    ValueType.FLOAT64: ("<d", "<f8"),
}


class GGMLType(NamedTuple):
    """One ggml tensor type: ``block_size`` elements are stored in ``type_size`` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int


GGML_TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4),
        GGMLType(1, "F16", 1, 2),
        GGMLType(2, "Q4_0", 32, 18),
        GGMLType(3, "Q4_1", 32, 20),
        GGMLType(6, "Q5_0", 32, 22),
        GGMLType(7, "Q5_1", 32, 24),
        GGMLType(8, "Q8_0", 32, 34),
        GGMLType(9, "Q8_1", 32, 36),
        GGMLType(10, "Q2_K", 256, 84),
        GGMLType(11, "Q3_K", 256, 110),
        GGMLType(12, "Q4_K", 256, 144),
        GGMLType(13, "Q5_K", 256, 176),
        GGMLType(14, "Q6_K", 256, 210),
        GGMLType(15, "Q8_K", 256, 292),
        GGMLType(16, "IQ2_XXS", 256, 66),
        GGMLType(17, "IQ2_XS", 256, 74),
        GGMLType(18, "IQ3_XXS", 256, 98),
        GGMLType(19, "IQ1_S", 256, 50),
        GGMLType(20, "IQ4_NL", 32, 18),
        GGMLType(21, "IQ3_S", 256, 110),
        GGMLType(22, "IQ2_S", 256, 82),
        GGMLType(23, "IQ4_XS", 256, 136),
        GGMLType(24, "I8", 1, 1),
        GGMLType(25, "I16", 1, 2),
        GGMLType(26, "I32", 1, 4),
        GGMLType(27, "I64", 1, 8),
        GGMLType(28, "F64", 1, 8),
        GGMLType(29, "IQ1_M", 256, 56),
        GGMLType(30, "BF16", 1, 2),
        GGMLType(34, "TQ1_0", 256, 54),
        GGMLType(35, "TQ2_0", 256, 66),
        GGMLType(39, "MXFP4", 32, 17),
    )
}
GGML_TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}


def ggml_type(name_or_id: str | int) -> GGMLType:
    """Look a ggml type up by name ("Q4_K") or id; KeyError names the unknown type."""
    table = GGML_TYPES_BY_NAME if isinstance(name_or_id, str) else GGML_TYPES
    try:
        return table[name_or_id]  # type: ignore[index]
    except KeyError:
        raise KeyError(f"unknown ggml type {name_or_id!r}") from None


def tensor_nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of ``shape`` (numpy order, rows first) occupies in ``type_name``."""
    t = ggml_type(type_name)
    n = 1
    for d in shape:
        n *= d
    if shape and shape[-1] % t.block_size:
        raise ValueError(f"row length {shape[-1]} is not a multiple of {t.name}'s block size {t.block_size}")
    return n // t.block_size * t.type_size
