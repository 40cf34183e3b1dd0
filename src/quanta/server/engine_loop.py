"""The one thread that owns the engine (which is not thread-safe): submissions and aborts come in through a
thread-safe queue, the engine steps while it has work, and each step's outputs go to their requests' asyncio
queues in one ``call_soon_threadsafe`` per step.

Commands are taken between steps, so an abort (a client that left) takes effect before the next step and frees
the request's KV blocks at once. The n choices of a request share their prompt: the first is submitted, the
others once the first has been prefilled (its full prompt blocks are then in the prefix cache and they reuse
them). ``reserve`` counts sequences accepted and not yet ended against the server's capacity (the running batch
plus the queue limit), so a full server refuses a request before it is tokenized.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from quanta.engine import LLMEngine, RequestOutput
from quanta.server.metrics import Metrics
from quanta.server.protocol import Choice

SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class Accepted:
    """The engine took the request: streaming may start."""


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request (a ValueError or QuantaError naming why): nothing was generated."""

    error: Exception


@dataclass(frozen=True)
class Failed:
    """The request was ended by the server (shutdown, an engine failure), not by a stop condition."""

    message: str
    code: str


@dataclass(frozen=True)
class ChoiceOutput:
    index: int
    output: RequestOutput


class Job:
    """One HTTP request's choices. ``events`` (Accepted | Rejected, then ChoiceOutput | Failed) is read by the
    request's task; everything else belongs to the engine thread."""

    def __init__(self, choices: list[Choice], loop: asyncio.AbstractEventLoop):
        self.choices = choices
        self.loop = loop
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.rids: dict[int, int] = {}  # choice index → engine request id
        self.waiting: list[int] = []  # choices waiting for their leader's prefill
        self.aborted = False


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics, capacity: int):
        self.engine, self.metrics, self.capacity = engine, metrics, capacity
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0
        self._owners: dict[int, tuple[Job, int]] = {}  # engine request id → (job, choice index)
        self._last_token: dict[int, float] = {}
        self._outbox: list[tuple[Job, Any]] = []
        self._preemptions = engine.scheduler.preemptions
        self._thread = threading.Thread(target=self._run, name="quanta-engine", daemon=True)
        metrics.kv_total.set(engine.blocks.n_blocks)
        metrics.live.set_function(lambda: self._live)  # read when scraped: right even during a long step

    # ---- called from the server's event loop ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def reserve(self, n: int) -> bool:
        """Count ``n`` more sequences as live; False (nothing counted) when that passes the capacity."""
        with self._lock:
            if self._live + n > self.capacity:
                return False
            self._live += n
            return True

    @property
    def live(self) -> int:
        return self._live

    def submit(self, job: Job) -> None:
        """Queue ``job`` (reserved beforehand); its first event says whether the engine took it."""
        self._commands.put(("submit", job))

    def abort(self, job: Job) -> None:
        self._commands.put(("abort", job))

    def end_all(self, message: str, code: str) -> None:
        """End every live request with a ``Failed`` event (the server is shutting down)."""
        self._commands.put(("end_all", (message, code)))

    def stop(self, timeout: float = 10.0) -> None:
        """End what is left and stop the thread."""
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                for kind, arg in self._take(block=not self.engine.has_unfinished()):
                    stopping = stopping or kind == "stop"
                    if not stopping:
                        getattr(self, f"_{kind}")(arg)
                    elif kind == "submit":
                        self._release(len(arg.choices))
                        self._send(arg, Failed(SHUTTING_DOWN, "shutdown"))
                self._flush()  # acceptances and refusals go out before the step, not after it
                self._gauges()
                if stopping:
                    self._end_all((SHUTTING_DOWN, "shutdown"))
                elif self.engine.has_unfinished():
                    self._route(self.engine.step())
            except Exception:  # noqa: BLE001 - a bug: log it, end the requests it touched, keep serving
                traceback.print_exc(file=sys.stderr)
                self._fail_all()
            self._flush()
            self._gauges()

    def _take(self, block: bool) -> list[tuple[str, Any]]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _submit(self, job: Job) -> None:
        for i, choice in enumerate(job.choices):
            if choice.leader is not None:
                job.waiting.append(i)
                continue
            try:
                self._add(job, i)
            except Exception as e:  # noqa: BLE001 - ValueError / QuantaError: the request's fault; else a bug
                for rid in job.rids.values():
                    self.engine.abort(rid)
                    self._forget(rid)
                self._release(len(job.choices) - len(job.rids))
                job.aborted = True
                self._send(job, Rejected(e))
                return
        self._send(job, Accepted())

    def _add(self, job: Job, index: int) -> None:
        c = job.choices[index]
        constraint = None
        if c.grammar is not None:
            from quanta.engine.constraint import Constraint, ll_tokenizer

            constraint = Constraint(c.grammar, ll_tokenizer(self.engine.tokenizer, self.engine.model.n_vocab))
        rid = self.engine.add_request(c.prompt_ids, c.params, c.stop, constraint)
        job.rids[index] = rid
        self._owners[rid] = (job, index)

    def _abort(self, job: Job) -> None:
        if job.aborted:
            return
        job.aborted = True
        self._release(len(job.waiting))
        job.waiting.clear()
        for rid in job.rids.values():
            if rid in self._owners:
                self.engine.abort(rid)  # its "abort" output comes with the next step, and ends it

    def _end_all(self, arg: tuple[str, str]) -> None:
        message, code = arg
        for job in {job for job, _ in self._owners.values()}:
            self._send(job, Failed(message, code))
            self._abort(job)
        self._route(self.engine.step())  # the abort outputs: blocks freed, requests released

    def _fail_all(self) -> None:
        """After an exception inside the engine: every live request ends with an error."""
        for job in {job for job, _ in self._owners.values()}:
            self._send(job, Failed("the engine failed while generating; the error is in the server's log",
                                   "internal_error"))
            job.aborted = True
            self._release(len(job.waiting))
            job.waiting.clear()
        for rid in list(self._owners):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already broken; forget the request regardless
                pass
            self._forget(rid)

    def _route(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        m = self.metrics
        gained = tokens = 0
        for out in outputs:
            if out.new_token_ids:
                gained += 1
                tokens += len(out.new_token_ids)
                last = self._last_token.get(out.request_id)
                if last is not None:
                    m.token_latency.observe(now - last)
                self._last_token[out.request_id] = now
            owner = self._owners.get(out.request_id)
            if owner is not None:
                job, index = owner
                self._send(job, ChoiceOutput(index, out))
                if job.waiting and not job.aborted:
                    self._add_siblings(job, index)
            if out.finished:
                self._finished(out, owner is not None)
        if gained:
            m.generated_tokens.inc(tokens)
            m.step_sequences.observe(gained)

    def _add_siblings(self, job: Job, leader: int) -> None:
        for i in [i for i in job.waiting if job.choices[i].leader == leader]:
            job.waiting.remove(i)
            try:
                self._add(job, i)
            except Exception as e:  # noqa: BLE001 - same prompt as its leader: only a bug gets here
                self._release(1)
                self._send(job, Failed(f"choice {i} could not start: {e}", "internal_error"))

    def _finished(self, out: RequestOutput, owned: bool) -> None:
        """A request ended: counted, forgotten, released from the engine (owned or already orphaned)."""
        m = self.metrics
        m.finished.labels(out.finish_reason or "unknown").inc()
        stats = out.stats
        if owned and stats is not None and out.finish_reason in ("stop", "length"):
            m.prompt_tokens.inc(stats.prompt_tokens)
            m.cached_tokens.inc(stats.cached_tokens)
            if stats.completion_tokens:
                m.ttft.observe(stats.ttft_s)
        self._forget(out.request_id)
        self.engine.release(out.request_id)

    def _forget(self, rid: int) -> None:
        if self._owners.pop(rid, None) is not None:
            self._release(1)
        self._last_token.pop(rid, None)

    def _release(self, n: int) -> None:
        with self._lock:
            self._live -= n

    def _send(self, job: Job, event: Any) -> None:
        self._outbox.append((job, event))

    def _flush(self) -> None:
        """Hand this step's events to their requests: one callback per event loop."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Any]]] = {}
        for job, event in self._outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is waiting any more
                pass

    def _gauges(self) -> None:
        m, s, b = self.metrics, self.engine.scheduler, self.engine.blocks
        m.queue_depth.set(len(s.waiting))
        m.running.set(len(s.running))
        m.kv_used.set(b.n_used)
        m.kv_usage.set(b.n_used / b.n_blocks)
        if s.preemptions > self._preemptions:
            m.preemptions.inc(s.preemptions - self._preemptions)
            self._preemptions = s.preemptions


def _deliver(items: list[tuple[Job, Any]]) -> None:
    for job, event in items:
        job.events.put_nowait(event)
