"""The engine's own process: it loads the model, takes commands from the server's process through a pipe, steps
the engine while it has work, and sends each step's events back in one message.

The engine runs apart from the HTTP side so that the two never wait for each other's Python: a step's host work
and the streams' JSON and socket writes would otherwise share one interpreter lock, and every token written would
lengthen the next step (vLLM splits its engine core off for the same reason). Commands are taken between steps,
so an abort (a client that left) takes effect before the next step and frees the request's KV blocks at once.
The n choices of a request share their prompt: the first is submitted, the others once the first has been
prefilled (its full prompt blocks are then in the prefix cache and they reuse them).

Messages, server → engine: ``("submit", job id, choices)``, ``("abort", job id)``, ``("end_all", (message,
code))``, ``("stop", None)``. Engine → server: ``("ready", ModelInfo)`` or ``("load_failed", user error?,
message)`` once, then ``("step", StepReport)`` per step, and ``("stopped", None)`` last.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from quanta.engine import RequestOutput
from quanta.errors import is_user_error

SHUTTING_DOWN = "the server is shutting down"


# ---- what travels back -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Accepted:
    """The engine took the request: streaming may start."""


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request; ``user``: the request's fault (a 400), else a bug (a 500)."""

    message: str
    user: bool


@dataclass(frozen=True)
class Failed:
    """The request was ended by the server (shutdown, an engine failure), not by a stop condition."""

    message: str
    code: str


@dataclass(frozen=True)
class ChoiceOutput:
    index: int
    output: RequestOutput


@dataclass(frozen=True)
class ModelInfo:
    """What the server's process needs of the loaded model (it loads the tokenizer itself)."""

    n_ctx: int
    n_vocab: int
    device: str
    max_seqs: int
    kv_blocks: int


@dataclass
class StepReport:
    """One step's events, in order, as (job id, event); sequences ended (their capacity released); and the
    figures the server's metrics take (quanta.server.metrics.Metrics.record)."""

    events: list[tuple[int, Any]] = field(default_factory=list)
    released: int = 0
    done: list[int] = field(default_factory=list)  # jobs the engine holds no more
    token_gaps: list[float] = field(default_factory=list)  # seconds between a sequence's tokens
    tokens: int = 0
    gained: int = 0  # sequences that gained tokens in the step
    finished: list[tuple[str, Any]] = field(default_factory=list)  # (reason, stats counted or None)
    gauges: tuple[int, int, int, int] = (0, 0, 0, 0)  # waiting, running, KV blocks used, preemptions so far


# ---- the engine side ---------------------------------------------------------------------------------------------
class _Job:
    def __init__(self, job_id: int, choices: list[Any]):
        self.id, self.choices = job_id, choices
        self.rids: dict[int, int] = {}  # choice index → engine request id
        self.waiting: list[int] = []  # choices waiting for their leader's prefill
        self.aborted = False


class EngineCore:
    """The engine and the requests it runs; ``run`` serves ``conn`` until a stop command or the pipe closes."""

    def __init__(self, engine: Any, conn: Connection):
        self.engine, self.conn = engine, conn
        self._jobs: dict[int, _Job] = {}
        self._owners: dict[int, tuple[_Job, int]] = {}  # engine request id → (job, choice index)
        self._last_token: dict[int, float] = {}
        self._report = StepReport()

    def run(self) -> None:
        stopping = False
        while not stopping:
            try:
                for kind, *args in self._take(block=not self.engine.has_unfinished()):
                    stopping = stopping or kind == "stop"
                    if not stopping:
                        getattr(self, f"_{kind}")(*args)
                    elif kind == "submit":
                        self._report.released += len(args[1])
                        self._send(args[0], Failed(SHUTTING_DOWN, "shutdown"))
                self._flush()  # acceptances and refusals go out before the step, not after it
                if stopping:
                    self._end_all((SHUTTING_DOWN, "shutdown"))
                elif self.engine.has_unfinished():
                    self._route(self.engine.step())
                self._flush()
            except (EOFError, BrokenPipeError, ConnectionResetError):  # the server's process is gone
                return
            except Exception:  # noqa: BLE001 - a bug: log it, end the requests it touched, keep serving
                traceback.print_exc(file=sys.stderr)
                self._fail_all()
        self._flush()
        self.conn.send(("stopped", None))

    def _take(self, block: bool) -> list[tuple[Any, ...]]:
        commands = [self.conn.recv()] if block else []
        while self.conn.poll():
            commands.append(self.conn.recv())
        return commands

    def _submit(self, job_id: int, choices: list[Any]) -> None:
        job = self._jobs[job_id] = _Job(job_id, choices)
        for i, choice in enumerate(choices):
            if choice.leader is not None:
                job.waiting.append(i)
                continue
            try:
                self._add(job, i)
            except Exception as e:  # noqa: BLE001 - ValueError / QuantaError: the request's fault; else a bug
                for rid in job.rids.values():
                    self.engine.abort(rid)
                    self._forget(rid)
                self._report.released += len(choices) - len(job.rids)
                job.aborted = True
                self._send(job_id, Rejected(str(e), is_user_error(e)))
                self._drop_if_done(job)
                return
        self._send(job_id, Accepted())

    def _add(self, job: _Job, index: int) -> None:
        c = job.choices[index]
        constraint = None
        if c.grammar is not None:
            from quanta.engine.constraint import Constraint, ll_tokenizer

            constraint = Constraint(c.grammar, ll_tokenizer(self.engine.tokenizer, self.engine.model.n_vocab))
        rid = self.engine.add_request(c.prompt_ids, c.params, c.stop, constraint)
        job.rids[index] = rid
        self._owners[rid] = (job, index)

    def _abort(self, job_id: int) -> None:
        job = self._jobs.get(job_id)
        if job is None or job.aborted:
            return
        job.aborted = True
        self._report.released += len(job.waiting)
        job.waiting.clear()
        for rid in job.rids.values():
            if rid in self._owners:
                self.engine.abort(rid)  # its "abort" output comes with the next step, and ends it
        self._drop_if_done(job)

    def _end_all(self, arg: tuple[str, str]) -> None:
        message, code = arg
        for job in {job for job, _ in self._owners.values()}:
            self._send(job.id, Failed(message, code))
            self._abort(job.id)
        self._route(self.engine.step())  # the abort outputs: blocks freed, requests released

    def _fail_all(self) -> None:
        """After an exception inside the engine: every live request ends with an error."""
        for job in list(self._jobs.values()):
            self._send(job.id, Failed("the engine failed while generating; the error is in the server's log",
                                      "internal_error"))
            job.aborted = True
            self._report.released += len(job.waiting)
            job.waiting.clear()
        for rid in list(self._owners):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already broken; forget the request regardless
                pass
            self._forget(rid)
        self._report.done += list(self._jobs)
        self._jobs.clear()

    def _route(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        r = self._report
        for out in outputs:
            if out.new_token_ids:
                r.gained += 1
                r.tokens += len(out.new_token_ids)
                last = self._last_token.get(out.request_id)
                if last is not None:
                    r.token_gaps.append(now - last)
                self._last_token[out.request_id] = now
            owner = self._owners.get(out.request_id)
            if owner is not None:
                job, index = owner
                self._send(job.id, ChoiceOutput(index, out))
                if job.waiting and not job.aborted:
                    self._add_siblings(job, index)
            if out.finished:
                counted = owner is not None and out.finish_reason in ("stop", "length")
                r.finished.append((out.finish_reason or "unknown", out.stats if counted else None))
                self._forget(out.request_id)
                self.engine.release(out.request_id)

    def _add_siblings(self, job: _Job, leader: int) -> None:
        for i in [i for i in job.waiting if job.choices[i].leader == leader]:
            job.waiting.remove(i)
            try:
                self._add(job, i)
            except Exception as e:  # noqa: BLE001 - same prompt as its leader: only a bug gets here
                self._report.released += 1
                self._send(job.id, Failed(f"choice {i} could not start: {e}", "internal_error"))

    def _forget(self, rid: int) -> None:
        owner = self._owners.pop(rid, None)
        if owner is not None:
            self._report.released += 1
            self._drop_if_done(owner[0])
        self._last_token.pop(rid, None)

    def _drop_if_done(self, job: _Job) -> None:
        """Forget ``job`` once none of its choices runs or waits."""
        if not job.waiting and all(r not in self._owners for r in job.rids.values()) and job.id in self._jobs:
            del self._jobs[job.id]
            self._report.done.append(job.id)

    def _send(self, job_id: int, event: Any) -> None:
        self._report.events.append((job_id, event))

    def _flush(self) -> None:
        """This step's report, if anything happened, with the engine's gauges."""
        r = self._report
        if not (r.events or r.released or r.finished or r.tokens or r.done):
            return
        s, b = self.engine.scheduler, self.engine.blocks
        r.gauges = (len(s.waiting), len(s.running), b.n_used, s.preemptions)
        self._report = StepReport()
        self.conn.send(("step", r))


def engine_main(conn: Connection, load: dict[str, Any]) -> None:
    """The engine process: ``LLM(**load)``, then serve ``conn`` (quanta.server.engine_loop starts it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    try:
        from quanta.api import LLM

        llm = LLM(**load)
    except BaseException as e:  # noqa: BLE001 - reported by the server's process
        user = is_user_error(e)
        conn.send(("load_failed", user, str(e) if user else traceback.format_exc()))
        return
    engine = llm.engine
    conn.send(("ready", ModelInfo(llm.n_ctx, llm.model.n_vocab, llm.backend.name, engine.config.max_seqs,
                                  engine.blocks.n_blocks)))
    try:
        EngineCore(engine, conn).run()
    finally:
        llm.close()
