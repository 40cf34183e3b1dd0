"""The server's life: /health answers 503 while the model loads, then 200 once the URL is printed; SIGTERM stops
accepting, lets a short in-flight stream finish, ends a long one cleanly (an error event, then [DONE]) after the
grace period, and exits 0. A model that cannot load ends the process with a one-line error. The engine's own
process: if it dies, live streams end with an error and the server answers 503; it does not outlive the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from live_server import assert_error_object, free_port, sse_events, start_server


def test_health_is_503_while_loading_then_200(smollm2_path, server_log_dir):
    port = free_port()
    with start_server(smollm2_path, server_log_dir, "--n-ctx", "256", port=port, wait=False) as server:
        seen = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{server.url}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            seen.append(r.status_code)
            if r.status_code == 200:
                break
            error = assert_error_object(r, 503)
            assert error["code"] == "loading" and int(r.headers["retry-after"]) > 0
            models = httpx.get(f"{server.url}/v1/models", timeout=5)
            assert models.status_code in (200, 503)
            time.sleep(0.05)
        assert seen[0] == 503 and seen[-1] == 200, seen
        assert " ready at " in server.stdout.get(timeout=30)
        assert server.stop() == 0


def test_sigterm_finishes_short_streams_ends_long_ones_and_exits_0(smollm2_path, server_log_dir):
    # the long stream must outlast the grace period on any machine: 4,000 tokens in 2 s would be 2,000 tok/s (a fast
    # CPU decodes SmolLM2 at ~150; with a grace of 8 s and 1,100 tokens, a Zen 5 VM finished the stream in time)
    with start_server(smollm2_path, server_log_dir, "--n-ctx", "4200", "--shutdown-grace", "2") as server:
        results: dict[str, list[str]] = {}
        started = threading.Barrier(3)

        def stream(name: str, max_tokens: int) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}], "stream": True,
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7}
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as response:
                events = sse_events(response)
                got = [next(events), next(events)]  # the role chunk and the first delta
                started.wait()
                results[name] = got + list(events)

        threads = [threading.Thread(target=stream, args=("short", 6)),
                   threading.Thread(target=stream, args=("long", 4000))]
        for t in threads:
            t.start()
        started.wait()
        sent = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"{server.url}/health", timeout=5)
        for t in threads:
            t.join(120)
        assert server.process.wait(60) == 0
        assert time.monotonic() - sent < 60
    short, long = results["short"], results["long"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and json.loads(long[-2])["error"]["code"] == "shutdown"
    assert all(json.loads(e)["choices"][0]["delta"].get("content") is not None for e in long[1:-2])


def test_a_model_that_cannot_load_is_a_one_line_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    r = subprocess.run([sys.executable, "-m", "quanta", "serve", "-m", str(bad), "--port", "0", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("quanta: error:") and "Traceback" not in r.stderr


def _engine_process(server_pid: int) -> int:
    """The engine's process among the server's children (the other is multiprocessing's resource tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    engines = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, children
    return engines[0]


def test_a_dead_engine_process_ends_live_streams_and_the_server_answers_503(smollm2_path, server_log_dir):
    with start_server(smollm2_path, server_log_dir, "--n-ctx", "512") as server:
        body = {"model": "m", "prompt": "Once upon a time", "stream": True, "max_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            events = sse_events(response)
            next(events)
            os.kill(_engine_process(server.process.pid), signal.SIGKILL)
            rest = list(events)
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "engine_stopped"
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2},
                       timeout=30)
        assert assert_error_object(r, 503)["code"] == "engine_stopped"
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 503
        assert server.stop() == 0


def test_the_engine_process_exits_with_a_killed_server(smollm2_path, server_log_dir):
    with start_server(smollm2_path, server_log_dir, "--n-ctx", "256") as server:
        engine = _engine_process(server.process.pid)
        server.process.kill()
        server.process.wait(30)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{engine}").exists() and b"spawn_main" in Path(f"/proc/{engine}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the engine process outlived its server"
            time.sleep(0.1)
