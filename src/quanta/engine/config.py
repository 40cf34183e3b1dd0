"""The engine's settings, fixed when an engine is built: batch limits, the paged KV pool, prefix caching."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quanta.engine.speculation import SpeculativeConfig

DEFAULT_BLOCK_SIZE = 16
KV_DTYPES = ("auto", "f32", "f16", "q8")
DEFAULT_MAX_SEQS = {"cpu": 8, "cuda": 256}
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True)
class EngineConfig:
    """``None`` fields take the backend's default (``resolved`` fills them in).

    max_seqs: sequences decoded together in one step (CPU 8, CUDA 256).
    max_batched_tokens: tokens one forward may hold (prefill chunks + decode tokens; CPU 512, CUDA 2048): a longer
        prompt is prefilled in chunks, so prefill scratch stays linear in the prompt.
    block_size: tokens per KV block (the unit of allocation and of prefix reuse).
    kv_blocks: blocks in the KV pool; else ``kv_memory`` bytes; else room for ``max_seqs`` full contexts, at most
        ``kv_memory_fraction`` of the device's free memory after the weights.
    prefix_caching: full blocks are shared by requests whose tokens up to them are identical.
    speculative: n-gram speculative decoding's settings (``SpeculativeConfig``), or None (off).
    kv_dtype: how the pool stores K and V: "auto" (f32 in exact mode, f16 otherwise), "f32", "f16",
        or "q8" (int8 with one scale per token and KV head: about a quarter of f32's bytes).
    """

    max_seqs: int | None = None
    max_batched_tokens: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_blocks: int | None = None
    kv_memory: int | None = None
    kv_memory_fraction: float = 0.9
    prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_batched_tokens", "kv_blocks", "kv_memory"):
            _positive_int(name, getattr(self, name), optional=True)
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        f = self.kv_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {f!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}")


    def resolved(self, device: str) -> EngineConfig:
        """This config with the defaults of ``device`` ("cpu" or "cuda") filled in."""
        max_seqs = self.max_seqs or DEFAULT_MAX_SEQS.get(device, 8)
        budget = self.max_batched_tokens or DEFAULT_BATCHED_TOKENS.get(device, 512)
        if budget < max_seqs:
            raise ValueError(f"max_batched_tokens ({budget}) must be at least max_seqs ({max_seqs}): every running "
                             f"sequence needs room for its next token in each step")
        return replace(self, max_seqs=max_seqs, max_batched_tokens=budget)


def _positive_int(name: str, value: object, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
