"""A live `quanta serve` for a test module: a subprocess on a free port with the real SmolLM2 on the CPU, started
through the CLI (so every module also tests startup, the printed URL and a clean SIGTERM exit); and checks of
the wire format shared by the modules."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

READY_TIMEOUT_S = 300


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    stdout: queue.Queue[str]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: ``name{label="v",...}`` → value (labels sorted)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """/metrics once no sequence is live and no KV block is held (fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["quanta_live_sequences"] == 0 and m["quanta_kv_blocks_used"] == 0 and m["quanta_running_sequences"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle: live {m['quanta_live_sequences']}, "
                                     f"KV blocks used {m['quanta_kv_blocks_used']}")
            time.sleep(0.1)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM, then the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


@contextlib.contextmanager
def start_server(model: Path, log_dir: Path, *flags: str, env: dict[str, str] | None = None, port: int = 0,
                 wait: bool = True) -> Iterator[Server]:
    """`quanta serve` in a subprocess; yields once it printed its URL (``wait``), or at once (then ``port`` must
    be given). Stopped with SIGTERM on exit (killed if it does not stop)."""
    log = log_dir / f"server-{port}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "quanta", "serve", "-m", str(model), "--device", "cpu", "--port", str(port), *flags]
    with open(log, "w") as err:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                   env={**os.environ, **(env or {})})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    server = None if wait else Server(f"http://127.0.0.1:{port}", process, log, lines)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while server is None:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"the server printed no URL in {READY_TIMEOUT_S} s:\n{log.read_text()}") from None
            if " ready at " in line:
                server = Server(line.split(" ready at ")[1].strip(), process, log, lines)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()



def assert_error_object(response: httpx.Response, status: int | None = None) -> dict:
    """The body is OpenAI's error object (and no traceback); returns its ``error``."""
    if status is not None:
        assert response.status_code == status, (response.status_code, response.text)
    assert 400 <= response.status_code < 600, response.status_code
    assert "Traceback" not in response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    return error


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of a Server-Sent Events response, checking the framing as they come."""
    buffer = ""
    for text in response.iter_text():
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            assert event.startswith("data: "), event
            yield event[len("data: "):]
    assert buffer == "", f"a partial event at the end of the stream: {buffer!r}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
