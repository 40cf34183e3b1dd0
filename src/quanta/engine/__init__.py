"""The engine: sequences, the paged KV cache's block manager, the scheduler, the model runner, the sampler and the
loop that batches them (``LLMEngine``); ``RequestStreams`` drives it for in-process callers."""

from quanta.engine.config import EngineConfig
from quanta.engine.generate import RequestStreams
from quanta.engine.llm_engine import LLMEngine
from quanta.engine.outputs import GenerationResult, GenerationStats, RequestOutput, TokenLogprob
from quanta.engine.sampler import SamplingParams
from quanta.engine.stop import StopConditions

__all__ = ["EngineConfig", "GenerationResult", "GenerationStats", "LLMEngine", "RequestOutput", "RequestStreams",
           "SamplingParams", "StopConditions", "TokenLogprob"]
