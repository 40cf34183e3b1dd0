"""llama.cpp's own parallel decoding as the peer of `quanta bench --concurrency --vs llama.cpp` on the CPU.

Through llama-cpp-python's low-level batch API (``llama_batch`` / ``llama_decode``), the way
``llama-batched-bench`` drives the library: one context with a sequence per request and one unified KV buffer;
every prompt prefilled (a batch of up to ``n_batch`` tokens per decode call), then one decode call per step
holding every sequence's next token, each sequence's greedy token read from its logits row. The burst's figures
have the shape of ``serving.run_burst``'s.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from quanta.bench.engines import require_llama_cpp
from quanta.errors import QuantaError


class LlamaCppBatched:
    name = "llama.cpp"

    def __init__(self, model: Path, *, threads: int, n_ctx_per_seq: int, max_seqs: int, n_batch: int = 512):
        require_llama_cpp()
        import llama_cpp
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # its loader's messages: errors only
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(model).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise QuantaError(f"llama.cpp could not load {model}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx_per_seq * max_seqs
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise QuantaError("llama.cpp could not create its context")
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise QuantaError("llama.cpp's llama_decode failed (its KV cache is too small?)")

    def _greedy(self, row: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def run_burst(self, prompts: list[list[int]], decode_tokens: int) -> dict[str, Any]:
        """Every prompt at once, then ``decode_tokens`` greedy tokens each (past end-of-generation); ``tokens``:
        each sequence's."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        items = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        last = {}
        for start in range(0, len(items), self.n_batch):
            chunk = items[start:start + self.n_batch]
            self._decode(chunk)
            for row, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    last[seq] = self._greedy(row)
        t_first = time.perf_counter()
        tokens = [last[s] for s in range(len(prompts))]
        generated = [[t] for t in tokens]
        step_times = []
        for step in range(decode_tokens - 1):
            t = time.perf_counter()
            self._decode([(tokens[s], len(prompts[s]) + step, s, True) for s in range(len(prompts))])
            tokens = [self._greedy(s) for s in range(len(prompts))]
            for out, t in zip(generated, tokens):
                out.append(t)
            step_times.append(time.perf_counter() - t)
        t_end = time.perf_counter()
        n = len(prompts)
        decode_s = t_end - t_first
        return {"prefill_tok_s": sum(map(len, prompts)) / (t_first - t0),
                "decode_tok_s": n * (decode_tokens - 1) / decode_s if decode_s > 0 else float("nan"),
                "per_seq_decode_tok_s": (decode_tokens - 1) / decode_s if decode_s > 0 else float("nan"),
                "total_s": t_end - t0, "steps": len(step_times) + 1, "ttft_s": [t_first - t0] * n,
                "step_ms_median": 1e3 * statistics.median(step_times) if step_times else float("nan"),
                "tokens": generated}
