"""The engine: requests in, one batched step at a time, outputs out.

A step is schedule → run → sample → postprocess: the scheduler picks the batch, the model runner computes its
logits, the sampler picks each finishing chunk's next token, and the sequences take their tokens (detokenized,
stop conditions checked). The engine is not thread-safe: one loop (the API's streams, the server) owns it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from quanta.backends.base import Backend
from quanta.engine.block_manager import BlockManager, BlockTable
from quanta.engine.config import EngineConfig
from quanta.engine.model_runner import ModelRunner
from quanta.engine.outputs import RequestOutput
from quanta.engine.sampler import BatchSampler, SamplingParams
from quanta.engine.scheduler import Scheduler
from quanta.engine.sequence import Sequence
from quanta.engine.stop import StopConditions
from quanta.errors import ContextOverflowError, QuantaError
from quanta.models.base import Model

NON_FINITE = ("the model produced non-finite logits (NaN or inf): its weights are probably corrupt "
              "(`quanta inspect --check MODEL` scans them)")


class LLMEngine:
    """Continuous batching over a paged KV cache for one model on one backend (see the package's modules)."""

    def __init__(self, model: Model, backend: Backend, tokenizer: Any, config: EngineConfig, n_ctx: int):
        self.config = config.resolved(backend.name)
        self.model, self.backend, self.tokenizer, self.n_ctx = model, backend, tokenizer, n_ctx
        self.runner = ModelRunner(model, backend, self.config, n_ctx)
        self.blocks = BlockManager(self.runner.n_blocks, self.config.block_size, self.config.prefix_caching)
        self.scheduler = Scheduler(self.config, self.blocks)
        self.sampler = BatchSampler(backend)
        self.requests: dict[int, Sequence] = {}
        self._ended: list[Sequence] = []  # ended outside a step (aborted, nothing to generate): reported next step
        self._ids = itertools.count()

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Seq[int], params: SamplingParams, stop: StopConditions,
                    constraint: Any = None) -> int:
        """Queue a request; returns its id. A prompt that can never run is refused here (ValueError,
        ContextOverflowError); everything else is reported through :meth:`step`'s outputs."""
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty (no tokens)")
        if len(prompt) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.n_ctx} (prompt + at least one "
                f"generated token); shorten the prompt or raise n_ctx")
        seq = Sequence(next(self._ids), prompt, params, stop, self.tokenizer.stream_decoder(skip_special=True),
                       frozenset(self.tokenizer.eog_ids), self.n_ctx, constraint)
        self.requests[seq.id] = seq
        if stop.max_tokens == 0:
            seq.finish("length")
            self._ended.append(seq)
        else:
            self.scheduler.add(seq)
        return seq.id

    def abort(self, request_id: int) -> None:
        """Stop a request now (its blocks are freed); its last output says ``finish_reason="abort"``."""
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self._ended.append(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._ended)

    def release(self, request_id: int) -> Sequence | None:
        """Forget a finished request (its caller has read its result)."""
        return self.requests.pop(request_id, None)

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled batch; an output for each request that gained tokens or finished."""
        outputs = [self._finished(seq) for seq in self._ended]
        self._ended.clear()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        logits = self.runner.run(batch)
        sampling = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        tokens, logprobs = self.sampler.sample(logits, sampling) if sampling else ([], [])
        self.scheduler.postprocess(batch)
        for seq, token, logprob in zip(sampling, tokens, logprobs):
            if token < 0:
                self.scheduler.finish(seq, "error", NON_FINITE)
                outputs.append(self._finished(seq))
                continue
            n_before = seq.num_tokens
            text = seq.append(token, logprob)
            new = [token] if seq.num_tokens > n_before else []
            if seq.finish_reason is not None:
                self.scheduler.finish(seq, seq.finish_reason)
                outputs.append(self._finished(seq, new, text, [logprob] if new and logprob else []))
            else:
                outputs.append(RequestOutput(seq.id, new, text, logprobs=[logprob] if logprob else []))
        return outputs

    @staticmethod
    def _finished(seq: Sequence, new: list[int] | None = None, text: str = "",
                  logprobs: list | None = None) -> RequestOutput:
        return RequestOutput(seq.id, new or [], text, True, seq.finish_reason, seq.error, logprobs or [], seq.stats)

    # ---- scoring and the cache -------------------------------------------------------------------------------
    def score(self, token_ids: Seq[int]) -> np.ndarray:
        """float32 (n, vocab): row i holds the next-token logits after token_ids[:i+1] (teacher forcing), computed
        in blocks of the pool that are freed afterwards (running requests are not disturbed)."""
        ids = list(token_ids)
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(f"{len(ids)} tokens do not fit in the context of {self.n_ctx}; raise n_ctx")
        table = BlockTable()
        if not self.blocks.grow(table, len(ids)):
            raise QuantaError(f"the KV pool has no room for {len(ids)} more tokens now; retry when requests finish")
        try:
            return self.runner.score(ids, table.blocks, self.config.max_batched_tokens)
        finally:
            self.blocks.free(table)

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()
