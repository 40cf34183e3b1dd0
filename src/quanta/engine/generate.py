"""Drives an engine for callers in one process: the Python API's generate, stream and batch calls.

Each request's outputs wait in its own queue until its caller reads them, so several streams can be consumed in
any order and from several threads (one thread steps the engine at a time; the others read what it routed to
them). Closing a stream early aborts its request.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Generator, Iterator, Sequence as Seq
from typing import Any

from quanta.engine.llm_engine import LLMEngine
from quanta.engine.outputs import GenerationResult, RequestOutput
from quanta.engine.sampler import SamplingParams
from quanta.engine.stop import StopConditions
from quanta.errors import QuantaError


class RequestStreams:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[int, deque[RequestOutput]] = {}
        self.lock = threading.RLock()

    def submit(self, prompt: Seq[int], params: SamplingParams, stop: StopConditions, constraint: Any = None) -> int:
        with self.lock:
            rid = self.engine.add_request(prompt, params, stop, constraint)
            self._queues[rid] = deque()
            return rid

    def outputs(self, rid: int) -> Iterator[RequestOutput]:
        """``rid``'s outputs as the engine produces them, up to its finished one."""
        queue = self._queues[rid]
        done = False
        try:
            while not done:
                with self.lock:
                    while not queue:
                        self._step()
                    out = queue.popleft()
                done = out.finished
                yield out
        finally:
            with self.lock:
                if not done:  # the caller stopped reading: its abort output goes nowhere
                    self.engine.abort(rid)
                self._queues.pop(rid, None)
                self.engine.release(rid)

    def text(self, rid: int) -> Generator[str, None, GenerationResult]:
        """``rid``'s text pieces; returns its result."""
        pieces: list[str] = []
        ids: list[int] = []
        logprobs: list = []
        for out in self.outputs(rid):
            ids += out.new_token_ids
            logprobs += out.logprobs
            if out.text:
                pieces.append(out.text)
                yield out.text
            if out.finished:
                if out.finish_reason == "error":
                    raise QuantaError(out.error)
                return GenerationResult("".join(pieces), ids, out.finish_reason, out.stats, logprobs)
        raise AssertionError("unreachable: a request's outputs end with a finished one")

    def run(self, rids: list[int]) -> list[GenerationResult]:
        """Run the requests together to the end; their results in order."""
        gens = [self.text(rid) for rid in rids]
        results = []
        try:
            for gen in gens:
                results.append(drain(gen))
        finally:
            for gen in gens[len(results):]:
                gen.close()
        return results

    def _step(self) -> None:
        if not self.engine.has_unfinished():
            raise AssertionError("a stream waits for outputs of an engine with nothing to do")
        for out in self.engine.step():
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.append(out)


def drain(gen: Generator[Any, None, Any]) -> Any:
    """Run a generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value
