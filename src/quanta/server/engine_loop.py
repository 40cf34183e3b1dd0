"""The server's side of the engine process (quanta.server.engine_core): ``start_engine`` spawns it and waits for
the model; ``EngineLoop`` sends it commands and, on a reader thread, hands each step's events to their requests'
asyncio queues in one ``call_soon_threadsafe`` per event loop.

``reserve`` counts sequences accepted and not yet ended against the server's capacity (the running batch plus
the queue limit), so a full server refuses a request before it is tokenized; the engine reports the sequences it
has ended. If the engine process dies, every live request ends with an error and new ones get 503.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from quanta.errors import QuantaError
from quanta.server.engine_core import (SHUTTING_DOWN, Accepted, ChoiceOutput, Failed, ModelInfo, Rejected,
                                       StepReport, engine_main)
from quanta.server.metrics import Metrics
from quanta.server.protocol import Choice

__all__ = ["SHUTTING_DOWN", "Accepted", "ChoiceOutput", "EngineLoop", "Failed", "Job", "Rejected", "ServedModel",
           "start_engine"]
ENGINE_GONE = "the engine process stopped; the server must be restarted"


class Job:
    """One HTTP request's choices; ``events`` (Accepted | Rejected, then ChoiceOutput | Failed) is read by the
    request's task."""

    def __init__(self, choices: list[Choice], loop: asyncio.AbstractEventLoop):
        self.choices = choices
        self.loop = loop
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.id = -1  # set by EngineLoop.submit


class EngineLoop:
    def __init__(self, conn: Connection, process: Any, metrics: Metrics, capacity: int):
        self.conn, self.process, self.metrics, self.capacity = conn, process, metrics, capacity
        self.alive = True
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._live = 0
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="quanta-engine-reader", daemon=True)
        metrics.live.set_function(lambda: self._live)  # read when scraped: right even during a long step

    # ---- called from the server's event loop ---------------------------------------------------------------
    def start(self) -> None:
        self._reader.start()

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
        job.id = next(self._ids)
        self._jobs[job.id] = job
        if not self._command("submit", job.id, job.choices):
            self._deliver_all([(job, Failed(ENGINE_GONE, "engine_stopped"))])

    def abort(self, job: Job) -> None:
        self._command("abort", job.id)

    def end_all(self, message: str, code: str) -> None:
        """End every live request with a ``Failed`` event (the server is shutting down)."""
        self._command("end_all", (message, code))

    def stop(self, timeout: float = 10.0) -> None:
        """End what is left, then the engine process."""
        self._command("stop", None)
        self._reader.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)

    def _command(self, *message: Any) -> bool:
        with self._send_lock:
            try:
                self.conn.send(message)
                return True
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                return False

    # ---- the reader thread ---------------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                kind, report = self.conn.recv()
            except (EOFError, ConnectionResetError, OSError):
                break
            if kind == "stopped":
                return
            self._take(report)
        self.alive = False  # the engine process died: nobody will answer the live requests
        self._deliver_all([(job, Failed(ENGINE_GONE, "engine_stopped")) for job in list(self._jobs.values())])
        self._jobs.clear()

    def _take(self, report: StepReport) -> None:
        items = [(self._jobs[job_id], event) for job_id, event in report.events if job_id in self._jobs]
        for job_id in report.done:
            self._jobs.pop(job_id, None)
        with self._lock:
            self._live -= report.released
        self._deliver_all(items)
        self.metrics.record(report)

    @staticmethod
    def _deliver_all(items: list[tuple[Job, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Any]]] = {}
        for job, event in items:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that loop is closed: nobody is waiting any more
                pass


def _deliver(items: list[tuple[Job, Any]]) -> None:
    for job, event in items:
        job.events.put_nowait(event)


@dataclass
class ServedModel:
    """The loaded model as the routes see it: its tokenizer (loaded in this process), the engine's figures, and
    the loop that talks to the engine process."""

    tokenizer: Any
    info: ModelInfo
    engine_loop: EngineLoop

    @property
    def n_ctx(self) -> int:
        return self.info.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.info.n_vocab


def start_engine(load: dict[str, Any], metrics: Metrics, max_queue: int) -> ServedModel:
    """Spawn the engine process with ``LLM(**load)`` and wait until the model is loaded (the tokenizer loads here
    meanwhile); a model that cannot load raises what ``LLM`` said (a QuantaError for the user's mistakes)."""
    from quanta.tokenizer import load_tokenizer

    ctx = multiprocessing.get_context("spawn")  # CUDA cannot live in a forked child
    conn, child = ctx.Pipe()
    # a daemon may not start processes: a tensor-parallel engine starts its other ranks (stop() ends it)
    daemon = load.get("tensor_parallel", 1) == 1
    process = ctx.Process(target=engine_main, args=(child, load), name="quanta-engine", daemon=daemon)
    process.start()
    child.close()
    try:
        tokenizer = load_tokenizer(load["model"], home=load.get("home"))
        kind, *rest = conn.recv()
    except EOFError:
        process.join()
        raise QuantaError(f"the engine process exited (status {process.exitcode}) while loading the model") from None
    except BaseException:
        process.terminate()
        raise
    if kind == "load_failed":
        user, message = rest
        process.join()
        raise QuantaError(message) if user else RuntimeError(f"the engine process failed to load the model:\n{message}")
    info: ModelInfo = rest[0]
    metrics.set_pool(info.kv_blocks)
    loop = EngineLoop(conn, process, metrics, info.max_seqs + max_queue)
    loop.start()
    return ServedModel(tokenizer, info, loop)
