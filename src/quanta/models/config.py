"""A model's hyper-parameters, read once from the GGUF metadata into a frozen dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from quanta.errors import QuantaError


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward needs besides the tensors. Keys are ``{arch}.…`` as written by llama.cpp."""

    arch: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # of queries and keys (``attention.key_length``, default d_model / n_heads)
    value_dim: int
    n_ctx_train: int
    vocab_size: int
    norm_eps: float
    rope_base: float
    rope_dim: int  # rotated dims per head (``rope.dimension_count``, default head_dim)
    rope_scale: float = 1.0  # linear rope scaling factor (positions are divided by it)
    sliding_window: int = 0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @staticmethod
    def from_metadata(md: dict[str, Any], n_vocab_rows: int) -> ModelConfig:
        arch = md["general.architecture"]

        def get(key: str, default: Any = None) -> Any:
            v = md.get(f"{arch}.{key}", default)
            if v is None:
                raise QuantaError(f"the {arch} model's metadata lacks '{arch}.{key}'")
            return v

        d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
        n_kv = get("attention.head_count_kv", n_heads)
        if not isinstance(n_kv, (int, float)):  # per-layer arrays (some conversions): all equal here
            n_kv = int(max(n_kv))
        head_dim = int(get("attention.key_length", d_model // n_heads))
        scaling = md.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise QuantaError(f"rope scaling type {scaling!r} is not supported (supported: none, linear)")
        factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
        return ModelConfig(
            arch=arch,
            n_layers=int(get("block_count")),
            d_model=d_model,
            d_ff=int(get("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            value_dim=int(get("attention.value_length", head_dim)),
            n_ctx_train=int(get("context_length")),
            vocab_size=int(md.get(f"{arch}.vocab_size", n_vocab_rows)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_scale=factor,
            sliding_window=int(get("attention.sliding_window", 0)),
            attn_softcap=float(get("attn_logit_softcapping", 0.0)),
            final_softcap=float(get("final_logit_softcapping", 0.0)),
        )
