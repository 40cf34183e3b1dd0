"""The constrained-decoding tests' material: JSON schemas with a valid and an invalid instance each, and the
generation loop that drives a real model under a constraint.

Every string, array and number is bounded (maxLength, maxItems, ranges, enums, patterns) so that a small model
under the constraint finishes within the tests' token budget: an output cut at max_tokens is a length stop, not
the constraint's failure. The instances are checked against the schemas by ``jsonschema`` (the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quanta.engine.constraint import Constraint
from quanta.engine.sampler import SamplingParams
from quanta.engine.stop import StopConditions

MAX_TOKENS = 60


@dataclass(frozen=True)
class SchemaCase:
    name: str  # also the prompt's subject
    schema: dict[str, Any]
    valid: Any
    invalid: Any


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object schema; every property required unless ``required`` says otherwise; no other properties."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False, **extra}


def _str(max_length: int = 10, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float, step: float) -> dict[str, Any]:
    """A number in [lo, hi] whose decimals ``multipleOf`` bounds (a small model may write 0.3333... forever);
    ``step`` is a binary fraction, exact in floats as jsonschema divides them."""
    return {"type": "number", "minimum": lo, "maximum": hi, "multipleOf": step}


_POINT = _obj({"x": _int(0, 20), "y": _int(0, 20)})
_PERSON = _obj({"name": _str(10), "age": _int(0, 120)})

SCHEMAS: tuple[SchemaCase, ...] = (
    # flat objects
    SchemaCase("a person", _PERSON, {"name": "Ann", "age": 31}, {"name": "Ann", "age": 300}),
    SchemaCase("a switch state", _obj({"active": {"type": "boolean"}}), {"active": True}, {"active": "yes"}),
    SchemaCase("a colour choice", _obj({"color": {"enum": ["red", "green", "blue"]}}), {"color": "red"},
               {"color": "pink"}),
    SchemaCase("a schema version", _obj({"version": {"const": 2}}), {"version": 2}, {"version": 3}),
    SchemaCase("a book", _obj({"title": _str(12), "pages": _int(1, 999), "fiction": {"type": "boolean"}}),
               {"title": "Dune", "pages": 412, "fiction": True}, {"title": "Dune", "pages": 0, "fiction": True}),
    SchemaCase("a weather query", _obj({"location": _str(12), "unit": {"enum": ["celsius", "fahrenheit"]}}),
               {"location": "Paris", "unit": "celsius"}, {"location": "Paris", "unit": "kelvin"}),
    SchemaCase("special property names", _obj({"first-name": _str(8), "with space": _int(0, 9), "ünï": _str(4)}),
               {"first-name": "Jo", "with space": 3, "ünï": "ok"}, {"first-name": "Jo", "with space": 3}),
    SchemaCase("an answer with escapes", _obj({"answer": {"enum": ["café", "naïve", 'say "hi"', "a\\b"]}}),
               {"answer": 'say "hi"'}, {"answer": "cafe"}),
    # top-level scalars
    SchemaCase("a size", {"enum": ["small", "medium", "large"]}, "medium", "huge"),
    SchemaCase("a two-digit number", _int(10, 99), 42, 100),
    SchemaCase("a digit above zero", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, 5, 10),
    SchemaCase("a negative number", _int(-50, -10), -20, -5),
    SchemaCase("a four-digit year", _int(1000, 2999), 1999, 999),
    SchemaCase("a multiple of five", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}, 35, 36),
    SchemaCase("a yes or no", {"type": "boolean"}, False, "no"),
    SchemaCase("nothing", {"type": "null"}, None, 0),
    SchemaCase("a short word", _str(10), "hello", "a much longer string"),
    SchemaCase("a mixed enum", {"enum": ["auto", 1, None, True]}, None, False),
    # numbers with bounds
    SchemaCase("a price", _obj({"price": _num(0, 1000, 0.25)}), {"price": 9.25}, {"price": -1}),
    SchemaCase("a coordinate", _obj({"lat": _num(-90, 90, 0.125), "lon": _num(-180, 180, 0.125)}),
               {"lat": 48.875, "lon": 2.125}, {"lat": 95, "lon": 2.35}),
    SchemaCase("a temperature", _obj({"celsius": _num(-40, 60, 0.5)}), {"celsius": 21.5}, {"celsius": 61.5}),
    SchemaCase("a probability", _num(0, 1, 0.125), 0.375, 0.3),
    SchemaCase("a rating", _obj({"stars": {"enum": [1, 2, 3, 4, 5]}, "comment": _str(12)}),
               {"stars": 4, "comment": "good"}, {"stars": 6, "comment": "good"}),
    # arrays
    SchemaCase("some digits", {"type": "array", "items": _int(0, 9), "minItems": 1, "maxItems": 4}, [3, 1, 4],
               []),
    SchemaCase("a list of tags", _obj({"tags": {"type": "array", "items": _str(8), "maxItems": 3}}),
               {"tags": ["a", "b"]}, {"tags": ["a", "b", "c", "d"]}),
    SchemaCase("a record tuple", {"type": "array", "prefixItems": [_str(6), _int(0, 100), {"type": "boolean"}],
                                  "items": False, "minItems": 3},
               ["x", 5, True], ["x", 5, True, 1]),
    SchemaCase("a pair of flags", {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
               [True, False], [True]),
    SchemaCase("a 2x2 matrix", {"type": "array", "minItems": 2, "maxItems": 2,
                                "items": {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 2}},
               [[1, 2], [3, 4]], [[1, 2], [3]]),
    SchemaCase("an RGB colour", {"type": "array", "items": _int(0, 255), "minItems": 3, "maxItems": 3},
               [255, 128, 0], [255, 128, 256]),
    SchemaCase("some points", {"type": "array", "items": _POINT, "maxItems": 3}, [{"x": 1, "y": 2}],
               [{"x": 1}]),
    SchemaCase("a list of sizes", {"type": "array", "items": {"enum": ["S", "M", "L"]}, "maxItems": 3},
               ["S", "L"], ["XL"]),
    # nested objects
    SchemaCase("a user account", _obj({"user": _obj({"id": _int(1, 9999), "name": _str(10)}),
                                       "admin": {"type": "boolean"}}),
               {"user": {"id": 7, "name": "root"}, "admin": True}, {"user": {"id": 7}, "admin": True}),
    SchemaCase("a nested value", _obj({"a": _obj({"b": _obj({"c": _obj({"d": _int(0, 9)})})})}),
               {"a": {"b": {"c": {"d": 4}}}}, {"a": {"b": {"c": {"d": 10}}}}),
    SchemaCase("an address", _obj({"street": _str(15), "city": _str(10),
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                   "country": {"enum": ["US", "CA", "MX"]}}),
               {"street": "1 Main St", "city": "Austin", "zip": "73301", "country": "US"},
               {"street": "1 Main St", "city": "Austin", "zip": "7330", "country": "US"}),
    SchemaCase("an order", _obj({"id": _int(1, 999), "items": {"type": "array", "maxItems": 2, "items": _obj(
        {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "qty": _int(1, 9)})}}),
               {"id": 12, "items": [{"sku": "AB123", "qty": 2}]}, {"id": 12, "items": [{"sku": "ab123", "qty": 2}]}),
    # optional fields
    SchemaCase("a document title", _obj({"title": _str(10), "subtitle": _str(10), "pages": _int(1, 999)},
                                        required=["title"]),
               {"title": "Notes", "pages": 3}, {"subtitle": "x"}),
    SchemaCase("some settings", _obj({"dark": {"type": "boolean"}, "volume": _int(0, 5)}, required=[]), {},
               {"volume": 6}),
    SchemaCase("a profile", _obj({"name": _str(8), "email": {"type": ["string", "null"], "maxLength": 12},
                                  "age": _int(0, 120)}, required=["name", "email"]),
               {"name": "Bo", "email": None}, {"name": "Bo"}),
    SchemaCase("a nullable nickname", _obj({"nickname": {"type": ["string", "null"], "maxLength": 8}}),
               {"nickname": None}, {"nickname": 5}),
    # $ref
    SchemaCase("a line segment", {"$defs": {"point": _POINT},
                                  **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
               {"start": {"x": 0, "y": 0}, "end": {"x": 3, "y": 4}}, {"start": {"x": 0, "y": 0}}),
    SchemaCase("tagged items", {"$defs": {"tag": _obj({"name": _str(6)})},
                                **_obj({"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2}})},
               {"tags": [{"name": "red"}]}, {"tags": [{"label": "red"}]}),
    SchemaCase("an id reference", {"definitions": {"id": _int(1, 999)},
                                   **_obj({"id": {"$ref": "#/definitions/id"}})}, {"id": 5}, {"id": 0}),
    SchemaCase("a team", {"$defs": {"person": _PERSON},
                          **_obj({"lead": {"$ref": "#/$defs/person"},
                                  "deputy": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]}})},
               {"lead": {"name": "Al", "age": 40}, "deputy": None}, {"lead": {"name": "Al", "age": 40}}),
    SchemaCase("a small tree", {"$defs": {"leaf": _obj({"value": _int(0, 9)}),
                                          "node": _obj({"value": _int(0, 9), "children": {
                                              "type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}})},
                                "$ref": "#/$defs/node"},
               {"value": 1, "children": [{"value": 2}]}, {"value": 1, "children": [{"value": 12}]}),
    # strings with patterns and formats
    SchemaCase("a flight code", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
               {"code": "ABC-123"}, {"code": "AB-123"}),
    SchemaCase("a hex colour", _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}), {"hex": "#00ff7f"},
               {"hex": "#00FF7F"}),
    SchemaCase("a phone number", _obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{7,10}$"}}),
               {"phone": "+1234567"}, {"phone": "1234567"}),
    SchemaCase("a reply word", {"type": "string", "pattern": "^(yes|no|maybe)$"}, "maybe", "perhaps"),
    SchemaCase("a short code", _obj({"code": {"type": "string", "minLength": 3, "maxLength": 5}}), {"code": "abcd"},
               {"code": "ab"}),
    SchemaCase("an event date", _obj({"event": _str(12), "date": {"type": "string", "format": "date"}}),
               {"event": "launch", "date": "2025-03-14"}, {"event": "launch", "date": "2025-13-14"}),
    SchemaCase("a server address", _obj({"ip": {"type": "string", "format": "ipv4"}, "port": _int(1, 65535)}),
               {"ip": "10.0.0.1", "port": 80}, {"ip": "10.0.0.256", "port": 80}),
    SchemaCase("a request id", _obj({"id": {"type": "string", "format": "uuid"}}),
               {"id": "123e4567-e89b-12d3-a456-426614174000"}, {"id": "123e4567"}),
    # combinators
    SchemaCase("a value of either kind", _obj({"value": {"anyOf": [_int(0, 9), _str(5)]}}), {"value": "five"},
               {"value": 10}),
    SchemaCase("a shape", {"oneOf": [_obj({"kind": {"const": "circle"}, "r": _int(1, 9)}),
                                     _obj({"kind": {"const": "square"}, "side": _int(1, 9)})]},
               {"kind": "square", "side": 3}, {"kind": "circle", "side": 3}),
    SchemaCase("a combined record", {"allOf": [{"type": "object", "properties": {"a": _int(0, 9)}, "required": ["a"]},
                                               {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}],
                                     "properties": {"a": True, "b": True}, "additionalProperties": False},
               {"a": 1, "b": True}, {"a": 1}),
    SchemaCase("a counter map", {"type": "object", "patternProperties": {"^[a-z]{1,4}$": _int(0, 9)},
                                 "additionalProperties": False, "maxProperties": 3},
               {"ab": 1, "c": 2}, {"ab": 10}),
    SchemaCase("a product", _obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                                  "price": _num(0, 100, 0.25),
                                  "in_stock": {"type": "boolean"},
                                  "tags": {"type": "array", "items": {"enum": ["new", "sale"]}, "maxItems": 2}}),
               {"sku": "AB1234", "price": 9.75, "in_stock": True, "tags": ["sale"]},
               {"sku": "AB1234", "price": 9.75, "in_stock": True, "tags": ["old"]}),
)


def generate_constrained_batch(llm: Any, jobs: list[tuple[list[int], Constraint]], *, max_tokens: int = MAX_TOKENS,
                               temperature: float = 0.0, seed: int = 0,
                               logprobs: int | None = None) -> list[tuple[list[int], bool]]:
    """Runs every (prompt, constraint) job through the engine as one batch (``LLMEngine.add_request`` with the
    constraint; plain softmax sampling when ``temperature`` > 0, job i seeded with ``seed + i``; ``logprobs``
    asked or not: greedy rows are then picked on the host, else on the backend). Returns each job's
    ids (EOS left out) and whether its output finished (EOS, or nothing more allowed) rather than being cut at
    ``max_tokens``."""
    engine = llm.engine
    ids: dict[int, list[int]] = {}
    done: dict[int, bool] = {}
    rids = []
    for i, (prompt, constraint) in enumerate(jobs):
        params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed + i,
                                logprobs=logprobs)
        rid = engine.add_request(prompt, params, StopConditions(max_tokens=max_tokens), constraint)
        rids.append(rid)
        ids[rid] = []
    while len(done) < len(rids):
        for out in engine.step():
            if out.request_id in ids:
                ids[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = out.finish_reason == "stop"
                    engine.release(out.request_id)
    return [(ids[r], done[r]) for r in rids]


def generate_constrained(llm: Any, prompt: list[int], constraint: Constraint, *, max_tokens: int = MAX_TOKENS,
                         temperature: float = 0.0, seed: int = 0) -> tuple[list[int], bool]:
    """One job of :func:`generate_constrained_batch`."""
    return generate_constrained_batch(llm, [(prompt, constraint)], max_tokens=max_tokens, temperature=temperature,
                                      seed=seed)[0]
