"""A model's hyper-parameters, read once from the GGUF metadata into a frozen dataclass.

Each value is checked as it is read: its type (an integer where an integer belongs), its range, and for the
per-layer arrays some conversions write, that every layer agrees. A bad value is a ``GGUFError`` naming the key;
how the values fit each other and the tensors is checked by ``quanta.models.validate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from quanta.errors import GGUFError, UnsupportedModelError
from quanta.gguf.reader import architecture_of

MAX_COUNT = 2**31 - 1  # sizes and positions are int32 in the kernels
FLOAT32_MAX = float(np.finfo(np.float32).max)
_REQUIRED = object()


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
        """The config in ``md``; ``n_vocab_rows`` (the embedding's rows) is the vocabulary size where the metadata
        states none. A missing, mistyped or out-of-range value is a ``GGUFError`` naming its key."""
        arch = architecture_of(md)
        hp = _HyperParameters(md, arch)
        d_model, n_heads = hp.count("embedding_length"), hp.count("attention.head_count")
        if hp.key("attention.key_length") not in md and d_model % n_heads:
            raise GGUFError(f"{hp.key('attention.head_count')} = {n_heads} does not divide "
                            f"{hp.key('embedding_length')} = {d_model}, and no {hp.key('attention.key_length')} "
                            f"gives the head size")
        head_dim = hp.count("attention.key_length", d_model // n_heads)
        rope_dim = hp.count("rope.dimension_count", head_dim, low=2)
        if rope_dim % 2:
            raise GGUFError(f"{hp.key('rope.dimension_count')} = {rope_dim}; expected an even number (rope "
                            f"rotates pairs of dimensions)")
        return ModelConfig(
            arch=arch,
            n_layers=hp.count("block_count"),
            d_model=d_model,
            d_ff=hp.count("feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=hp.count("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            value_dim=hp.count("attention.value_length", head_dim),
            n_ctx_train=hp.count("context_length"),
            vocab_size=hp.count("vocab_size") if hp.key("vocab_size") in md else n_vocab_rows,
            norm_eps=hp.number("attention.layer_norm_rms_epsilon", ok=lambda x: np.float32(x) > 0, expected="> 0"),
            rope_base=hp.number("rope.freq_base", 10000.0, ok=lambda x: x >= 1, expected=">= 1"),
            rope_dim=rope_dim,
            rope_scale=hp.rope_scale(),
            sliding_window=hp.count("attention.sliding_window", 0, low=0),
            attn_softcap=hp.number("attn_logit_softcapping", 0.0, ok=lambda x: x >= 0, expected=">= 0"),
            final_softcap=hp.number("final_logit_softcapping", 0.0, ok=lambda x: x >= 0, expected=">= 0"),
        )


class _HyperParameters:
    """Typed, range-checked reads of ``{arch}.…`` keys; errors name the key, its value and what was expected."""

    def __init__(self, md: dict[str, Any], arch: str):
        self.md, self.arch = md, arch

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def _value(self, name: str, default: Any) -> Any:
        key = self.key(name)
        v = self.md.get(key, default)
        if v is _REQUIRED:
            raise GGUFError(f"the metadata lacks {key}, which a {self.arch} model needs")
        return _one_for_all_layers(key, v)

    def count(self, name: str, default: Any = _REQUIRED, *, low: int = 1) -> int:
        """An integer in [low, MAX_COUNT] (a GGUF integer type: not a float, string or bool)."""
        v = self._value(name, default)
        if not _is_int(v) or not low <= v <= MAX_COUNT:
            raise GGUFError(f"{self.key(name)} is {_show(v)}; expected an integer from {low} to {MAX_COUNT:,}")
        return int(v)

    def number(self, name: str, default: Any = _REQUIRED, *, ok: Callable[[float], Any], expected: str) -> float:
        """A finite float32-representable number for which ``ok`` holds (``expected`` says what that is)."""
        v = self._value(name, default)
        if not (_is_int(v) or isinstance(v, (float, np.floating))) or not abs(float(v)) <= FLOAT32_MAX \
                or not ok(float(v)):
            raise GGUFError(f"{self.key(name)} is {_show(v)}; expected a finite number {expected}")
        return float(v)

    def rope_scale(self) -> float:
        """The linear rope factor (1 without scaling; 0 or a missing factor also mean 1, as in llama.cpp)."""
        key = self.key("rope.scaling.type")
        scaling = self.md.get(key, "none")
        if not isinstance(scaling, str):
            raise GGUFError(f"{key} is {_show(scaling)}; expected a string such as 'none' or 'linear'")
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"{key} {scaling!r} is not supported (supported: none, linear)")
        if scaling == "none":
            return 1.0
        factor = self.number("rope.scaling.factor", 0.0, ok=lambda x: x == 0 or x >= 1,
                             expected=">= 1 (a context extension; 0: none)")
        return factor or 1.0


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _one_for_all_layers(key: str, v: Any) -> Any:
    """A per-layer array of numbers whose entries all agree → that value; scalars pass through."""
    if isinstance(v, list):
        raise GGUFError(f"{key} is an array of {'strings' if v and isinstance(v[0], str) else 'arrays'}; "
                        f"expected a number")
    if not isinstance(v, np.ndarray):
        return v
    if v.size == 0 or v.dtype.kind not in "iuf":
        raise GGUFError(f"{key} is {_show(v)}; expected a number (or one per layer)")
    if v.dtype.kind == "f" and not np.isfinite(v).all():
        raise GGUFError(f"{key} holds non-finite values; expected finite numbers")
    if (v != v[0]).any():
        raise UnsupportedModelError(f"{key} differs between layers ({_show(v)}); quanta supports one value for "
                                    f"all layers")
    return v[0].item()


def _show(v: Any) -> str:
    """A value for an error message: short, and with its type where that is the problem."""
    if isinstance(v, np.ndarray):
        head = ", ".join(str(x) for x in v[:4].tolist()) + (", …" if v.size > 4 else "")
        return f"an array of {v.size} {v.dtype.name} [{head}]"
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    return f"{v!r} ({type(v).__name__})" if isinstance(v, bool) else repr(v)
