"""Runs the app under uvicorn: listen first (``/health`` answers 503 while the model loads), load the model in
the background (in the engine's own process, quanta.server.engine_core), print the URL once it is ready; on SIGINT/SIGTERM stop accepting, let in-flight requests finish
for ``shutdown_grace_s`` (then end their streams with an error event and ``[DONE]``), stop the engine, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import uvicorn

from quanta.errors import QuantaError
from quanta.server.app import build_app
from quanta.server.config import ServerConfig
from quanta.server.engine_loop import start_engine
from quanta.server.state import ServerState

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(config: ServerConfig, load: dict[str, Any], model_name: str, out: TextIO = sys.stdout) -> int:
    """Serve ``LLM(**load)`` until a signal; raises what loading it raised when the model could not be loaded."""
    state = ServerState(config, model_name)
    sock = listen(config.host, config.port)
    uv = uvicorn.Config(build_app(state), host=config.host, port=config.port, log_level="warning",
                        access_log=False, lifespan="off", timeout_keep_alive=30)
    server = QuantaServer(uv, state, load, out)
    server.run(sockets=[sock])
    if server.load_error is not None:
        raise server.load_error
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (IPv4 or IPv6); a one-line QuantaError when that is impossible."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise QuantaError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class QuantaServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, load: dict[str, Any], out: TextIO):
        super().__init__(config)
        self.state, self.load, self.out = state, load, out
        self.load_error: BaseException | None = None
        self._loader: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(f"quanta serve: loading {self.state.model_name} ...", file=sys.stderr, flush=True)
            self._loader = asyncio.create_task(self._load_model())

    async def _load_model(self) -> None:
        state = self.state
        try:
            model = await _in_daemon_thread(lambda: start_engine(self.load, state.metrics, state.config.max_queue))
        except BaseException as e:  # noqa: BLE001 - reported by serve() once the server has stopped
            self.load_error = e
            self.should_exit = True
            return
        if self.should_exit:
            await asyncio.to_thread(model.engine_loop.stop)
            return
        state.attach(model)
        print(f"quanta serve: {state.model_name} on {model.info.device} ready at {self.url}", file=self.out,
              flush=True)

    @property
    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.state
        state.draining = True
        loop = asyncio.get_running_loop()
        timer = None
        if state.engine_loop is not None:
            timer = loop.call_later(state.config.shutdown_grace_s, state.engine_loop.end_all,
                                    "the server is shutting down", "shutdown")
        await super().shutdown(sockets)
        if timer is not None:
            timer.cancel()
        if state.engine_loop is not None:
            await asyncio.to_thread(state.engine_loop.stop)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without re-raising the signal afterwards: a signalled server exits with status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a daemon thread (a load still running at exit does not hold the process)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            error = e
        with contextlib.suppress(RuntimeError):  # the server already stopped: nobody waits
            loop.call_soon_threadsafe(_settle, done, result, error)

    threading.Thread(target=run, name="quanta-load", daemon=True).start()
    return await done


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
