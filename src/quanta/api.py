"""The Python API: ``quanta.LLM`` loads a GGUF model once and generates, streams, chats and scores text."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from quanta.engine import GenerationResult, KVCache, SamplingParams, StopConditions, generate_tokens
from quanta.errors import ContextOverflowError

DEFAULT_N_CTX = 4096
LOGITS_CHUNK = 512  # teacher-forced scoring runs this many tokens per forward


class LLM:
    """A model ready to generate: ``LLM("smollm2-135m")`` or ``LLM("path/to/model.gguf", device="cpu")``.

    ``device``: "auto" (the default: the GPU where an NVIDIA GPU, torch with CUDA and triton are present, else the
    CPU), "cpu", "cuda" or "cuda:N"; ``n_ctx``: context length (default: the model's, at most 4096); ``threads``:
    CPU threads (default: all available cores); ``exact``: fp32 activations everywhere (the reference mode) instead
    of the fast 8-bit activation path.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, device: str = "auto", n_ctx: int | None = None,
                 threads: int | None = None, exact: bool = False, progress: bool = False):
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 2):
            raise ValueError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
        with _collector_paused():
            self._load(model, device, n_ctx, threads, exact, progress)

    def _load(self, model: str | os.PathLike | None, device: str, n_ctx: int | None, threads: int | None,
              exact: bool, progress: bool) -> None:
        from quanta import gguf
        from quanta.backends import get_backend
        from quanta.hub import resolve_model
        from quanta.models import load_model, model_class
        from quanta.tokenizer import load_tokenizer

        self.path = resolve_model(model, progress=progress)
        self.gguf = gguf.open(self.path)
        model_class(str(self.gguf.metadata.get("general.architecture", "<missing>")))  # unsupported: fail early
        self.backend = get_backend(device, threads=threads, exact=exact)
        self.tokenizer = load_tokenizer(self.gguf)
        arch = self.gguf.metadata["general.architecture"]
        n_ctx_train = int(self.gguf.metadata.get(f"{arch}.context_length", DEFAULT_N_CTX))
        self.n_ctx = n_ctx or min(n_ctx_train, DEFAULT_N_CTX)
        self.model = load_model(self.gguf, self.backend, self.n_ctx)
        self.kv = KVCache(self.backend, self.model.kv_shape())

    @property
    def config(self) -> Any:
        return self.model.config

    # ---- text <-> ids ----------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.tokenizer.decode(self._ids(ids), skip_special=skip_special)

    # ---- generation ------------------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        """Complete ``prompt`` (raw text, no chat template, or token ids). Keyword arguments: max_tokens (256),
        temperature (0.8; 0 = greedy), top_k (40), top_p (0.95), min_p (0.05), repeat_penalty (1.0),
        presence_penalty, frequency_penalty, seed, stop (str or list), ignore_eos."""
        return _drain(self._run(self._prompt_ids(prompt), **kwargs))

    def stream(self, prompt: str | Sequence[int], **kwargs: Any) -> Iterator[str]:
        """Like ``generate`` but yields text pieces as they are decoded; ``last_result`` holds the result."""
        return self._stream(self._prompt_ids(prompt), kwargs)

    def chat(self, messages: list[dict[str, Any]], *, stream: bool = False,
             **kwargs: Any) -> GenerationResult | Iterator[str]:
        """Reply to ``messages`` ([{"role": ..., "content": ...}]) through the model's chat template."""
        ids = self.chat_prompt(messages)
        return self._stream(ids, kwargs) if stream else _drain(self._run(ids, **kwargs))

    def stream_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> Iterator[str]:
        return self._stream(self.chat_prompt(messages), kwargs)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of ``messages`` rendered by the chat template, ready for the assistant's turn."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def _stream(self, ids: list[int], kwargs: dict[str, Any]) -> Iterator[str]:
        self.last_result = None
        gen = self._run(ids, **kwargs)  # validates before the first piece is asked for
        return self._pieces(gen)

    def _pieces(self, gen: Any) -> Iterator[str]:
        try:
            while True:
                yield next(gen)
        except StopIteration as done:
            self.last_result = done.value

    def _run(self, ids: list[int], *, max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
             top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
             ignore_eos: bool = False) -> Any:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, seed=seed)
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        conditions = StopConditions(max_tokens=max_tokens, stop=stops, ignore_eos=bool(ignore_eos))
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} (prompt + at least one "
                f"generated token); shorten the prompt or raise n_ctx")
        return generate_tokens(self.backend, self.model, self.kv, self.tokenizer, ids, params, conditions)

    # ---- scoring ---------------------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 (n, vocab): row i holds the next-token logits after token_ids[:i+1] (teacher forcing)."""
        ids = self._ids(token_ids)
        if not ids:
            raise ValueError("token_ids is empty")
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(f"{len(ids)} tokens do not fit in the context of {self.n_ctx}; raise n_ctx")
        self.kv.reset()
        out = np.empty((len(ids), self.model.n_vocab), np.float32)
        for start in range(0, len(ids), LOGITS_CHUNK):
            chunk = np.asarray(ids[start:start + LOGITS_CHUNK], np.int32)
            rows = self.backend.forward(self.model, chunk, start, self.kv.arena, all_logits=True)
            out[start:start + len(chunk)] = self.backend.to_host(rows)
        self.kv.tokens = list(ids)
        return out

    def perplexity(self, text: str | Sequence[int]) -> float:
        """exp(mean negative log-likelihood) of the text's tokens, each predicted from those before it."""
        ids = self._prompt_ids(text)
        if len(ids) < 2:
            raise ValueError("perplexity needs at least two tokens")
        logits = self.logits(ids)[:-1].astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        nll = log_z - logits[np.arange(len(ids) - 1), ids[1:]]
        return float(np.exp(nll.mean()))

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        return self._ids(prompt)

    def _ids(self, ids: Sequence[int]) -> list[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
            raise ValueError(f"expected a string or a list of token ids, got {type(ids).__name__}")
        out = [int(i) for i in ids]
        bad = [i for i in out if not 0 <= i < self.model.n_vocab]
        if bad or any(isinstance(i, bool) for i in ids):
            raise ValueError(f"token ids must be integers in [0, {self.model.n_vocab}), got {bad[:5]}")
        return out

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LLM({self.path.name!r}, arch={self.config.arch}, device={self.backend.name}, n_ctx={self.n_ctx})"


_heap_frozen = False


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Load with Python's cyclic garbage collector paused; after the process's first load, freeze the heap.

    Loading creates ~60k long-lived objects (numba's compiler, the vocabulary) and next to no garbage: the
    collector ran ~270 times over them while they were created (2 full passes), 50-60 ms of SmolLM2's 0.38 s cold
    start. ``gc.freeze`` (as vLLM does after its warm-up) then moves everything alive to the permanent
    generation, which later collections skip; a reference cycle among those objects that dies later is not
    reclaimed (reference counting still frees everything else)."""
    global _heap_frozen
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
    if not _heap_frozen:
        _heap_frozen = True
        gc.freeze()


def _drain(gen: Any) -> GenerationResult:
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


__all__ = ["LLM"]
