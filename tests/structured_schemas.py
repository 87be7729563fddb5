"""Structured-output test cases as data: 20 JSON schemas, a few regexes and choice lists.

Shared by tests/test_structured_validity.py and bench/structured.py (which imports this file by
path, so it must stay free of test-only imports). Every case is sampled at temperature 1.0: a
small model at that temperature wanders, so every free-text string has a `maxLength`, every
array a `maxItems` and every number a bounded range, and each regex repeats a bounded number of
times; the output then ends (the grammar completes) well within `MAX_TOKENS`, and a run that
hits "length" is a real fault, not bad luck.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 256
"""Enough for the longest output any case below allows (the bounds above keep it so)."""

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
_TEXT = {"type": "string", "maxLength": 40}


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    prompt: str  # what the user asks for; the schema, not the prompt, guarantees the shape
    schema: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RegexCase:
    name: str
    prompt: str
    pattern: str


@dataclass(frozen=True, slots=True)
class ChoiceCase:
    name: str
    prompt: str
    choices: tuple[str, ...]


SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase("person", "Describe a person as JSON.", {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }),
    SchemaCase("enum_color", "Pick a color and say how bright it is, as JSON.", {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue", "yellow"]},
            "bright": {"type": "boolean"},
        },
        "required": ["color", "bright"],
        "additionalProperties": False,
    }),
    SchemaCase("tags", "List two to four tags for a blog post about cooking, as JSON.", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 16},
                                "minItems": 2, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    }),
    SchemaCase("nested_address", "Give a user with a home address as JSON.", {
        "type": "object",
        "properties": {
            "user": _NAME,
            "address": {
                "type": "object",
                "properties": {"street": _TEXT, "city": _NAME,
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["user", "address"],
        "additionalProperties": False,
    }),
    SchemaCase("date_pattern", "When is the meeting? Answer as JSON.", {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
                       "room": {"type": "string", "pattern": "^[A-D][0-9]{3}$"}},
        "required": ["date", "room"],
        "additionalProperties": False,
    }),
    SchemaCase("bounded_numbers", "Report a temperature reading and a humidity level as JSON.", {
        "type": "object",
        "properties": {
            "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "ok": {"type": "boolean"},
        },
        "required": ["celsius", "humidity", "ok"],
        "additionalProperties": False,
    }),
    SchemaCase("nullable", "Describe a book; its subtitle may be missing. Answer as JSON.", {
        "type": "object",
        "properties": {"title": _TEXT, "subtitle": {"type": ["string", "null"], "maxLength": 30},
                       "pages": {"type": ["integer", "null"], "minimum": 1, "maximum": 2000}},
        "required": ["title", "subtitle", "pages"],
        "additionalProperties": False,
    }),
    SchemaCase("const_version", "Write a config file header as JSON.", {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "config"}, "name": _NAME},
        "required": ["version", "kind", "name"],
        "additionalProperties": False,
    }),
    SchemaCase("any_of_shape", "Describe a circle or a rectangle as JSON.", {
        "type": "object",
        "properties": {"shape": {"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"},
                                              "radius": {"type": "integer", "minimum": 1, "maximum": 100}},
             "required": ["kind", "radius"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "rect"},
                                              "w": {"type": "integer", "minimum": 1, "maximum": 100},
                                              "h": {"type": "integer", "minimum": 1, "maximum": 100}},
             "required": ["kind", "w", "h"], "additionalProperties": False},
        ]}},
        "required": ["shape"],
        "additionalProperties": False,
    }),
    SchemaCase("array_of_objects", "List one to three products with prices as JSON.", {
        "type": "object",
        "properties": {"items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                       "cents": {"type": "integer", "minimum": 1, "maximum": 99999}},
                      "required": ["sku", "cents"], "additionalProperties": False},
        }},
        "required": ["items"],
        "additionalProperties": False,
    }),
    SchemaCase("optional_fields", "Describe a movie as JSON; add a rating if you like.", {
        "type": "object",
        "properties": {"title": _TEXT, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                       "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["title"],
        "additionalProperties": False,
    }),
    SchemaCase("deep_nesting", "Describe a company's first team as JSON.", {
        "type": "object",
        "properties": {"company": {
            "type": "object",
            "properties": {"name": _NAME, "team": {
                "type": "object",
                "properties": {"lead": {"type": "object", "properties": {"name": _NAME, "level": {"enum": [1, 2, 3]}},
                                        "required": ["name", "level"], "additionalProperties": False}},
                "required": ["lead"], "additionalProperties": False,
            }},
            "required": ["name", "team"], "additionalProperties": False,
        }},
        "required": ["company"],
        "additionalProperties": False,
    }),
    SchemaCase("fixed_tuple", "Give a point as JSON with x, y and a label.", {
        "type": "object",
        "properties": {"point": {"type": "array", "prefixItems": [
            {"type": "integer", "minimum": -100, "maximum": 100},
            {"type": "integer", "minimum": -100, "maximum": 100},
            {"type": "string", "maxLength": 10},
        ], "items": False, "minItems": 3}},
        "required": ["point"],
        "additionalProperties": False,
    }),
    SchemaCase("top_level_array", "List two to five small prime numbers as a JSON array.", {
        "type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 97}, "minItems": 2, "maxItems": 5,
    }),
    SchemaCase("enum_strings", "Classify the sentiment of 'I love it' as JSON.", {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"enum": ["low", "medium", "high"]}},
        "required": ["sentiment", "confidence"],
        "additionalProperties": False,
    }),
    SchemaCase("email_like", "Give a contact with an email address as JSON.", {
        "type": "object",
        "properties": {"name": _NAME,
                       "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"}},
        "required": ["name", "email"],
        "additionalProperties": False,
    }),
    SchemaCase("booleans", "Answer as JSON: is the sky blue, is fire cold, is water wet?", {
        "type": "object",
        "properties": {"sky_blue": {"type": "boolean"}, "fire_cold": {"type": "boolean"},
                       "water_wet": {"type": "boolean"}},
        "required": ["sky_blue", "fire_cold", "water_wet"],
        "additionalProperties": False,
    }),
    SchemaCase("matrix", "Give a 2x2 matrix of small integers as JSON.", {
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"],
        "additionalProperties": False,
    }),
    SchemaCase("tool_call_shape", "Call the weather tool for Paris as JSON.", {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {"type": "object",
                          "properties": {"city": _NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }),
    SchemaCase("defs_ref", "Describe a parent and one or two children as JSON.", {
        "$defs": {"person": {"type": "object", "properties": {"name": _NAME,
                                                             "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                             "required": ["name", "age"], "additionalProperties": False}},
        "type": "object",
        "properties": {"parent": {"$ref": "#/$defs/person"},
                       "children": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1, "maxItems": 2}},
        "required": ["parent", "children"],
        "additionalProperties": False,
    }),
)

REGEXES: tuple[RegexCase, ...] = (
    RegexCase("phone", "Give a phone number.", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    RegexCase("ipv4", "Give an IPv4 address.", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    RegexCase("yes_no_reason", "Is Paris in France? Answer yes or no and a short reason.",
              r"(yes|no): [a-z ]{1,30}\."),
)

CHOICES: tuple[ChoiceCase, ...] = (
    ChoiceCase("sentiment", "Is 'what a lovely day' positive or negative?", ("positive", "negative", "neutral")),
    ChoiceCase("capital", "What is the capital of France?", ("Paris", "London", "Berlin", "Madrid", "Rome")),
)
