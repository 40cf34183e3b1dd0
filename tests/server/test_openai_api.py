"""`quanta serve` through the official `openai` client (and raw HTTP where the wire format itself is checked):
chat and completions, streamed and not, usage with prefix-cache hits, seeds, stop strings, logprobs with bytes,
n > 1, the auxiliary routes, and concurrent requests decoded in one batch."""

from __future__ import annotations

import json
import math
import threading

import httpx
import openai
import pytest

from live_server import assert_error_object, sse_events, start_server

CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def server(smollm2_path, server_log_dir):
    # exact mode: a sequence's tokens then do not depend on what it is batched with or on prefix-cache hits, so
    # seeded outputs can be compared exactly (the default mode agrees on ~99% of tokens, not all)
    with start_server(smollm2_path, server_log_dir, "--n-ctx", "1024", "--max-seqs", "4", "--exact") as s:
        yield s
        assert s.stop() == 0, s.log.read_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_and_health(server, client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model] and models[0].object == "model"
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_chat_completion(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.prompt_tokens > 10
    assert 0 < u.completion_tokens <= 12
    if choice.finish_reason == "length":
        assert u.completion_tokens == 12


def test_any_model_name_is_the_loaded_model(client):
    r = client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2, temperature=0)
    assert r.choices[0].message.content is not None


def test_stream_chunks_are_openais(server, model):
    body = {"model": model, "messages": CHAT, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == model for c in chunks)
    first, *deltas, final, usage = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert deltas and all(list(c["choices"][0]["delta"]) == ["content"] and c["choices"][0]["finish_reason"] is None
                          for c in deltas)
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] <= 10
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]


def test_stream_without_usage_has_no_usage_field(server, model):
    body = {"model": model, "messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as response:
        events = list(sse_events(response))
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_seeded_sampling_is_reproducible_streamed_or_not(client, model):
    def text(seed, stream=False):
        kwargs = dict(model=model, messages=CHAT, max_tokens=16, temperature=1.0, seed=seed)
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)

    first = text(1234)
    assert text(1234) == first
    assert text(1234, stream=True) == first
    assert any(text(seed) != first for seed in (1, 2, 3))


def test_usage_counts_cached_tokens_on_the_second_turn(client, model):
    turn1 = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    history = CHAT + [{"role": "assistant", "content": turn1.choices[0].message.content},
                      {"role": "user", "content": "And two more?"}]
    turn2 = client.chat.completions.create(model=model, messages=history, max_tokens=4, temperature=0)
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0  # whole KV blocks of the shared prefix (turn 1's prompt and answer)
    assert cached <= turn1.usage.total_tokens and turn1.usage.prompt_tokens < turn2.usage.prompt_tokens


def test_stop_string_cuts_the_text(client, model):
    settings = dict(model=model, messages=CHAT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**settings).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    cut = client.chat.completions.create(**settings, stop=[stop, "\u2603"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)]


def test_chat_logprobs_with_bytes(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and sum(math.exp(x) for x in tops) <= 1 + 1e-6
        assert t.token == t.top_logprobs[0].token and t.logprob == pytest.approx(tops[0])  # greedy: the top token


def test_completion_logprobs_and_prompt_forms(client, model, server):
    ids = httpx.post(f"{server.url}/tokenize", json={"content": "The capital of France is", "add_special": True}
                     ).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
                                        logprobs=2)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.object == "text_completion" and by_text.choices[0].text == by_ids.choices[0].text
    lp = by_text.choices[0].logprobs
    assert "".join(lp.tokens) == by_text.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    two = client.completions.create(model=model, prompt=["One, two,", "Red, green,"], max_tokens=3, temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    echoed = client.completions.create(model=model, prompt="One, two,", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "One, two," + two.choices[0].text


def test_completion_stream(client, model):
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert text == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_share_the_prompt_and_get_seed_plus_i(client, model):
    both = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=1.0, seed=50, n=2)
    assert [c.index for c in both.choices] == [0, 1]
    single = [client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=1.0, seed=s)
              for s in (50, 51)]
    assert [c.message.content for c in both.choices] == [s.choices[0].message.content for s in single]
    assert both.usage.prompt_tokens == single[0].usage.prompt_tokens
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in single)


def test_n_choices_streamed(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0.7, seed=3,
                                                 n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert roles == [0, 1] and finished == [0, 1]


def test_tokenize_and_detokenize(server):
    text = "Hello, world! ünïcödé 日本"
    r = httpx.post(f"{server.url}/tokenize", json={"content": text, "with_pieces": True})
    pieces = r.json()["tokens"]
    ids = [p["id"] for p in pieces]
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces
                    ).decode() == text
    assert httpx.post(f"{server.url}/tokenize", json={"content": text}).json() == {"tokens": ids}
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"content": text}


def test_unknown_route_and_method(server):
    assert_error_object(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_error_object(httpx.get(f"{server.url}/v1/chat/completions"), 405)


def test_metrics(server, client, model):
    client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0)
    m = server.metrics()
    assert m['quanta_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m["quanta_generation_tokens_total"] >= 2 and m["quanta_prompt_tokens_total"] > 0
    assert m["quanta_time_to_first_token_seconds_count"] >= 1
    assert m["quanta_kv_blocks_total"] > 0
    for name in ("quanta_queue_depth", "quanta_running_sequences", "quanta_kv_blocks_used",
                 "quanta_time_per_output_token_seconds_count", "quanta_cached_prompt_tokens_total"):
        assert name in m


def test_concurrent_requests_are_batched(server, model):
    before = server.metrics()
    results, errors = [], []

    def one(i):
        try:
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count to {i + 5}."}],
                                          max_tokens=12, temperature=0.5, seed=i, extra_body={"ignore_eos": True})
            results.append(r.usage.completion_tokens)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [12] * 4
    after = server.wait_idle()
    steps = after["quanta_step_sequences_count"] - before["quanta_step_sequences_count"]
    single = after['quanta_step_sequences_bucket{le="1.0"}'] - before['quanta_step_sequences_bucket{le="1.0"}']
    assert steps > 0 and single < steps  # some steps advanced several sequences at once
    assert steps < 4 * 12  # fewer steps than tokens: they were decoded together
