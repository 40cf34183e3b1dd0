"""Edit a GGUF model and write it back: metadata values and types, tensor shapes, types, data and offsets.

The tensor table and the data layout are assembled here with struct (only the metadata pairs go through our
writer's ``encode_metadata``), so a test can write what the writer refuses: shapes that contradict the
hyper-parameters, types wrong for a tensor, data regions that overlap or run past the end of the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from quanta.gguf import GGML_TYPES_BY_NAME, encode_metadata, open_gguf
from quanta.synth import get_preset, synthesize

# tiny versions of the three architectures (d_model 256 so that every k-quant's 256-weight blocks fit a row)
TINY = {
    "llama": dict(n_layers=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, vocab_size=512),
    "qwen2": dict(n_layers=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, vocab_size=512),
    "gemma3": dict(n_layers=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=1, vocab_size=512, head_dim=128),
}
TINY_PRESETS = {"llama": "smollm2-135m", "qwen2": "qwen2.5-0.5b", "gemma3": "gemma3-270m"}


@dataclass(frozen=True)
class Tensor:
    name: str
    type: str
    shape: tuple[int, ...]  # numpy order, rows first
    data: np.ndarray = field(repr=False)  # uint8


@dataclass
class Model:
    """A GGUF file's content, editable: ``types`` are the metadata value types as the reader reports them."""

    metadata: dict[str, Any]
    types: dict[str, Any]
    tensors: list[Tensor]
    alignment: int = 32

    def copy(self) -> Model:
        return Model(dict(self.metadata), dict(self.types), list(self.tensors), self.alignment)

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]

    def index(self, name: str) -> int:
        return next(i for i, t in enumerate(self.tensors) if t.name == name)

    def set(self, key: str, value: Any, vtype: Any = None) -> Model:
        """``key`` = ``value`` (typed as ``vtype``: a ValueType, (ARRAY, element type), or None to infer)."""
        self.metadata[key] = value
        if vtype is None:
            self.types.pop(key, None)
        else:
            self.types[key] = vtype
        return self

    def retensor(self, name: str, *, shape: tuple[int, ...] | None = None, type: str | None = None) -> Model:
        """``name`` with a new shape and/or type, its bytes cut or repeated to the size those imply."""
        i = self.index(name)
        t = self.tensors[i]
        t = replace(t, shape=t.shape if shape is None else tuple(shape), type=t.type if type is None else type)
        self.tensors[i] = replace(t, data=np.resize(t.data, nbytes(t.type, t.shape)))
        return self

    def write(self, path: Path, offsets: list[int] | None = None) -> Path:
        """Write GGUF v3; ``offsets`` (data-relative) replace the consistent layout's in the tensor table."""
        head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata)))
        for key, value in self.metadata.items():
            head += encode_metadata(key, value, self.types.get(key))
        layout, at = [], 0
        for t in self.tensors:
            layout.append(at)
            at += -(-t.data.size // self.alignment) * self.alignment
        for t, offset in zip(self.tensors, offsets or layout):
            name = t.name.encode()
            head += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape))
            head += struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape))
            head += struct.pack("<IQ", GGML_TYPES_BY_NAME[t.type].id, offset)
        head += b"\0" * (-len(head) % self.alignment)
        with open(path, "r+b" if path.exists() else "wb") as f:  # rewritten in place: emptying a file first and
            f.write(head)                                          # growing it again costs more than the write
            for t in self.tensors:
                f.write(t.data.data)
                f.write(b"\0" * (-t.data.size % self.alignment))
            f.truncate()
        return path


def nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor (rows that do not fill a block are cut short: the reader must refuse them)."""
    t = GGML_TYPES_BY_NAME[type_name]
    return int(np.prod(shape, dtype=np.int64)) // t.block_size * t.type_size


def read(path: Path, layers: int | None = None) -> Model:
    """The file's content (tensor bytes copied); with ``layers``, only the tensors of its first layers and
    ``block_count`` set to match."""
    keep = tuple(f"blk.{i}." for i in range(layers or 0))
    with open_gguf(path) as f:
        tensors = [Tensor(t.name, t.type, t.shape, t.raw.copy()) for t in f.tensors.values()
                   if layers is None or not t.name.startswith("blk.") or t.name.startswith(keep)]
        m = Model(dict(f.metadata), dict(f.metadata_types), tensors, f.alignment)
    if layers is not None:
        m.metadata[f"{m.arch}.block_count"] = layers
    return m


def tiny_model(arch: str, path: Path, file_type: str = "Q8_0", seed: int = 0) -> Model:
    """A random-weight model of ``arch`` with TINY's sizes, written to ``path`` by ``quanta.synth``."""
    preset = replace(get_preset(TINY_PRESETS[arch]), **TINY[arch])
    preset = replace(preset, tokenizer=replace(preset.tokenizer, pad_tokens=0))
    synthesize(preset, path, file_type, seed=seed, std=0.05, progress=False)
    return read(path)
