"""Our quantizers against llama.cpp's own (``llama_model_quantize`` through llama-cpp-python).

A small llama-architecture model with F32 weights is written with our writer: layer 0 holds real SmolLM2 weights,
layer 1 real Gemma 3 weights (both dequantized, cropped to this model's shapes), layer 2 Gaussian noise and layer 3
heavy-tailed noise (Student t, 3 degrees of freedom). llama.cpp quantizes it with ``pure`` set (every matrix in the
file type's own type, no mixture), then each matrix is quantized by us from the same F32 data. Without an
importance matrix llama.cpp runs the ``quantize_row_*_ref`` functions ours follow, so the 32-weight formats must
give identical bytes, and the K-quants nearly identical bytes and no worse error.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

import quanta.gguf
from quanta.gguf import TensorToWrite, typed, write_gguf
from quanta.quant import dequantize, dequantize_raw, quantize

llama_cpp = pytest.importorskip("llama_cpp")

N_EMBD, N_FF, N_HEAD, N_KV, HEAD_DIM = 512, 1536, 8, 2, 64  # small enough for both real models
MATRICES = {  # numpy shapes (rows, cols)
    "attn_q": (N_HEAD * HEAD_DIM, N_EMBD), "attn_k": (N_KV * HEAD_DIM, N_EMBD), "attn_v": (N_KV * HEAD_DIM, N_EMBD),
    "attn_output": (N_EMBD, N_HEAD * HEAD_DIM), "ffn_gate": (N_FF, N_EMBD), "ffn_up": (N_FF, N_EMBD),
    "ffn_down": (N_EMBD, N_FF),
}
# llama_ftype for each tensor type (llama.h)
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K": 14, "Q5_K": 16, "Q6_K": 18}
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def real_layer(path: Path) -> dict[str, np.ndarray]:
    with quanta.gguf.open(path) as f:
        out = {}
        for name, (rows, cols) in MATRICES.items():
            w = dequantize(f.tensors[f"blk.0.{name}.weight"])
            assert w.shape[0] >= rows and w.shape[1] >= cols
            out[name] = np.ascontiguousarray(w[:rows, :cols])
    return out


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path) -> Path:
    rng = np.random.default_rng(0)
    layers = [
        real_layer(smollm2_path),
        real_layer(gemma3_path),
        {n: rng.standard_normal(s, dtype=np.float32) * 0.02 for n, s in MATRICES.items()},
        {n: (rng.standard_t(3, s) * 0.02).astype(np.float32) for n, s in MATRICES.items()},
    ]
    meta = {
        "general.architecture": "llama", "general.file_type": typed(0, "UINT32"),
        "llama.block_count": typed(len(layers), "UINT32"), "llama.context_length": typed(256, "UINT32"),
        "llama.embedding_length": typed(N_EMBD, "UINT32"), "llama.feed_forward_length": typed(N_FF, "UINT32"),
        "llama.attention.head_count": typed(N_HEAD, "UINT32"), "llama.attention.head_count_kv": typed(N_KV, "UINT32"),
        "llama.rope.dimension_count": typed(HEAD_DIM, "UINT32"),
        "llama.attention.layer_norm_rms_epsilon": typed(1e-5, "FLOAT32"),
    }
    ones = np.ones(N_EMBD, np.float32)
    tensors = [
        TensorToWrite("token_embd.weight", "F32", (256, N_EMBD), rng.standard_normal((256, N_EMBD), dtype=np.float32)),
        TensorToWrite("output_norm.weight", "F32", (N_EMBD,), ones),
    ]
    for i, layer in enumerate(layers):
        tensors += [TensorToWrite(f"blk.{i}.attn_norm.weight", "F32", (N_EMBD,), ones),
                    TensorToWrite(f"blk.{i}.ffn_norm.weight", "F32", (N_EMBD,), ones)]
        tensors += [TensorToWrite(f"blk.{i}.{n}.weight", "F32", w.shape, w) for n, w in layer.items()]
    path = tmp_path_factory.mktemp("llama_cpp_quant") / "f32.gguf"
    write_gguf(path, meta, tensors)
    return path


def llama_cpp_quantize(src: Path, dst: Path, type_name: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[type_name]
    params.pure = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed with {rc}"


@pytest.mark.parametrize("type_name", list(FTYPES))
def test_matches_llama_cpp_quantizer(type_name: str, f32_model: Path, tmp_path: Path) -> None:
    out = tmp_path / f"{type_name}.gguf"
    llama_cpp_quantize(f32_model, out, type_name)
    with quanta.gguf.open(f32_model) as src, quanta.gguf.open(out) as theirs:
        compared = 0
        for name, t in theirs.tensors.items():
            if not name.startswith("blk.") or t.type != type_name:
                continue
            x = dequantize(src.tensors[name])
            ours = quantize(x, type_name)
            same = float(np.mean(ours.reshape(-1) == t.raw))
            if type_name not in K_TYPES:
                assert same == 1.0, f"{name}: {same:.4%} of bytes identical to llama.cpp's"
            else:
                rmse_ours = np.sqrt(np.mean((dequantize_raw(ours, type_name, x.shape) - x) ** 2))
                rmse_theirs = np.sqrt(np.mean((dequantize(t) - x) ** 2))
                assert rmse_ours <= 1.05 * rmse_theirs, f"{name}: RMSE {rmse_ours:.3g} vs llama.cpp {rmse_theirs:.3g}"
                assert same >= 0.99, f"{name}: only {same:.4%} of bytes identical to llama.cpp's"
            compared += 1
    assert compared == 4 * len(MATRICES)
