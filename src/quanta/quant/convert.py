"""Convert a GGUF file to another file type, tensor by tensor (dequantize → quantize), like llama-quantize.

Only one tensor is decoded at a time: the writer pulls each tensor's bytes from a callable when its turn
comes, so memory stays at about one tensor's float32 copy whatever the model size.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from quanta.gguf import TensorInfo, TensorToWrite, ValueType, open_gguf, typed, write_gguf
from quanta.quant.mixture import file_type_id, plan_types
from quanta.quant.quantize import quantize
from quanta.quant.reference import dequantize_rows

_ROWS_ELEMENTS = 1 << 22  # weights decoded per step


def _converted(tensor: TensorInfo, new_type: str) -> np.ndarray:
    """The tensor's weights re-encoded in ``new_type`` (uint8), decoded a slab of rows at a time."""
    row = tensor.shape[-1]
    n_rows = tensor.n_elements // row
    step = max(1, _ROWS_ELEMENTS // row)
    parts = [quantize(dequantize_rows(tensor, i, min(i + step, n_rows)), new_type).reshape(-1)
             for i in range(0, n_rows, step)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def convert_file(src: str | os.PathLike, dst: str | os.PathLike, file_type: str, *, progress: bool = True
                 ) -> dict[str, str]:
    """Write ``src`` re-quantized to ``file_type`` (see ``quanta.quant.mixture``) at ``dst``; returns
    name → written type."""
    if Path(src).resolve() == Path(dst).resolve():
        raise ValueError("the output file must differ from the input file")
    with open_gguf(src) as f:
        arch = f.architecture
        n_layers = f.metadata.get(f"{arch}.block_count")
        plan = plan_types(file_type, [(n, t.shape) for n, t in f.tensors.items()],
                          n_layers if isinstance(n_layers, int) else None)
        metadata = dict(f.metadata)
        types = dict(f.metadata_types)
        metadata["general.file_type"] = typed(file_type_id(file_type), ValueType.UINT32)
        metadata["general.quantization_version"] = typed(2, ValueType.UINT32)
        types.pop("general.file_type", None)
        types.pop("general.quantization_version", None)
        metadata.pop("general.alignment", None)  # the output uses the default alignment

        written: dict[str, str] = {}
        tensors = []
        for name, t in f.tensors.items():
            new = plan[name] or t.type
            written[name] = new
            data = t.raw if new == t.type else (lambda t=t, new=new: _converted(t, new))
            tensors.append(TensorToWrite(name, new, t.shape, data))

        total = sum(t.n_elements for t in f.tensors.values())
        with tqdm(total=total, unit="w", unit_scale=True, desc=f"quantize {file_type}", disable=not progress) as bar:
            def advance(t: TensorToWrite) -> None:
                bar.set_postfix_str(t.name, refresh=False)
                bar.update(int(np.prod(t.shape)))
            write_gguf(dst, metadata, tensors, metadata_types=types, on_tensor=advance)
    return written
