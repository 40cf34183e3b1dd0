"""Tiny random GGUF models (llama, qwen2, gemma3) written with quanta's own writer, for backend comparisons.

Weights are random normals quantized by quanta.quant.quantize (random codes for the types it does not write:
Q2_K, Q3_K); each matrix type can be chosen so every format's kernel runs inside a whole forward. The tests
compare backends with each other on these files, never with outputs recorded from our own code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quanta.gguf import TensorToWrite, typed, write_gguf
from quanta.quant.quantize import QUANTIZABLE_TYPES, quantize
from quanta.synth.random_weights import random_tensor


def write_tiny_model(path: Path, arch: str = "llama", *, types: dict[str, str] | None = None, d_model: int = 64,
                     n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, d_ff: int = 128, vocab: int = 96,
                     head_dim: int = 16, seed: int = 0) -> Path:
    """Write a random ``arch`` model; ``types`` maps a matrix name (``attn_q``, ``token_embd`` …) to its type."""
    rng = np.random.default_rng(seed)
    types = types or {}
    tensors: list[TensorToWrite] = []

    def matrix(name: str, rows: int, cols: int, default: str = "Q8_0") -> None:
        key = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        t = types.get(key, default)
        if t in QUANTIZABLE_TYPES:
            w = (rng.standard_normal((rows, cols)) * (1.0 / np.sqrt(cols))).astype(np.float32)
            tensors.append(TensorToWrite(name, t, (rows, cols), quantize(w, t)))
        else:  # Q2_K, Q3_K: random codes and scales, as `quanta synth` writes them
            tensors.append(TensorToWrite(name, t, (rows, cols), random_tensor(t, (rows, cols), rng, 1 / np.sqrt(cols))))

    def vector(name: str, n: int, around: float = 1.0) -> None:
        v = (around + 0.1 * rng.standard_normal(n)).astype(np.float32)
        tensors.append(TensorToWrite(name, "F32", (n,), v))

    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    matrix("token_embd.weight", vocab, d_model)
    vector("output_norm.weight", d_model)
    matrix("output.weight", vocab, d_model, "Q6_K" if d_model % 256 == 0 else "Q8_0")
    for i in range(n_layers):
        p = f"blk.{i}."
        for name, rows, cols in (("attn_q", q_dim, d_model), ("attn_k", kv_dim, d_model), ("attn_v", kv_dim, d_model),
                                 ("attn_output", d_model, q_dim), ("ffn_gate", d_ff, d_model),
                                 ("ffn_up", d_ff, d_model), ("ffn_down", d_model, d_ff)):
            matrix(p + name + ".weight", rows, cols)
        vector(p + "attn_norm.weight", d_model)
        vector(p + "ffn_norm.weight", d_model)
        if arch == "qwen2":
            for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                vector(p + name + ".bias", n, 0.0)
        if arch == "gemma3":
            for name in ("attn_q_norm", "attn_k_norm"):
                vector(p + name + ".weight", head_dim)
            for name in ("post_attention_norm", "post_ffw_norm"):
                vector(p + name + ".weight", d_model)
    md = {
        "general.architecture": arch,
        f"{arch}.block_count": typed(n_layers, "UINT32"),
        f"{arch}.context_length": typed(256, "UINT32"),
        f"{arch}.embedding_length": typed(d_model, "UINT32"),
        f"{arch}.feed_forward_length": typed(d_ff, "UINT32"),
        f"{arch}.attention.head_count": typed(n_heads, "UINT32"),
        f"{arch}.attention.head_count_kv": typed(n_kv_heads, "UINT32"),
        f"{arch}.attention.key_length": typed(head_dim, "UINT32"),
        f"{arch}.attention.value_length": typed(head_dim, "UINT32"),
        f"{arch}.attention.layer_norm_rms_epsilon": typed(1e-6, "FLOAT32"),
        f"{arch}.rope.freq_base": typed(10000.0, "FLOAT32"),
    }
    if arch == "gemma3":
        md[f"{arch}.attention.sliding_window"] = typed(8, "UINT32")
        md[f"{arch}.final_logit_softcapping"] = typed(30.0, "FLOAT32")
    write_gguf(path, md, tensors)
    return path
