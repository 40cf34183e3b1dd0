"""Structured output through `quanta serve` and the official `openai` client: ``response_format`` (json_object,
json_schema: every answer parses and validates), llama.cpp's ``grammar`` field, and tool calls (required, a named
function, auto; streamed as OpenAI streams them; a ``tool`` result sent back)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from live_server import start_server

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Rome?"}]


@pytest.fixture(scope="module")
def server(smollm2_path, server_log_dir):
    with start_server(smollm2_path, server_log_dir, "--n-ctx", "1024", "--max-seqs", "4") as s:
        yield s
        assert s.stop() == 0, s.log.read_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(client, stream, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model="m", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
              temperature=temperature, seed=3, response_format=fmt)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_grammar(server, client):
    ask = [{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}]
    r = client.chat.completions.create(model="m", messages=ask, max_tokens=150, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    body = {"model": "m", "prompt": "Is the sky blue? Answer:", "max_tokens": 8, "temperature": 0.8,
            "grammar": 'root ::= " " ("yes" | "no") "."'}
    text = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    assert re.fullmatch(r" (yes|no)\.", text), text


def _call_of(message) -> tuple[str, dict]:
    assert message.tool_calls and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    return call.function.name, json.loads(call.function.arguments)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_are_parsed_and_validate(client, choice):
    r = client.chat.completions.create(model="m", messages=ASK, tools=WEATHER, tool_choice=choice, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    name, args = _call_of(r.choices[0].message)
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER[0]["function"]["parameters"])


def test_streamed_tool_calls_as_openai_streams_them(client):
    chunks = [c for c in client.chat.completions.create(model="m", messages=ASK, tools=WEATHER,
                                                         tool_choice="required", temperature=0, stream=True)
              if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER[0]["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_goes_back_to_the_model(client):
    first = client.chat.completions.create(model="m", messages=ASK, tools=WEATHER, tool_choice="required",
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model="m", messages=history, tools=WEATHER, tool_choice="none",
                                       max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    assert not r.choices[0].message.tool_calls


def test_auto_gives_text_or_a_valid_call(client):
    for question in ("What is the weather like in Rome?", "Say hello."):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                           tools=WEATHER, tool_choice="auto", temperature=0, max_tokens=60)
        c = r.choices[0]
        if c.finish_reason == "tool_calls":
            name, args = _call_of(c.message)
            jsonschema.validate(args, WEATHER[0]["function"]["parameters"])
        else:
            assert c.message.content and not c.message.tool_calls


def test_bad_schemas_and_tools_are_400(client):
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.chat.completions.create(model="m", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="m", messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model="m", messages=ASK, tools=WEATHER, tool_choice="required",
                                       response_format={"type": "json_object"})
