"""The Python API: ``quanta.LLM`` loads a GGUF model once and generates, streams, chats and scores text.

Every call goes through one batched engine (quanta.engine): ``generate`` with a list of prompts runs them as one
batch, and streams consumed side by side (or from several threads) are decoded together.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from quanta.engine import EngineConfig, GenerationResult, SamplingParams, StopConditions
from quanta.engine.generate import drain
from quanta.engine.speculation import SPECULATIVE_METHODS, SpeculativeConfig
from quanta.errors import QuantaError

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "logit_bias", "logprobs")
STOP_KEYS = ("max_tokens", "stop", "ignore_eos")
CONSTRAINT_KEYS = ("json_schema", "regex", "grammar", "response_format")


class LLM:
    """A model ready to generate: ``LLM("smollm2-135m")`` or ``LLM("path/to/model.gguf", device="cpu")``.

    ``device``: "auto" (the default: the GPU where an NVIDIA GPU, torch with CUDA and triton are present, else the
    CPU), "cpu", "cuda" or "cuda:N"; ``n_ctx``: the longest sequence (default: the model's, at most 4096);
    ``threads``: CPU threads (default: all available cores); ``exact``: fp32 activations everywhere (the reference
    mode) instead of the fast 8-bit activation path; ``cpu_isa``: force the CPU's int8 kernels ("avx2",
    "avx_vnni", "avx512_vnni"; default: the fastest the CPU has); ``cuda``: the GPU backend's switches
    (``{"q8": False}``: float activations in the decode matmuls; ``{"pdl": False}``: no programmatic dependent
    launch; ``{"compile_ahead": False}``: each kernel compiles at its first launch, not all of a new shape's
    side by side first); ``tensor_parallel``: split the model over this many GPUs of the host (one process
    each, from ``device``'s GPU on: quanta.parallel); ``home``: the model cache (default ~/.cache/quanta). The
    engine's settings (``max_seqs``, ``max_batched_tokens``, ``block_size``, ``kv_blocks``, ``kv_memory``,
    ``kv_memory_fraction``, ``prefix_caching``) are :class:`quanta.engine.EngineConfig`'s; ``speculative="ngram"``
    turns on lossless n-gram speculative decoding (quanta.engine.speculation).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, device: str = "auto", n_ctx: int | None = None,
                 threads: int | None = None, exact: bool = False, cpu_isa: str | None = None,
                 cuda: dict[str, Any] | None = None, tensor_parallel: int = 1, home: str | os.PathLike | None = None,
                 progress: bool = False, **engine: Any):
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or a model name, got {type(model).__name__}")
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 2):
            raise ValueError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be a positive integer (GPUs), got {tensor_parallel!r}")
        spec = engine.pop("speculative", None)
        if spec is not None:
            if spec not in SPECULATIVE_METHODS:
                raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} or None, got {spec!r}")
            engine["speculative"] = SpeculativeConfig()
        try:
            config = EngineConfig(**engine)
        except TypeError:
            unknown = ", ".join(sorted(set(engine) - set(EngineConfig.__dataclass_fields__)))
            raise ValueError(f"unknown LLM option(s): {unknown}") from None
        self._closed = False
        self._group: Any = None  # the tensor-parallel group this process leads
        with _collector_paused():
            self._load(model, device, n_ctx, dict(threads=threads, exact=exact, cpu_isa=cpu_isa, cuda=cuda), home,
                       progress, config, tensor_parallel)

    def _load(self, model: str | os.PathLike | None, device: str, n_ctx: int | None, backend: dict[str, Any],
              home: str | os.PathLike | None, progress: bool, config: EngineConfig, tensor_parallel: int) -> None:
        from quanta import gguf, prepare_cpu_runtime
        from quanta.backends import get_backend, resolve_device
        from quanta.engine import LLMEngine, RequestStreams
        from quanta.hub import resolve_model
        from quanta.models import load_model, model_class
        from quanta.tokenizer import load_tokenizer

        self.path = resolve_model(model, home=home, progress=progress)
        self.gguf = gguf.open(self.path)
        model_class(str(self.gguf.architecture or "<missing>"))  # unsupported: fail before anything heavy
        if isinstance(device, str) and resolve_device(device) == "cpu":
            prepare_cpu_runtime()  # before the CPU libraries load
        if tensor_parallel > 1:
            self._lead_group(device, n_ctx, backend, tensor_parallel)
            config = self._group.engine_config(config)
        else:
            self.backend = get_backend(device, **backend)
            self.model = load_model(self.gguf, self.backend, n_ctx)  # checks the file before the tokenizer reads it
        self.n_ctx = self.model.n_ctx
        self.tokenizer = load_tokenizer(self.gguf, home=home)
        self.engine = LLMEngine(self.model, self.backend, self.tokenizer, config, self.n_ctx)
        self._streams = RequestStreams(self.engine)

    def _lead_group(self, device: str, n_ctx: int | None, backend: dict[str, Any], world: int) -> None:
        """Start the tensor-parallel group of ``world`` GPUs; this process is its rank 0."""
        from quanta.backends import resolve_device
        from quanta.models import model_config
        from quanta.parallel.launch import GroupSpec, LeadRank, gpu_devices

        if not isinstance(device, str) or not resolve_device(device).startswith("cuda"):
            raise QuantaError(f"tensor parallelism runs on CUDA GPUs, not on device {device!r} (--device cuda)")
        model_config(self.gguf)  # a broken file fails here, before any process starts
        switches = {"exact": backend["exact"], **(backend["cuda"] or {})}
        self._group = LeadRank(GroupSpec(str(self.path), gpu_devices(resolve_device(device), world), n_ctx,
                                         switches))
        self.backend, self.model = self._group.backend, self._group.model

    @property
    def config(self) -> Any:
        return self.model.config

    # ---- text <-> ids ----------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self._check_open()
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        self._check_open()
        return self.tokenizer.decode(self._ids(ids), skip_special=skip_special)

    # ---- generation ------------------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int] | list[str | Sequence[int]],
                 **kwargs: Any) -> GenerationResult | list[GenerationResult]:
        """Complete ``prompt`` (raw text, no chat template, or token ids); a list of prompts runs as one batch and
        returns a list of results in the same order. Keyword arguments: max_tokens (256), temperature (0.8; 0 =
        greedy), top_k (40), top_p (0.95), min_p (0.05), repeat_penalty (1.0), presence_penalty,
        frequency_penalty, seed, stop (str or list), ignore_eos, logit_bias ({token id: bias}), logprobs (None,
        or how many alternatives to report per token); and at most one output constraint: json_schema (a dict or
        its JSON text), regex (the whole output matches it), grammar (GBNF, as llama.cpp's, or Lark), or
        response_format (OpenAI's: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
        ...}}). A constrained request ends when its output is complete."""
        if _is_batch(prompt):
            if not prompt:
                raise ValueError("the list of prompts is empty")
            params, stop = _settings(kwargs)
            grammar = self._grammar(kwargs)
            rids = [self._submit(self._prompt_ids(p), params, stop, grammar) for p in prompt]
            return self._streams.run(rids)
        return drain(self._start(self._prompt_ids(prompt), kwargs))

    def stream(self, prompt: str | Sequence[int], **kwargs: Any) -> Iterator[str]:
        """Like ``generate`` but yields text pieces as they are decoded; ``last_result`` holds the result."""
        return self._pieces(self._start(self._prompt_ids(prompt), kwargs))

    def chat(self, messages: list[dict[str, Any]], *, stream: bool = False,
             **kwargs: Any) -> GenerationResult | Iterator[str]:
        """Reply to ``messages`` ([{"role": ..., "content": ...}]) through the model's chat template."""
        gen = self._start(self.chat_prompt(messages), kwargs)
        return self._pieces(gen) if stream else drain(gen)

    def stream_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> Iterator[str]:
        return self._pieces(self._start(self.chat_prompt(messages), kwargs))

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of ``messages`` rendered by the chat template, ready for the assistant's turn."""
        self._check_open()
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True, max_tokens=self.n_ctx)

    def _start(self, ids: list[int], kwargs: dict[str, Any]) -> Any:
        """The request's text generator; the request is queued (and validated) before the first piece is asked
        for."""
        self.last_result = None
        return self._streams.text(self._submit(ids, *_settings(kwargs), self._grammar(kwargs)))

    def _submit(self, ids: list[int], params: SamplingParams, stop: StopConditions, grammar: Any = None) -> int:
        constraint = None
        if grammar is not None:
            from quanta.engine.constraint import Constraint, ll_tokenizer

            constraint = Constraint(grammar, ll_tokenizer(self.tokenizer, self.model.n_vocab))
        return self._streams.submit(ids, params, stop, constraint)

    @staticmethod
    def _grammar(kwargs: dict[str, Any]) -> Any:
        """The checked grammar of the one constraint in ``kwargs`` (quanta.engine.constraint.Grammar), or None."""
        given = {k: kwargs[k] for k in CONSTRAINT_KEYS if kwargs.get(k) is not None}
        if not given:
            return None  # llguidance is not loaded for unconstrained requests
        from quanta.engine.constraint import Grammar

        return Grammar.from_keywords(given)

    def _pieces(self, gen: Any) -> Iterator[str]:
        try:
            while True:
                yield next(gen)
        except StopIteration as done:
            self.last_result = done.value
        finally:
            gen.close()

    # ---- scoring ---------------------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 (n, vocab): row i holds the next-token logits after token_ids[:i+1] (teacher forcing)."""
        ids = self._ids(token_ids)
        if not ids:
            raise ValueError("token_ids is empty")
        with self._streams.lock:
            return self.engine.score(ids)

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
            self._check_open()
            return self.tokenizer.encode(prompt, max_tokens=self.n_ctx)  # a huge text is refused untokenized
        return self._ids(prompt)

    def _ids(self, ids: Sequence[int]) -> list[int]:
        self._check_open()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
            raise ValueError(f"expected a string or a list of token ids, got {type(ids).__name__}")
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
            raise ValueError("token ids must be integers")
        out = [int(i) for i in ids]
        bad = [i for i in out if not 0 <= i < self.model.n_vocab]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {self.model.n_vocab}), got {bad[:5]}")
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise QuantaError("this LLM is closed (after close() or its `with` block); load the model again")

    def close(self) -> None:
        self._closed = True
        if self._group is not None:
            self._group.close()
            self._group = None
        self.gguf.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LLM({self.path.name!r}, arch={self.config.arch}, device={self.backend.name}, n_ctx={self.n_ctx})"


def _is_batch(prompt: Any) -> bool:
    """A list of prompts (strings or token-id lists), as opposed to one prompt of token ids."""
    return isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], (str, list, tuple,
                                                                                       np.ndarray)))


def _settings(kwargs: dict[str, Any]) -> tuple[SamplingParams, StopConditions]:
    unknown = set(kwargs) - set(SAMPLING_KEYS) - set(STOP_KEYS) - set(CONSTRAINT_KEYS)
    if unknown:
        raise ValueError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
    stop = kwargs.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else stop
    if stops is not None and not isinstance(stops, tuple):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    params = SamplingParams(**{k: kwargs[k] for k in SAMPLING_KEYS if k in kwargs})
    conditions = StopConditions(max_tokens=kwargs.get("max_tokens", 256), stop=stops or (),
                                ignore_eos=bool(kwargs.get("ignore_eos", False)))
    return params, conditions


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Load with Python's cyclic garbage collector paused; after the process's first load, freeze the heap.

    Loading creates ~60k long-lived objects (numba's compiler, the vocabulary) and next to no garbage: the
    collector ran ~270 times over them while they were created (2 full passes), 50-60 ms of SmolLM2's 0.38 s cold
    start. ``gc.freeze`` (as vLLM does after its warm-up) then moves everything alive to the permanent
    generation, which later collections skip; a reference cycle among those objects that dies later is not
    reclaimed (reference counting still frees everything else)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
    if gc.get_freeze_count() == 0:
        gc.freeze()


__all__ = ["LLM"]
