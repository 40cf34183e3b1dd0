"""Which ggml type each tensor gets for a file type ("Q4_K_M", "Q8_0", ...): llama.cpp's mixture rules.

Follows ``llama_tensor_get_type`` and the "should this tensor be quantized" test of llama.cpp's
``llama-quant.cpp``, restricted to the file types quanta writes. Rules, in order:

================================  ==========================================================================
tensor                            type
================================  ==========================================================================
1-D, ``*_norm.weight``, not       kept as they are (F32 when written from scratch): never quantized
``*.weight``, ``ffn_gate_inp``,
``position_embd``, ``token_types``
everything else, F32/F16/BF16     the file type's own type
``output.weight`` (or the tied    Q6_K, unless the file type's type is Q8_0 (stays Q8_0), or the row length is
``token_embd.weight``)            not a multiple of that type's block size (Q8_0)
``token_embd.weight`` (untied)    the file type's type
``attn_v.weight`` (Q4_K_M,        Q6_K where ``use_more_bits(i, n)``: the first and last eighth of the layers
Q5_K_M)                           and every third layer between
``attn_v.weight`` (Q4_K_S)        Q5_K in the first 4 layers
``ffn_down`` (Q4_K_M, Q5_K_M)     Q6_K where ``use_more_bits(layer, n_layer)``
``ffn_down`` (Q4_K_S)             Q5_K in the first eighth of the layers
``attn_qkv.weight``               Q5_K (Q4_K_M), Q6_K (Q5_K_M)
anything else                     the file type's type (Q4_K for Q4_K_*, Q5_K for Q5_K_M, ...)
================================  ==========================================================================

Fallback when the row length is not a multiple of the chosen type's block size (e.g. 576 or 640 wide rows and
the 256-wide K-quants): Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, Q2_K/Q3_K → Q4_0 (llama.cpp uses IQ4_NL, which
quanta does not compute with); if the row still does not fit, F16 (llama.cpp refuses such tensors).

Layer counters run over the tensors in layer order (``blk.N.``), which reproduces the type of every tensor of
the llama.cpp-made Q4_1 SmolLM2 and Q4_K_M Gemma-3 files (tested). The pure
K types Q2_K, Q3_K, Q4_K and Q5_K (for ``quanta synth``) use only the output/token_embd rule and the fallbacks.
Not modelled: mixture-of-experts, Falcon and 70B special cases, importance matrices.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from quanta.gguf.constants import ggml_type

# file type name -> (the type most tensors get, llama.cpp's LLAMA_FTYPE value for general.file_type)
FILE_TYPES: dict[str, tuple[str, int]] = {
    "F32": ("F32", 0), "F16": ("F16", 1), "Q4_0": ("Q4_0", 2), "Q4_1": ("Q4_1", 3), "Q8_0": ("Q8_0", 7),
    "Q5_0": ("Q5_0", 8), "Q5_1": ("Q5_1", 9), "Q2_K": ("Q2_K", 10), "Q3_K": ("Q3_K", 11),
    "Q4_K": ("Q4_K", 14), "Q4_K_S": ("Q4_K", 14), "Q4_K_M": ("Q4_K", 15), "Q5_K": ("Q5_K", 16),
    "Q5_K_M": ("Q5_K", 17), "Q6_K": ("Q6_K", 18), "BF16": ("BF16", 32),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}
_NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight")


def file_type_id(file_type: str) -> int:
    """llama.cpp's LLAMA_FTYPE value for ``general.file_type``."""
    return FILE_TYPES[_check(file_type)][1]


def _check(file_type: str) -> str:
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r} (choose from {', '.join(FILE_TYPES)})")
    return file_type


def is_quantizable(name: str, shape: Sequence[int]) -> bool:
    """Whether llama.cpp would convert this tensor at all (others keep their type)."""
    return len(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _NEVER_QUANTIZED)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: first and last eighth, and every third in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fits(type_name: str, row: int) -> bool:
    return row % ggml_type(type_name).block_size == 0


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else -1, name)


def plan_types(file_type: str, tensors: Iterable[tuple[str, Sequence[int]]], n_layers: int | None = None
               ) -> dict[str, str | None]:
    """name → new ggml type for each (name, shape in numpy order), or None where the tensor keeps its type."""
    base = FILE_TYPES[_check(file_type)][0]
    tensors = list(tensors)
    names = {name for name, _ in tensors}
    has_output = "output.weight" in names
    n_attn_v = sum("attn_v.weight" in n or "attn_qkv.weight" in n for n in names)
    n_layers = n_layers if n_layers is not None else sum("ffn_down" in n for n in names)
    shapes = dict(tensors)
    plan: dict[str, str | None] = {}
    i_attn_v = i_ffn_down = 0
    for name in sorted(names, key=_layer_order):
        shape = shapes[name]
        if not is_quantizable(name, shape):
            plan[name] = None
            continue
        if base in FLOAT_TYPES:
            plan[name] = base
            continue
        row, new = shape[-1], base
        if name == "output.weight" or (not has_output and name == "token_embd.weight"):
            new = "Q8_0" if not _fits(base, row) else base if base == "Q8_0" else "Q6_K"
        elif "attn_v.weight" in name:
            if file_type in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_attn_v, n_attn_v):
                new = "Q6_K"
            elif file_type == "Q4_K_S" and i_attn_v < 4:
                new = "Q5_K"
            i_attn_v += 1
        elif "ffn_down" in name:
            if file_type in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_ffn_down, n_layers):
                new = "Q6_K"
            elif file_type == "Q4_K_S" and i_ffn_down < n_layers // 8:
                new = "Q5_K"
            i_ffn_down += 1
        elif "attn_qkv.weight" in name:
            new = {"Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(file_type, new)
        if not _fits(new, row):
            new = _FALLBACK.get(new, new)
            if not _fits(new, row):
                new = "F16"
        plan[name] = new
    return plan
