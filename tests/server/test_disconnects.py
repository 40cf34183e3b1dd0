"""Clients that leave — mid-stream, while their prompt is prefilled, before a whole response is ready — get their
request aborted and its KV blocks freed (seen in /metrics); a full queue answers 429 with Retry-After."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from live_server import assert_error_object, sse_events, start_server

LONG = {"model": "m", "messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 900,
        "temperature": 0.8, "ignore_eos": True}
LONG_PROMPT = {"model": "m", "prompt": "word " * 600, "max_tokens": 50}  # two prefill chunks of 512


@pytest.fixture(scope="module")
def server(smollm2_path, server_log_dir):
    with start_server(smollm2_path, server_log_dir, "--n-ctx", "1024", "--max-seqs", "2", "--max-queue", "1") as s:
        yield s
        assert s.stop() == 0, s.log.read_text()


def aborted(m: dict[str, float]) -> float:
    return m.get('quanta_sequences_finished_total{reason="abort"}', 0.0)


def test_disconnect_mid_stream_aborts(server):
    before = server.wait_idle()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**LONG, "stream": True},
                      timeout=120) as response:
        events = sse_events(response)
        contents = [json.loads(next(events)) for _ in range(4)]  # the role chunk and three deltas
        assert contents[1]["choices"][0]["delta"]["content"] is not None
    after = server.wait_idle(timeout=30)
    assert aborted(after) == aborted(before) + 1
    assert after["quanta_generation_tokens_total"] - before["quanta_generation_tokens_total"] < 200


def test_disconnect_during_prefill_aborts_before_the_first_token(server):
    before = server.wait_idle()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG_PROMPT, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200  # sent once the engine took the request, before its prefill ends
    after = server.wait_idle(timeout=30)
    assert aborted(after) == aborted(before) + 1
    assert after["quanta_generation_tokens_total"] == before["quanta_generation_tokens_total"]


def test_disconnect_of_a_non_streamed_request_aborts(server):
    before = server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s: ~70-175 tokens on the CPUs measured
        httpx.post(f"{server.url}/v1/chat/completions", json=LONG, timeout=httpx.Timeout(120, read=1.0))
    after = server.wait_idle(timeout=30)
    assert aborted(after) == aborted(before) + 1
    assert after["quanta_generation_tokens_total"] - before["quanta_generation_tokens_total"] < 600  # of 900


def test_disconnect_of_n_choices_aborts_them_all(server):
    before = server.wait_idle()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**LONG, "stream": True, "n": 2},
                      timeout=120) as response:
        events = sse_events(response)
        for _ in range(6):
            next(events)
    after = server.wait_idle(timeout=30)
    assert aborted(after) - aborted(before) in (1, 2)  # the second choice may not have started yet


def test_full_queue_is_429_with_retry_after(server):
    server.wait_idle()
    streams, readers = [], []  # a reader dropped mid-stream would close its connection
    try:
        for _ in range(3):  # two running (max-seqs 2) and one queued (max-queue 1)
            cm = httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**LONG, "stream": True},
                              timeout=120)
            response = cm.__enter__()
            streams.append(cm)
            assert response.status_code == 200
            readers.append(sse_events(response))
            next(readers[-1])
        refused = httpx.post(f"{server.url}/v1/chat/completions", json={**LONG, "max_tokens": 1}, timeout=60)
        error = assert_error_object(refused, 429)
        assert error["code"] == "queue_full" and int(refused.headers["retry-after"]) >= 1
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
    server.wait_idle(timeout=30)
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200


def test_clients_leaving_at_random_points(server):
    before = server.wait_idle()
    rng = random.Random(7)
    plans = [(rng.choice(("stream", "prefill", "whole")), rng.randint(1, 8)) for _ in range(10)]

    def client(kind: str, n_events: int) -> None:
        try:
            if kind == "whole":
                httpx.post(f"{server.url}/v1/chat/completions", json=LONG, timeout=httpx.Timeout(120, read=0.3 * n_events))
                return
            body = {**(LONG_PROMPT if kind == "prefill" else LONG), "stream": True}
            path = "/v1/completions" if kind == "prefill" else "/v1/chat/completions"
            with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
                if response.status_code != 200:
                    return  # 429 when the queue is full: fine here
                for _, _ in zip(range(n_events), sse_events(response)):
                    pass
        except httpx.ReadTimeout:
            pass

    threads = [threading.Thread(target=client, args=plan) for plan in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = server.wait_idle(timeout=60)
    assert after["quanta_kv_blocks_used"] == 0
    assert not any(k.startswith("quanta_requests_total") and 'status="5' in k for k in after)
    assert aborted(after) > aborted(before)
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200
