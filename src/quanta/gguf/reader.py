"""GGUF reader: mmap the file, parse metadata and the tensor table, expose tensors as zero-copy views.

Layout (v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count, the metadata
key/value pairs, the tensor infos (name, n_dims, ne[n_dims] as u64, u32 type, u64 offset), padding to
``general.alignment``, then the tensor data. Every count and length is checked against the bytes left so a
malformed file raises ``GGUFError`` (reason + byte offset) and never allocates more than the file holds. As in
llama.cpp (``gguf.cpp``), the tensors' data regions follow the table's order, each at the aligned end of the
previous one: no overlaps, no gaps.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quanta.gguf.constants import (
    DEFAULT_ALIGNMENT,
    GGML_TYPES,
    GGUF_MAGIC,
    MAX_DIMS,
    SCALAR_FORMATS,
    SUPPORTED_VERSIONS,
    ValueType,
)
from quanta.errors import GGUFError

MAX_ARRAY_NESTING = 8
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file; ``raw`` is a read-only uint8 view into the mmap (no copy)."""

    name: str
    type: str
    shape: tuple[int, ...]  # numpy order: rows first (GGUF's ne[] reversed)
    offset: int  # absolute byte offset in the file
    nbytes: int
    raw: np.ndarray = field(repr=False, compare=False)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Bounds-checked little-endian reads over a buffer."""

    def __init__(self, buf: memoryview, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"truncated {what}: needs {n} bytes, {self.size - self.pos} left", self.pos)

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        if n > self.size - self.pos:
            raise GGUFError(f"{what} length {n} exceeds the {self.size - self.pos} bytes left", start)
        s = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError:
            return s.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype == ValueType.STRING:
            return self.string(what)
        if vtype == ValueType.ARRAY:
            return self.array(what, depth)
        try:
            fmt, _ = SCALAR_FORMATS[ValueType(vtype)]
        except (ValueError, KeyError):
            raise GGUFError(f"unknown metadata value type {vtype} for {what}", self.pos - 4) from None
        size = struct.calcsize(fmt)
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFError(f"arrays nested deeper than {MAX_ARRAY_NESTING} in {what}", self.pos)
        start = self.pos
        etype = self.u32(f"{what} element type")
        n = self.u64(f"{what} element count")
        left = self.size - self.pos
        if etype in SCALAR_FORMATS:
            _, dtype = SCALAR_FORMATS[ValueType(etype)]
            itemsize = np.dtype(dtype).itemsize
            if n > left // itemsize:
                raise GGUFError(f"{what} claims {n} elements, more than the {left} bytes left hold", start)
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
            self.pos += n * itemsize
            return arr.astype(bool) if etype == ValueType.BOOL else arr
        if etype == ValueType.STRING:
            if n > left // 8:
                raise GGUFError(f"{what} claims {n} strings, more than the {left} bytes left hold", start)
            return self.string_array(n, what)
        if etype == ValueType.ARRAY:
            if n > left // 12:
                raise GGUFError(f"{what} claims {n} arrays, more than the {left} bytes left hold", start)
            return [self.array(what, depth + 1) for _ in range(n)]
        raise GGUFError(f"unknown array element type {etype} in {what}", start)

    def string_array(self, n: int, what: str) -> list[str]:
        """Scan n length-prefixed strings in one pass, then decode them in bulk (fast for 262k vocabularies)."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        starts = [0] * n
        ends = [0] * n
        for i in range(n):
            if pos + 8 > size:
                raise GGUFError(f"truncated {what}: string length past the end of the file", pos)
            ln = unpack(buf, pos)[0]
            pos += 8
            if ln > size - pos:
                raise GGUFError(f"string length {ln} in {what} exceeds the {size - pos} bytes left", pos - 8)
            starts[i] = pos
            pos += ln
            ends[i] = pos
        base = self.pos
        raw = bytes(buf[base:pos])
        self.pos = pos
        try:
            return [raw[a - base : b - base].decode() for a, b in zip(starts, ends)]
        except UnicodeDecodeError:  # rare: decode all with replacement (valid strings decode the same)
            return [raw[a - base : b - base].decode("utf-8", "replace") for a, b in zip(starts, ends)]


class GGUFFile:
    """An open GGUF file: ``metadata`` (key → value), ``metadata_types`` (key → ValueType, element type for
    arrays) and ``tensors`` (ordered name → TensorInfo). Use as a context manager or call ``close()``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise GGUFError(f"cannot open: {e.strerror}", path=path) from None
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 24:
                raise GGUFError(f"file too small for a GGUF header ({size} bytes)", 0)
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self.file_size = size
            self._parse(memoryview(self._mmap))
        except GGUFError as e:
            self._file.close()
            raise GGUFError(e.reason, e.offset, path) from None
        except BaseException:
            self._file.close()
            raise

    def _parse(self, buf: memoryview) -> None:
        cur = _Cursor(buf, self.file_size)
        cur.need(4, "magic")
        magic = bytes(buf[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"bad magic {magic!r} (not a GGUF file)", 0)
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (big-endian file?)" if self.version > 0xFFFF else ""
            raise GGUFError(f"unsupported GGUF version {self.version}{hint}; supported: 2, 3", 4)
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_kv > (self.file_size - cur.pos) // 13:  # key length (8) + 1 char + type (4) at least
            raise GGUFError(f"metadata count {n_kv} is larger than the file could hold", 16)
        if n_tensors > (self.file_size - cur.pos) // 28:  # name length (8) + 1 + n_dims + ne + type + offset
            raise GGUFError(f"tensor count {n_tensors} is larger than the file could hold", 8)

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, ValueType | tuple[ValueType, ...]] = {}
        key_offsets: dict[str, int] = {}
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string("metadata key")
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {key}", start)
            vtype = cur.u32(f"type of {key}")
            self.metadata[key] = cur.value(vtype, key)
            self.metadata_types[key] = self._type_of(buf, vtype, start, key)
            key_offsets[key] = start

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (type(self.alignment) is not int or self.alignment <= 0 or self.alignment & (self.alignment - 1)
                or self.alignment > 1 << 30):
            raise GGUFError(f"general.alignment {self.alignment!r} is not a power of two up to 2**30",
                            key_offsets.get("general.alignment"))

        infos = []
        for i in range(n_tensors):
            start = cur.pos
            name = cur.string(f"tensor {i} name")
            n_dims = cur.u32(f"dims of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor {name} has {n_dims} dimensions (1..{MAX_DIMS} allowed)", start)
            ne = [cur.u64(f"shape of {name}") for _ in range(n_dims)]
            type_id = cur.u32(f"type of {name}")
            offset = cur.u64(f"offset of {name}")
            if type_id not in GGML_TYPES:
                raise GGUFError(f"tensor {name} has unknown ggml type {type_id}", cur.pos - 12)
            infos.append((name, ne, GGML_TYPES[type_id], offset, start))

        data_start = -(-cur.pos // self.alignment) * self.alignment
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        expected = 0  # where the next tensor's data must start (relative to data_start)
        for name, ne, t, offset, start in infos:
            n = 1
            for d in ne:
                if d == 0 or d > 1 << 62:
                    raise GGUFError(f"tensor {name} has invalid dimension {d}", start)
                n *= d
                if n > 1 << 62:
                    raise GGUFError(f"tensor {name}: element count overflows", start)
            if ne[0] % t.block_size:
                raise GGUFError(f"tensor {name}: row length {ne[0]} is not a multiple of {t.name}'s block size", start)
            nbytes = n // t.block_size * t.type_size
            if offset % self.alignment:
                raise GGUFError(f"tensor {name} offset {offset} is not aligned to {self.alignment}", start)
            absolute = data_start + offset
            if absolute + nbytes > self.file_size:
                raise GGUFError(
                    f"tensor {name} ({nbytes} bytes at data offset {offset}) runs past the end of the file "
                    f"({self.file_size} bytes)", absolute)
            if name in self.tensors:
                raise GGUFError(f"duplicate tensor name {name}", start)
            if offset != expected:
                how = "overlaps the data before it" if offset < expected else "leaves a gap after the data before it"
                raise GGUFError(f"tensor {name}'s data at data offset {offset} {how} (expected offset {expected}: "
                                f"each tensor's data follows the previous one's, in table order)", start)
            expected += -(-nbytes // self.alignment) * self.alignment
            raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=absolute)
            self.tensors[name] = TensorInfo(name, t.name, tuple(int(d) for d in reversed(ne)), absolute, nbytes, raw)

    @staticmethod
    def _type_of(buf: memoryview, vtype: int, start: int, key: str) -> ValueType | tuple[ValueType, ...]:
        """The value type of a key; for arrays (ARRAY, element type), read back from the bytes just parsed."""
        if vtype != ValueType.ARRAY:
            return ValueType(vtype)
        klen = _U64.unpack_from(buf, start)[0]
        etype = _U32.unpack_from(buf, start + 8 + klen + 4)[0]
        return (ValueType.ARRAY, ValueType(etype))

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (None when the file states none, or not as a string)."""
        return architecture_of(self.metadata, required=False)

    def close(self) -> None:
        """Release the file. The mmap stays valid while tensor views are alive (closed when they are freed)."""
        self.tensors = {}
        try:
            self._mmap.close()
        except BufferError:
            pass  # numpy views still reference the mapping; it is unmapped when they are garbage-collected
        self._file.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file (mmap, zero-copy tensors)."""
    return GGUFFile(path)


def architecture_of(metadata: dict[str, Any], *, required: bool = True) -> str | None:
    """A model's ``general.architecture``: its name, or (``required``) a GGUFError when missing or not a string;
    the one place the key is read."""
    arch = metadata.get("general.architecture")
    if isinstance(arch, str) and arch:
        return arch
    if required:
        raise GGUFError(f"general.architecture is {arch!r}; expected the architecture's name (a string)")
    return None
