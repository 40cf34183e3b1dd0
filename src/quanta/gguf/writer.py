"""GGUF writer: metadata and tensors, aligned, streamed tensor by tensor.

Tensor data may be given as an array or as a callable that produces it when its turn comes, so a multi-GB model
is written without holding it in memory. Values are typed from Python types unless a type is given explicitly
(``typed(v, ValueType.UINT64)``), or through ``metadata_types`` as returned by the reader (round trips).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from quanta.gguf.constants import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    SCALAR_FORMATS,
    ValueType,
    ggml_type,
    tensor_nbytes,
)


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type (for arrays: the element type)."""

    value: Any
    type: ValueType


def typed(value: Any, vtype: ValueType | str) -> Typed:
    return Typed(value, ValueType[vtype] if isinstance(vtype, str) else vtype)


@dataclass
class TensorToWrite:
    """A tensor to write: ``data`` holds (or ``data()`` returns) the encoded bytes or values of ``type``."""

    name: str
    type: str
    shape: tuple[int, ...]  # numpy order
    data: np.ndarray | bytes | Callable[[], np.ndarray | bytes]


_NP_TO_VT = {
    np.dtype("u1"): ValueType.UINT8, np.dtype("i1"): ValueType.INT8, np.dtype("<u2"): ValueType.UINT16,
    np.dtype("<i2"): ValueType.INT16, np.dtype("<u4"): ValueType.UINT32, np.dtype("<i4"): ValueType.INT32,
    np.dtype("<f4"): ValueType.FLOAT32, np.dtype("<u8"): ValueType.UINT64, np.dtype("<i8"): ValueType.INT64,
    np.dtype("<f8"): ValueType.FLOAT64, np.dtype("bool"): ValueType.BOOL,
}


def _infer_type(v: Any) -> ValueType:
    if isinstance(v, (bool, np.bool_)):
        return ValueType.BOOL
    if isinstance(v, (int, np.integer)):
        return ValueType.UINT32 if 0 <= v < 2**32 else ValueType.INT64 if v >= -(2**63) and v < 2**63 else ValueType.UINT64
    if isinstance(v, (float, np.floating)):
        return ValueType.FLOAT32
    if isinstance(v, str):
        return ValueType.STRING
    if isinstance(v, (list, tuple, np.ndarray)):
        return ValueType.ARRAY
    raise TypeError(f"cannot store a {type(v).__name__} in GGUF metadata")


def _element_type(v: Sequence[Any] | np.ndarray) -> ValueType:
    if isinstance(v, np.ndarray):
        return _NP_TO_VT[v.dtype.newbyteorder("<") if v.dtype.byteorder == ">" else v.dtype]
    if len(v) == 0:
        return ValueType.UINT8
    if all(isinstance(x, str) for x in v):
        return ValueType.STRING
    if all(isinstance(x, (list, tuple, np.ndarray)) for x in v):
        return ValueType.ARRAY
    if all(isinstance(x, (bool, np.bool_)) for x in v):
        return ValueType.BOOL
    if all(isinstance(x, (int, np.integer)) for x in v):
        return ValueType.INT32 if all(-(2**31) <= x < 2**31 for x in v) else ValueType.INT64
    return ValueType.FLOAT32


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _encode_value(v: Any, vtype: ValueType, etype: ValueType | None = None) -> bytes:
    if vtype == ValueType.STRING:
        return _encode_string(v)
    if vtype == ValueType.ARRAY:
        etype = etype if etype is not None else _element_type(v)
        head = struct.pack("<IQ", etype, len(v))
        if etype == ValueType.STRING:
            return head + b"".join(_encode_string(s) for s in v)
        if etype == ValueType.ARRAY:
            return head + b"".join(_encode_value(x, ValueType.ARRAY) for x in v)
        _, dtype = SCALAR_FORMATS[etype]
        return head + np.array(v, dtype=dtype).tobytes()  # no float detour: exact u64/i64 values
    fmt, _ = SCALAR_FORMATS[vtype]
    return struct.pack(fmt, v)


def encode_metadata(key: str, value: Any, vtype: Any = None) -> bytes:
    """One key/value pair as bytes. ``vtype`` is a ValueType or (ARRAY, element type) as the reader reports."""
    etype = None
    if isinstance(value, Typed):
        value, t = value.value, value.type
        if isinstance(value, (list, tuple, np.ndarray)) and t != ValueType.ARRAY:
            vtype, etype = ValueType.ARRAY, t
        else:
            vtype = t
    elif isinstance(vtype, tuple):
        vtype, etype = vtype
    elif vtype is None:
        vtype = _infer_type(value)
    return _encode_string(key) + struct.pack("<I", vtype) + _encode_value(value, ValueType(vtype), etype)


def _as_bytes(t: TensorToWrite) -> memoryview:
    data = t.data() if callable(t.data) else t.data
    arr = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data)
    out = memoryview(arr).cast("B")
    expected = tensor_nbytes(t.type, t.shape)
    if out.nbytes != expected:
        raise ValueError(f"tensor {t.name}: got {out.nbytes} bytes, {t.type}{list(t.shape)} needs {expected}")
    return out


def write_gguf(
    path: str | os.PathLike,
    metadata: Mapping[str, Any],
    tensors: Iterable[TensorToWrite],
    *,
    metadata_types: Mapping[str, Any] | None = None,
    alignment: int | None = None,
    on_tensor: Callable[[TensorToWrite], None] | None = None,
) -> None:
    """Write a GGUF v3 file. ``on_tensor`` is called after each tensor's data is written (progress bars)."""
    tensors = list(tensors)
    metadata = dict(metadata)
    given = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    alignment = alignment or int(given.value if isinstance(given, Typed) else given)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} is not a positive power of two")
    if alignment != DEFAULT_ALIGNMENT or "general.alignment" in metadata:
        metadata["general.alignment"] = typed(alignment, ValueType.UINT32)
    types = metadata_types or {}
    head = bytearray(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        head += encode_metadata(key, value, types.get(key))
    offset = 0
    for t in tensors:
        head += _encode_string(t.name) + struct.pack("<I", len(t.shape))
        head += struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape))
        head += struct.pack("<IQ", ggml_type(t.type).id, offset)
        offset += -(-tensor_nbytes(t.type, t.shape) // alignment) * alignment
    head += b"\0" * (-len(head) % alignment)
    check_destination(path)
    tmp = Path(f"{path}.part")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for t in tensors:
                data = _as_bytes(t)
                f.write(data)
                f.write(b"\0" * (-data.nbytes % alignment))
                if on_tensor:
                    on_tensor(t)
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, Ctrl-C, any error: no half-written file stays behind
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:  # say which write failed
            raise OSError(e.errno, f"{e.strerror} while writing {path}") from None
        raise


def check_destination(path: str | os.PathLike) -> Path:
    """``path`` as a file :func:`write_gguf` may (re)write, else ValueError: not a directory or another non-regular
    file (a FIFO, a device), which writing beside it and renaming over would replace; its directory must exist."""
    out = Path(path)
    if not str(path):
        raise ValueError("the output path is empty")
    if out.is_dir():
        raise ValueError(f"the output {out} is a directory; give a file name")
    if os.path.lexists(out) and not out.is_file():
        raise ValueError(f"the output {out} exists and is not a regular file (a FIFO, a device or a broken link); "
                         "quanta only replaces regular files")
    if not out.parent.is_dir():
        raise ValueError(f"the output's directory {out.parent} does not exist")
    return out
