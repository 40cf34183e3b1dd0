"""The two engines `quanta bench` measures, behind one small interface: prefill a prompt, decode n tokens.

Both feed the same token ids and decode greedily, so the work is the same; times are host wall-clock around
calls that return only once the work is done (quanta's generate, llama.cpp's eval).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from quanta.errors import QuantaError

LLAMA_CPP_MISSING = ("--vs llama.cpp needs llama-cpp-python, which is not installed: run `make bench-deps` in the "
                     "quanta checkout (it builds llama.cpp for this CPU, ~11 minutes)")


@dataclass
class RunTimes:
    """One measured run: prompt processing (TTFT) and per-token decode times."""

    prompt_tokens: int
    ttft_s: float
    decode_s: list[float]

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tok_s(self) -> float:
        return len(self.decode_s) / sum(self.decode_s) if self.decode_s else 0.0


class BenchEngine(Protocol):
    name: str

    def run(self, prompt: list[int], n_decode: int) -> RunTimes:
        """Prefill ``prompt`` into an empty context, then decode ``n_decode`` tokens greedily."""


class QuantaEngine:
    """quanta through its Python API."""

    name = "quanta"

    def __init__(self, model: str, *, device: str, threads: int, n_ctx: int, exact: bool = False,
                 cpu_isa: str | None = None, cuda: dict | None = None, kv_type: str = "auto",
                 tensor_parallel: int = 1):
        from quanta import LLM

        self.kv_type = kv_type
        self.llm = LLM(model, device=device, threads=threads, n_ctx=n_ctx, exact=exact, cpu_isa=cpu_isa, cuda=cuda,
                       max_seqs=1, kv_dtype=kv_type, tensor_parallel=tensor_parallel)

    def kv_bytes_per_value(self) -> float:
        """Bytes the KV pool spends per cached K or V value (scales included)."""
        shape = self.llm.engine.runner.cache.shape
        return self.llm.backend.kv_nbytes(shape, self.kv_type) / shape.nbytes(1)

    def run(self, prompt: list[int], n_decode: int) -> RunTimes:
        self.llm.engine.reset_prefix_cache()  # an empty context: no prompt-prefix reuse from the previous run
        result = self.llm.generate(prompt, max_tokens=n_decode + 1, temperature=0.0, ignore_eos=True)
        s = result.stats
        decode_s = [1.0 / s.decode_tok_s] * n_decode if s.decode_tok_s else []
        return RunTimes(len(prompt), s.ttft_s, decode_s)


def require_llama_cpp() -> None:
    """A one-line error naming the make target when llama-cpp-python is missing."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise QuantaError(LLAMA_CPP_MISSING)


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python (logits for the last position only, as in its default)."""

    name = "llama.cpp"

    def __init__(self, model: str, *, threads: int, n_ctx: int, n_batch: int = 512):
        try:
            import llama_cpp
        except ImportError:
            raise QuantaError(LLAMA_CPP_MISSING) from None
        self.llm = llama_cpp.Llama(model_path=str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=n_batch, n_ubatch=n_batch, logits_all=False, verbose=False)

    def run(self, prompt: list[int], n_decode: int) -> RunTimes:
        llm = self.llm
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        token = self._greedy()
        ttft = time.perf_counter() - t
        decode = []
        for _ in range(n_decode):
            t = time.perf_counter()
            llm.eval([token])
            token = self._greedy()
            decode.append(time.perf_counter() - t)
        return RunTimes(len(prompt), ttft, decode)

    def _greedy(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))
