"""Every client mistake is a 4xx with OpenAI's error object, never a 500, a traceback or a dead server: a matrix of
malformed requests (types, ranges, missing fields, unknown roles, invalid UTF-8, deep nesting, huge bodies,
prompts longer than the context), the API key, unknown routes and methods."""

from __future__ import annotations

import json

import httpx
import pytest

from live_server import assert_error_object, start_server

KEY = "sk-test-key"
ORIGIN = "http://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
N_CTX = 256
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 1}
MISSING = object()


def with_field(base: dict, field: str, value: object) -> dict:
    body = dict(base)
    if value is MISSING:
        body.pop(field, None)
    else:
        body[field] = value
    return body


def message(**fields) -> dict:
    return with_field(CHAT, "messages", [fields])


CHAT_FIELDS = {
    "model": [MISSING, 1, None, [], {}],
    "messages": [MISSING, None, "hi", [], {}, [1], ["hi"], [{}], [[]]],
    "max_tokens": [0, -1, "10", 1.5, True, []],
    "max_completion_tokens": [0, "x"],
    "temperature": [-0.1, 2.1, "hot", True, 1e999, [0.5]],
    "top_p": [-0.1, 1.5, "x"],
    "top_k": [-2, 1.5, "x"],
    "min_p": [-1, 2],
    "seed": [-1, 2**63, 1.5, "7"],
    "stop": [5, [5], [None], {"a": 1}, ["x"] * 17],
    "presence_penalty": [3, -3, "x"],
    "frequency_penalty": [2.5],
    "repetition_penalty": [0, -1, 101],
    "logit_bias": [[], {"abc": 1}, {"-1": 1}, {"99999999": 1}, {"1": 101}, {"1": "x"}],
    "n": [0, 17, -1, 1.5, "2"],
    "stream": ["yes", 1],
    "stream_options": [{"include_usage": True}, "x"],
    "logprobs": ["yes", 1],
    "top_logprobs": [21, -1, 3],
    "response_format": [{"type": "xml"}, "json", {"type": 5}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
                        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/missing"}}}],
    "tools": ["x", [{"type": "function"}], [{"type": "function", "function": {"name": "bad name!"}}], [5]],
    "tool_choice": ["required", 5, {"type": "function", "function": {"name": "nope"}}],
    "functions": [[{"name": "f"}]],
    "grammar": [5, "root ::= missing", 'root ::= "a" ('],
    "user": [5],
    "ignore_eos": ["x"],
}
TOO_LONG = message(role="user", content="word " * 2000)
BAD_MESSAGES = [
    message(role="wizard", content="x"), message(role=1, content="x"), message(role="user"),
    message(role="user", content=5), message(role="user", content=None), message(content="x"),
    message(role="user", content=[{"type": "image_url", "image_url": {"url": "http://x"}}]),
    message(role="user", content=[{"type": "text"}]), message(role="user", content=[{"type": "text", "text": 5}]),
    message(role="user", content=[{"type": "sound"}]), message(role="user", content=[5]),
    message(role="assistant", tool_calls=[{"id": "1"}]), message(role="user", content="x", tool_calls=[
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
    message(role="assistant", tool_calls=[{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]),
    TOO_LONG, message(role="user", content=[[[[["deep"]]]]]),
]
COMPLETION_FIELDS = {
    "prompt": [MISSING, None, 5, [], [[]], [1.5], [-1], [10**9], [True], [[1, "a"]], {"a": 1}, "word " * 2000,
               [1] * (N_CTX + 10), ["a", 5]],
    "logprobs": [21, -1, True, "x"],
    "echo": ["x"],
    "suffix": ["tail"],
    "best_of": [2, 0],
}
RAW_BODIES = [
    b"", b"{", b"not json", b"[]", b'"str"', b"null", b"5", b"\xff\xfe", b'{"model": "m", "prompt": "\xc3\x28"}',
    b'{"model": "m", "prompt": "hi", "temperature": NaN}', b'{"model": "m", "prompt": "hi", "top_p": Infinity}',
    b"[" * 100_000, b'{"a":' * 50_000, b'{"model": "m", "prompt": "hi", "logit_bias": {"1": ' + b"[" * 5000 + b"]" * 5000
    + b"}}", b'{"model": "m", "prompt": "\\ud800"}', b'{"model": "m", "prompt": "hi"', b"\x00\x00\x00",
]
OTHER = [
    ("POST", "/tokenize", {}), ("POST", "/tokenize", {"content": 5}), ("POST", "/tokenize", "x"),
    ("POST", "/tokenize", {"content": "x", "add_special": "y"}), ("POST", "/detokenize", {}),
    ("POST", "/detokenize", {"tokens": "x"}), ("POST", "/detokenize", {"tokens": [-1]}),
    ("POST", "/detokenize", {"tokens": [10**12]}), ("POST", "/detokenize", {"tokens": [1.5]}),
    ("POST", "/detokenize", {"tokens": [[1]]}), ("GET", "/v1/completions", None), ("POST", "/v1/models", {}),
    ("GET", "/nope", None), ("DELETE", "/v1/chat/completions", None), ("PUT", "/tokenize", {}),
]


def cases() -> list[tuple[str, str, str, object]]:
    out = []
    for field, values in CHAT_FIELDS.items():
        out += [(f"chat-{field}-{i}", "POST", "/v1/chat/completions", with_field(CHAT, field, v))
                for i, v in enumerate(values)]
    out += [(f"chat-message-{i}", "POST", "/v1/chat/completions", b) for i, b in enumerate(BAD_MESSAGES)]
    out += [("chat-too-long-stream", "POST", "/v1/chat/completions",
             {**TOO_LONG, "stream": True})]
    for field, values in COMPLETION_FIELDS.items():
        out += [(f"completion-{field}-{i}", "POST", "/v1/completions", with_field(COMPLETION, field, v))
                for i, v in enumerate(values)]
    out += [("completion-echo-logprobs", "POST", "/v1/completions", {**COMPLETION, "echo": True, "logprobs": 1}),
            ("completion-too-many-choices", "POST", "/v1/completions", {**COMPLETION, "prompt": ["a"] * 5, "n": 4})]
    out += [(f"raw-{i}", "POST", path, raw) for i, raw in enumerate(RAW_BODIES)
            for path in ("/v1/chat/completions", "/v1/completions")]
    out += [(f"other-{i}", method, path, body) for i, (method, path, body) in enumerate(OTHER)]
    return out


CASES = cases()


@pytest.fixture(scope="module")
def server(smollm2_path, server_log_dir):
    with start_server(smollm2_path, server_log_dir, "--n-ctx", str(N_CTX), "--max-seqs", "2", "--cors-origin",
                      ORIGIN, env={"QUANTA_API_KEY": KEY}) as s:
        yield s
        assert s.stop() == 0
        assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def test_the_matrix_is_large():
    assert len(CASES) >= 100


@pytest.mark.parametrize(("case", "method", "path", "body"), CASES, ids=[c[0] for c in CASES])
def test_malformed_request_is_a_4xx_error_object(http, case, method, path, body):
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    response = http.request(method, path, content=content)
    error = assert_error_object(response)
    assert 400 <= response.status_code < 500, (response.status_code, error)
    if method == "POST" and path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        assert response.status_code == 400, (response.status_code, error)


def test_context_overflow_says_so(http):
    for path, body in (("/v1/chat/completions", TOO_LONG),
                       ("/v1/completions", with_field(COMPLETION, "prompt", [1] * (N_CTX + 10))),
                       ("/v1/chat/completions", {**TOO_LONG, "stream": True})):
        error = assert_error_object(http.post(path, json=body), 400)
        assert error["code"] == "context_length_exceeded" and str(N_CTX) in error["message"]


def test_errors_name_the_parameter(http):
    error = assert_error_object(http.post("/v1/chat/completions", json=with_field(CHAT, "temperature", 5)), 400)
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    error = assert_error_object(http.post("/v1/chat/completions", json=message(role="wizard", content="x")), 400)
    assert error["param"] == "messages[0].role"
    error = assert_error_object(http.post("/v1/chat/completions", json=with_field(CHAT, "model", MISSING)), 400)
    assert error["param"] == "model" and "missing" in error["message"]
    error = assert_error_object(http.post("/v1/chat/completions",
                                          json=with_field(CHAT, "functions", [{"name": "f"}])), 400)
    assert "not supported yet" in error["message"]


def test_huge_bodies_are_413(http):
    huge = b'{"model": "m", "prompt": "' + b"x" * (9 * 2**20) + b'"}'
    assert_error_object(http.post("/v1/completions", content=huge), 413)

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(9):
            yield b"x" * 2**20
        yield b'"}'

    assert_error_object(http.post("/v1/completions", content=chunks()), 413)


def test_api_key(server):
    for path, method in (("/v1/models", "GET"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST"),
                         ("/metrics", "GET"), ("/nope", "GET")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            error = assert_error_object(httpx.request(method, server.url + path, json=CHAT, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/").status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH).status_code == 200


def test_cors(server):
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    r = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://elsewhere.example", **AUTH})
    assert "access-control-allow-origin" not in r.headers


def test_still_serving_after_the_matrix(http):
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    counts = {k: v for k, v in _metric_lines(http.get("/metrics").text) if k.startswith("quanta_requests_total")}
    assert not any('status="5' in k for k in counts), counts


def _metric_lines(text: str) -> list[tuple[str, float]]:
    return [(line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
            if line and not line.startswith("#")]
