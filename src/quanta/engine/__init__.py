"""The engine: KV cache bookkeeping, sampling, stop strings and the generation loop."""

from quanta.engine.generate import GenerationResult, GenerationStats, StopConditions, generate_tokens
from quanta.engine.kv_cache import KVCache
from quanta.engine.sampler import Sampler, SamplingParams

__all__ = ["GenerationResult", "GenerationStats", "KVCache", "Sampler", "SamplingParams", "StopConditions",
           "generate_tokens"]
