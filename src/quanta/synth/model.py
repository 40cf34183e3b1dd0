"""Write a random-weight model with a preset's exact tensor shapes, metadata and a synthetic tokenizer.

Tensors are generated one at a time, when the writer asks for them, straight in the target type (mixes follow
``quanta.quant.mixture``), so memory stays at about one tensor even for the 7B preset.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from quanta.gguf import TensorToWrite, ValueType, tensor_nbytes, typed, write_gguf
from quanta.quant.mixture import FILE_TYPES, file_type_id, plan_types
from quanta.synth.presets import ModelPreset
from quanta.synth.random_weights import random_tensor
from quanta.synth.tokenizers import synthetic_tokenizer


@dataclass(frozen=True)
class SynthResult:
    path: str
    bytes: int
    seconds: float
    types: dict[str, str]

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9


def tensor_shapes(p: ModelPreset) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in llama.cpp's naming, in the order llama.cpp's converter writes."""
    hd, e = p.head_size, p.n_embd
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (p.vocab_size, e))]
    if p.llama3_rope_scaling:
        shapes.append(("rope_freqs.weight", (hd // 2,)))
    for i in range(p.n_layers):
        b = f"blk.{i}."
        shapes += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (p.n_head * hd, e)),
                   (b + "attn_k.weight", (p.n_head_kv * hd, e)), (b + "attn_v.weight", (p.n_head_kv * hd, e)),
                   (b + "attn_output.weight", (e, p.n_head * hd))]
        if p.qkv_bias:
            shapes += [(b + "attn_q.bias", (p.n_head * hd,)), (b + "attn_k.bias", (p.n_head_kv * hd,)),
                       (b + "attn_v.bias", (p.n_head_kv * hd,))]
        if p.arch == "gemma3":
            shapes += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,)),
                       (b + "post_attention_norm.weight", (e,)), (b + "post_ffw_norm.weight", (e,))]
        shapes += [(b + "ffn_norm.weight", (e,)), (b + "ffn_gate.weight", (p.n_ff, e)),
                   (b + "ffn_up.weight", (p.n_ff, e)), (b + "ffn_down.weight", (e, p.n_ff))]
    shapes.append(("output_norm.weight", (e,)))
    if not p.tied_embeddings:
        shapes.append(("output.weight", (p.vocab_size, e)))
    return shapes


def llama3_rope_factors(p: ModelPreset) -> np.ndarray:
    """Llama-3.x long-context rope frequency factors, as llama.cpp's converter stores in rope_freqs.weight."""
    factor, low, high, original = p.llama3_rope_scaling  # type: ignore[misc]
    dim = p.head_size
    freqs = 1.0 / (p.rope_freq_base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def model_metadata(p: ModelPreset, file_type: str, seed: int) -> dict[str, Any]:
    """GGUF metadata of the preset: general.*, the architecture's hyper-parameters, the tokenizer."""
    a = p.arch
    u32 = lambda v: typed(v, ValueType.UINT32)  # noqa: E731
    md: dict[str, Any] = {
        "general.architecture": a, "general.type": "model", "general.name": f"synthetic {p.name}",
        "general.file_type": u32(file_type_id(file_type)), "general.quantization_version": u32(2),
        f"{a}.block_count": u32(p.n_layers), f"{a}.context_length": u32(p.context_length),
        f"{a}.embedding_length": u32(p.n_embd), f"{a}.feed_forward_length": u32(p.n_ff),
        f"{a}.attention.head_count": u32(p.n_head), f"{a}.attention.head_count_kv": u32(p.n_head_kv),
        f"{a}.rope.freq_base": typed(p.rope_freq_base, ValueType.FLOAT32),
        f"{a}.attention.layer_norm_rms_epsilon": typed(p.rms_eps, ValueType.FLOAT32),
    }
    if p.head_dim is not None:
        md[f"{a}.attention.key_length"] = u32(p.head_dim)
        md[f"{a}.attention.value_length"] = u32(p.head_dim)
    if a == "llama":
        md[f"{a}.rope.dimension_count"] = u32(p.head_size)
        md[f"{a}.vocab_size"] = u32(p.vocab_size)
    if p.sliding_window is not None:
        md[f"{a}.attention.sliding_window"] = u32(p.sliding_window)
    md.update(synthetic_tokenizer(p.tokenizer, p.vocab_size, seed))
    return md


def synthesize(p: ModelPreset, path: str | os.PathLike, file_type: str, *, seed: int = 0, std: float = 0.02,
               progress: bool = True) -> SynthResult:
    """Write the random-weight model ``p`` in ``file_type`` (a ggml type or a llama.cpp mix such as Q4_K_M)."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown type {file_type!r} (choose from {', '.join(FILE_TYPES)})")
    t0 = time.perf_counter()
    shapes = tensor_shapes(p)
    plan = plan_types(file_type, shapes, p.n_layers)
    rng = np.random.default_rng(seed)

    def make(name: str, ty: str, shape: tuple[int, ...]):
        if name == "rope_freqs.weight":
            return lambda: llama3_rope_factors(p)
        if name.endswith("norm.weight"):
            return lambda: np.ones(shape, np.float32)
        return lambda: random_tensor(ty, shape, rng, std)

    tensors = []
    for name, shape in shapes:
        ty = plan[name] or "F32"
        tensors.append(TensorToWrite(name, ty, shape, make(name, ty, shape)))
    total = sum(tensor_nbytes(t.type, t.shape) for t in tensors)
    metadata = model_metadata(p, file_type, seed)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {p.name} {file_type}",
              disable=not progress) as bar:
        write_gguf(path, metadata, tensors, on_tensor=lambda t: bar.update(tensor_nbytes(t.type, t.shape)))
    return SynthResult(str(path), os.path.getsize(path), time.perf_counter() - t0, {t.name: t.type for t in tensors})
