"""Model-level validation: a GGUF's hyper-parameters against each other, and every tensor an architecture loads
against the shape and ggml type the config implies, before any tensor is loaded or any kernel runs.

The GGUF reader only knows the container is sound; a file whose numbers contradict each other (a head count that
does not divide the width, a rope wider than the head, a norm weight shorter than the model) would otherwise load
and read past its buffers, produce garbage, or crash. Contradictions are a ``GGUFError`` naming the key or tensor
and what was expected; a valid file needing what quanta does not implement is an ``UnsupportedModelError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from quanta.errors import GGUFError, UnsupportedModelError
from quanta.gguf import GGUFFile, TensorInfo
from quanta.models.config import ModelConfig
from quanta.quant import FORMATS, dequantize

# A tensor's expected shape (numpy order, rows first) as named dimensions, resolved by ``_dimensions``.
Shape = tuple[str, ...]

_DIMENSION_NAMES = {
    "vocab": "the vocabulary size",
    "d_model": "embedding_length",
    "d_ff": "feed_forward_length",
    "q": "head_count × key_length",
    "kv": "head_count_kv × key_length",
    "v": "head_count_kv × value_length",
    "o": "head_count × value_length",
    "head": "key_length",
    "rope_pairs": "rope.dimension_count / 2",
}


@dataclass(frozen=True)
class ArchTensors:
    """What one architecture's model class loads: ``{name: shape}`` of the file-wide tensors (required and
    optional) and of every layer's tensors (``blk.{i}.`` + name)."""

    required: dict[str, Shape]
    optional: dict[str, Shape]
    per_layer: dict[str, Shape]


_GLOBAL = {"token_embd.weight": ("vocab", "d_model"), "output_norm.weight": ("d_model",)}
_OPTIONAL = {"output.weight": ("vocab", "d_model")}  # absent: tied embeddings
_LAYER = {
    "attn_norm.weight": ("d_model",), "attn_q.weight": ("q", "d_model"), "attn_k.weight": ("kv", "d_model"),
    "attn_v.weight": ("v", "d_model"), "attn_output.weight": ("d_model", "o"), "ffn_norm.weight": ("d_model",),
    "ffn_gate.weight": ("d_ff", "d_model"), "ffn_up.weight": ("d_ff", "d_model"), "ffn_down.weight": ("d_model", "d_ff"),
}
_LLAMA_OPTIONAL = {**_OPTIONAL, "rope_freqs.weight": ("rope_pairs",)}  # Llama-3 per-frequency rope divisors

# derived from models/base.py (Model.__init__, load_layer) and each architecture's load_layer / __init__
ARCH_TENSORS: dict[str, ArchTensors] = {
    "llama": ArchTensors(_GLOBAL, _LLAMA_OPTIONAL, _LAYER),
    "qwen2": ArchTensors(_GLOBAL, _LLAMA_OPTIONAL, {
        **_LAYER, "attn_q.bias": ("q",), "attn_k.bias": ("kv",), "attn_v.bias": ("v",)}),
    "gemma3": ArchTensors(_GLOBAL, _OPTIONAL, {
        **_LAYER, "attn_q_norm.weight": ("head",), "attn_k_norm.weight": ("head",),
        "post_attention_norm.weight": ("d_model",), "post_ffw_norm.weight": ("d_model",)}),
}

SUPPORTED_TYPES = tuple(FORMATS)  # what every backend computes with, as matrices and as vectors
_LAYER_INDEX = re.compile(r"blk\.(\d+)\.")


def validate(gguf: GGUFFile, config: ModelConfig) -> None:
    """Raise ``GGUFError`` / ``UnsupportedModelError`` unless ``config`` is self-consistent and every tensor the
    architecture loads is present with the shape and a ggml type the backends support."""
    _check_hyperparameters(gguf, config)
    tensors = ARCH_TENSORS[config.arch]
    embd = _tensor(gguf, "token_embd.weight", config)
    if len(embd.shape) != 2:
        _fail(gguf, f"tensor 'token_embd.weight' has shape {_dims(embd.shape)}; expected a matrix "
                    f"(vocabulary size, {config.d_model})")
    dims = _dimensions(config, n_vocab=embd.shape[0])
    for name, shape in tensors.required.items():
        _check_tensor(gguf, _tensor(gguf, name, config), shape, dims)
    for name, shape in tensors.optional.items():
        if name in gguf.tensors:
            _check_tensor(gguf, gguf.tensors[name], shape, dims)
    _check_layer_count(gguf, config)
    for i in range(config.n_layers):
        for name, shape in tensors.per_layer.items():
            _check_tensor(gguf, _tensor(gguf, f"blk.{i}.{name}", config), shape, dims)
    _check_vocabulary(gguf, config, dims["vocab"])
    if "rope_freqs.weight" in tensors.optional:
        _check_rope_divisors(gguf)


def _check_hyperparameters(gguf: GGUFFile, c: ModelConfig) -> None:
    a = c.arch
    if c.n_heads % c.n_kv_heads:
        _fail(gguf, f"{a}.attention.head_count = {c.n_heads} is not a multiple of {a}.attention.head_count_kv = "
                    f"{c.n_kv_heads} (each key/value head serves a whole group of query heads)")
    if c.rope_dim > c.head_dim:
        _fail(gguf, f"{a}.rope.dimension_count = {c.rope_dim} is larger than the head size {c.head_dim} "
                    f"({a}.attention.key_length or embedding_length / head_count)")
    if c.value_dim != c.head_dim:
        raise UnsupportedModelError(f"{gguf.path.name}: {a}.attention.value_length = {c.value_dim} differs from "
                                    f"the key length {c.head_dim}; quanta supports equal key and value head sizes")


def _dimensions(c: ModelConfig, n_vocab: int) -> dict[str, int]:
    return {"vocab": n_vocab, "d_model": c.d_model, "d_ff": c.d_ff, "q": c.n_heads * c.head_dim,
            "kv": c.n_kv_heads * c.head_dim, "v": c.n_kv_heads * c.value_dim, "o": c.n_heads * c.value_dim,
            "head": c.head_dim, "rope_pairs": c.rope_dim // 2}


def _tensor(gguf: GGUFFile, name: str, c: ModelConfig) -> TensorInfo:
    try:
        return gguf.tensors[name]
    except KeyError:
        _fail(gguf, f"the {c.arch} model lacks tensor {name!r}")


def _check_tensor(gguf: GGUFFile, t: TensorInfo, shape: Shape, dims: dict[str, int]) -> None:
    if t.type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(f"{gguf.path.name}: tensor {t.name!r} is stored as {t.type}, which quanta "
                                    f"cannot compute with (supported: {', '.join(SUPPORTED_TYPES)})")
    want = tuple(dims[d] for d in shape)
    if t.shape != want:
        names = " × ".join(_DIMENSION_NAMES[d] for d in shape)
        _fail(gguf, f"tensor {t.name!r} has shape {_dims(t.shape)}; expected {_dims(want)} ({names})")


def _check_layer_count(gguf: GGUFFile, c: ModelConfig) -> None:
    """block_count against the layers the tensors are named for: missing layers and extra ones both contradict it."""
    layers = {int(m.group(1)) for name in gguf.tensors if (m := _LAYER_INDEX.match(name))}
    if layers and max(layers) >= c.n_layers:
        _fail(gguf, f"{c.arch}.block_count = {c.n_layers}, but the file has tensors of layer {max(layers)}")
    if len(layers) < c.n_layers:
        missing = min(set(range(len(layers) + 1)) - layers)
        _fail(gguf, f"{c.arch}.block_count = {c.n_layers}, but the file has no tensors of layer {missing}")


def _check_vocabulary(gguf: GGUFFile, c: ModelConfig, n_vocab: int) -> None:
    """The embedding rows, the tokenizer's token list and ``{arch}.vocab_size`` must all count the same tokens."""
    if c.vocab_size != n_vocab:
        _fail(gguf, f"{c.arch}.vocab_size = {c.vocab_size}, but token_embd.weight has {n_vocab} rows")
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != n_vocab:
        _fail(gguf, f"the tokenizer has {len(tokens)} tokens (tokenizer.ggml.tokens), but token_embd.weight has "
                    f"{n_vocab} rows")


def _check_rope_divisors(gguf: GGUFFile) -> None:
    """Llama-3's per-frequency divisors (rope_dim / 2 values, read once here): a zero or NaN would turn every
    rotation angle into inf/NaN."""
    if "rope_freqs.weight" in gguf.tensors:
        factors = dequantize(gguf.tensors["rope_freqs.weight"])
        if not (np.isfinite(factors) & (factors > 0)).all():
            _fail(gguf, "tensor 'rope_freqs.weight' holds zero, negative or non-finite rope frequency divisors")


def _dims(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _fail(gguf: GGUFFile, reason: str) -> NoReturn:
    raise GGUFError(reason, path=gguf.path.name)
