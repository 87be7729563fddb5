"""JSON schemas as vLLM users expect them (streamengine/structured/json_schema.py): properties a schema does
not name are refused unless it allows them, `strict: false` keeps JSON Schema's defaults,
formats llguidance cannot enforce constrain the type only, and an overlapping oneOf compiles.

The rules are checked on the normalized dicts, with `jsonschema` (what an instance means under
the normalized schema), and end to end: the grammar llguidance compiles from a spec, walked byte
by byte (a tokenizer of the 256 bytes: no model needed), accepts the valid text and refuses
the one with an extra key.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Annotated, Literal

import jsonschema
import llguidance
import pytest
from pydantic import UUID4, BaseModel, Field, SecretStr

from streamengine.server.openai import schemas
from streamengine.server.openai.endpoints import _response_format
from streamengine.server.tools import plan_tools
from streamengine.structured.grammar import grammar_text
from streamengine.structured.json_schema import ENFORCED_FORMATS, MAX_ADDED_NODES, normalize_schema
from streamengine.structured.params import Grammar, JsonSchema, as_structured, structured_key
from streamengine.structured.tool_prompt import tool_call_lark, tools_system_text

# ---------------------------------------------------------------- helpers


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, and an end of sequence."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def matcher(spec) -> llguidance.LLMatcher:
    """The compiled spec (as the engine compiles it), or the compiler's error as an assertion."""
    ll = llguidance.LLMatcher(BYTES, grammar_text(spec), log_level=0)
    assert not ll.is_error(), ll.get_error()
    return ll


def accepts(spec, text: str) -> bool:
    ll = matcher(spec)
    return all(ll.consume_token(b) for b in text.encode()) and ll.is_accepting()


def valid(schema: dict, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

# ---------------------------------------------------------------- the rules, on the dicts


def test_objects_at_every_depth_refuse_unnamed_properties():
    schema = {
        "type": "object",
        "properties": {
            "inner": copy.deepcopy(OBJ),
            "list": {"type": "array", "items": copy.deepcopy(OBJ)},
            "pair": {"type": "array", "prefixItems": [copy.deepcopy(OBJ)], "items": copy.deepcopy(OBJ)},
            "map": {"type": "object", "additionalProperties": copy.deepcopy(OBJ)},
            "either": {"anyOf": [copy.deepcopy(OBJ), {"type": "null"}]},
        },
        "$defs": {"D": copy.deepcopy(OBJ)},
        "definitions": {"E": {"properties": {"b": {}}}},  # no "type": still an object schema
    }
    original = copy.deepcopy(schema)
    out = normalize_schema(schema)
    assert schema == original  # the client's dict is never changed
    props = out["properties"]
    closed = [out, props["inner"], props["list"]["items"], props["pair"]["prefixItems"][0], props["pair"]["items"],
              props["map"]["additionalProperties"], props["either"]["anyOf"][0], out["$defs"]["D"],
              out["definitions"]["E"]]
    assert all(node["additionalProperties"] is False for node in closed)
    assert props["map"]["additionalProperties"]["properties"] == OBJ["properties"]  # the schema stays a schema
    assert props["either"]["anyOf"][1] == {"type": "null"}
    assert valid(out, {"inner": {"a": 1}, "list": [{"a": 2}]})
    assert not valid(out, {"inner": {"a": 1, "x": 0}}) and not valid(out, {"list": [{"a": 2, "x": 0}]})
    assert not valid(out, {"x": 0}) and valid(original, {"x": 0})


def test_what_a_schema_allows_explicitly_is_left_alone():
    kept = [
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
        {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": {"type": "string"}},
        {"type": "object"},  # lists no properties: any object (xgrammar's too)
        {"type": "object", "minProperties": 1, "description": "a map"},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "minItems": 1},  # no items: any items
        {"type": "string", "properties": {"a": {}}},  # not an object schema
    ]
    for schema in kept:
        assert normalize_schema(schema) == schema, schema
    assert normalize_schema(True) is True and normalize_schema(False) is False


def test_pattern_properties_keep_the_keys_they_match():
    schema = normalize_schema({"type": "object", "properties": {"a": {}}, "patternProperties": {"^x_": {"type": "integer"}}})
    assert schema["additionalProperties"] is False
    assert valid(schema, {"a": 1, "x_1": 2}) and not valid(schema, {"a": 1, "y": 2})


def test_a_required_name_counts_as_named():
    schema = normalize_schema({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]})
    assert list(schema["properties"]) == ["a", "b"] and valid(schema, {"a": 1, "b": 2})


def test_tuples_refuse_items_past_the_listed_ones():
    assert normalize_schema({"type": "array", "prefixItems": [{"type": "integer"}]})["items"] is False
    draft4 = normalize_schema({"type": "array", "items": [{"type": "integer"}]})
    assert draft4["additionalItems"] is False
    assert normalize_schema({"type": "array", "prefixItems": [{}], "items": {"type": "string"}})["items"] == {"type": "string"}
    assert "items" not in normalize_schema({"type": "array", "prefixItems": [{}]}, strict=False)


def test_refs_point_at_definitions_closed_on_their_own():
    schema = {"$defs": {"Item": copy.deepcopy(OBJ)}, "type": "object",
              "properties": {"item": {"$ref": "#/$defs/Item", "description": "one"}}}
    out = normalize_schema(schema)
    assert out["properties"]["item"] == {"$ref": "#/$defs/Item", "description": "one"}
    assert out["$defs"] == {"Item": {**OBJ, "additionalProperties": False}}
    assert valid(out, {"item": {"a": 1}}) and not valid(out, {"item": {"a": 1, "b": 2}})


def test_all_of_parts_are_one_object():
    """The names of every part are the object's (llguidance intersects parts: each closed on its
    own names would refuse the others'); a part that is a $ref uses an open copy."""
    schema = {
        "$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
        "type": "object",
        "properties": {
            "inline": {"allOf": [copy.deepcopy(OBJ), {"properties": {"b": {"type": "string"}}}]},
            "derived": {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}}]},
            "base": {"$ref": "#/$defs/Base"},
        },
    }
    out = normalize_schema(schema)
    assert out["$defs"]["Base.open"] == schema["$defs"]["Base"]
    assert out["$defs"]["Base"]["additionalProperties"] is False
    assert out["properties"]["derived"]["allOf"][0] == {"$ref": "#/$defs/Base.open"}
    assert valid(out, {"inline": {"a": 1, "b": "x"}, "derived": {"id": 1, "name": "n"}, "base": {"id": 2}})
    assert not valid(out, {"inline": {"a": 1, "c": 0}})
    assert not valid(out, {"derived": {"id": 1, "c": 0}})
    assert not valid(out, {"base": {"id": 1, "name": "n"}})  # Base alone names no "name"


def test_alternatives_allow_the_names_of_their_object():
    schema = {
        "$defs": {"Y": {"properties": {"y": {"type": "integer"}}, "required": ["y"]}},
        "type": "object",
        "properties": {"kind": {"type": "string"}},
        "required": ["kind"],
        "oneOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}, {"$ref": "#/$defs/Y"}],
    }
    out = normalize_schema(schema)
    assert "oneOf" not in out and len(out["anyOf"]) == 2
    assert valid(out, {"kind": "a", "x": 1}) and valid(out, {"kind": "a", "y": 1})
    assert not valid(out, {"kind": "a", "x": 1, "y": 2}) and not valid(out, {"kind": "a", "x": 1, "z": 0})
    # an allOf of alternatives: each alternative allows the names of the other groups
    product = normalize_schema({"allOf": [
        {"anyOf": [{"properties": {f"p{g}_{b}": {}}, "required": [f"p{g}_{b}"]} for b in range(2)]} for g in range(2)]})
    assert valid(product, {"p0_1": 1, "p1_0": 2}) and not valid(product, {"p0_1": 1, "p1_0": 2, "z": 3})
    assert not valid(product, {"p0_0": 1, "p0_1": 1, "p1_0": 2})


def test_not_strict_keeps_json_schemas_defaults():
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "phone"}},
              "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    out = normalize_schema(schema, strict=False)
    assert out == {"type": "object", "properties": {"a": {"type": "string"}},
                   "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}


def test_formats_llguidance_cannot_enforce_are_dropped():
    out = normalize_schema({"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"},
        "phone": {"type": "string", "format": "phone", "maxLength": 20},
        "secret": {"type": "string", "format": "password"},
        "id": {"type": "string", "format": "uuid4"},
        "own": {"type": "string", "format": "uuid4", "pattern": "^[0-9a-f-]+$"},
        "n": {"type": "integer", "format": "int32"},
    }})["properties"]
    assert out["when"] == {"type": "string", "format": "date-time"}
    assert out["phone"] == {"type": "string", "maxLength": 20} and out["secret"] == {"type": "string"}
    assert out["n"] == {"type": "integer"} and out["own"] == {"type": "string", "pattern": "^[0-9a-f-]+$"}
    assert valid(out["id"], str(uuid.uuid4())) and not valid(out["id"], str(uuid.uuid1()))


def test_one_of_beside_any_of_joins_the_all_of():
    out = normalize_schema({"anyOf": [{"type": "integer"}, {"type": "string"}], "oneOf": [{"minimum": 0}, {"maxLength": 3}],
                            "allOf": [{"not": {"const": 5}}]})
    assert "oneOf" not in out and out["allOf"][-1] == {"anyOf": [{"minimum": 0}, {"maxLength": 3}]}
    assert len(out["allOf"]) == 2 and len(out["anyOf"]) == 2


def test_schemas_too_deep_or_too_composed_are_value_errors():
    deep: dict = {"type": "integer"}
    for _ in range(3000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests too deeply"):
        normalize_schema(deep)
    # an allOf of two 101-way anyOfs: each branch would list all 202 names
    product = {"allOf": [{"anyOf": [{"properties": {f"p{g}_{b}": {}}} for b in range(101)]} for g in range(2)]}
    with pytest.raises(ValueError, match=f"more than {MAX_ADDED_NODES} subschemas"):
        normalize_schema(product)
    assert normalize_schema(product, strict=False)["allOf"] == product["allOf"]
    # one definition with alternatives, an allOf part of many objects: an open copy for each
    defs = {"B": {"properties": {f"k{i}": {"type": "integer"} for i in range(1000)}, "anyOf": [{"properties": {"z": {}}}, {}]}}
    many = {f"o{i}": {"properties": {f"u{i}": {}}, "allOf": [{"$ref": "#/$defs/B"}]} for i in range(30)}
    with pytest.raises(ValueError, match=f"more than {MAX_ADDED_NODES} subschemas"):
        normalize_schema({"$defs": defs, "properties": many})


# ---------------------------------------------------------------- end to end through llguidance


class Address(BaseModel):
    city: str
    zip: str


class Person(BaseModel):
    name: str
    address: Address
    tags: list[str]


PERSON = '{"name": "Ada", "address": {"city": "Paris", "zip": "75001"}, "tags": ["x"]}'


def test_a_pydantic_models_schema_refuses_an_extra_key():
    spec = JsonSchema(schema=Person.model_json_schema())
    assert accepts(spec, PERSON)
    assert not accepts(spec, PERSON[:-1] + ', "age": 3}')
    assert not accepts(spec, PERSON.replace('"75001"}', '"75001", "country": "FR"}'))


def test_strict_false_allows_an_extra_key_and_keys_the_cache_apart():
    spec = as_structured({"type": "json_schema", "schema": Person.model_json_schema(), "strict": False})
    assert spec.strict is False and accepts(spec, PERSON[:-1] + ', "age": 3}')
    strict = JsonSchema(schema=Person.model_json_schema())
    assert structured_key(spec) != structured_key(strict)
    assert b"strict" not in structured_key(strict)  # absent stays absent: keys of older specs unchanged
    assert accepts(JsonSchema(schema=Person.model_json_schema(), strict=True), PERSON)


class Account(BaseModel):
    id: UUID4
    secret: SecretStr
    phone: str = Field(json_schema_extra={"format": "phone"})


def test_formats_llguidance_does_not_know_compile():
    spec = JsonSchema(schema=Account.model_json_schema())
    good = {"id": str(uuid.uuid4()), "secret": "s3cret", "phone": "+33 1 23"}
    assert accepts(spec, json.dumps(good))
    assert not accepts(spec, json.dumps({**good, "id": "not-a-uuid"}))
    assert not accepts(JsonSchema(schema={"type": "string", "format": "date"}), '"soon"')  # still enforced


@pytest.mark.parametrize("fmt", sorted(ENFORCED_FORMATS))
def test_the_enforced_formats_are_enforced(fmt):
    assert not accepts(JsonSchema(schema={"type": "string", "format": fmt}), '"-?-"')


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    bark: str


class Pet(BaseModel):
    pet: Cat | Dog = Field(discriminator="kind")


def test_a_discriminated_union_compiles_and_holds_each_branch():
    schema = Pet.model_json_schema()
    assert "oneOf" in schema["properties"]["pet"]
    spec = JsonSchema(schema=schema)
    assert accepts(spec, '{"pet": {"kind": "cat", "lives": 9}}')
    assert accepts(spec, '{"pet": {"kind": "dog", "bark": "woof"}}')
    assert not accepts(spec, '{"pet": {"kind": "cat", "bark": "woof"}}')
    assert not accepts(spec, '{"pet": {"kind": "cat", "lives": 9, "bark": "woof"}}')


class Circle(BaseModel):
    shape: Literal["circle"] = "circle"  # a tag with a default: pydantic does not list it as required
    radius: int


class Square(BaseModel):
    shape: Literal["square"] = "square"
    side: int


class Drawing(BaseModel):
    shapes: list[Annotated[Circle | Square, Field(discriminator="shape")]]


def test_a_discriminated_unions_tag_is_required_in_every_branch():
    schema = Drawing.model_json_schema()
    assert all("shape" not in d.get("required", []) for d in schema["$defs"].values())
    before = copy.deepcopy(schema)
    normalized = normalize_schema(schema)
    assert schema == before  # the client's schema is not changed
    assert all("shape" in normalized["$defs"][name]["required"] for name in ("Circle", "Square"))
    spec = JsonSchema(schema=schema)
    assert accepts(spec, '{"shapes": [{"shape": "circle", "radius": 2}]}')
    assert not accepts(spec, '{"shapes": [{"radius": 2}]}')  # pydantic refuses it: no tag
    Drawing.model_validate_json('{"shapes": [{"shape": "circle", "radius": 2}]}')


def test_an_overlapping_one_of_compiles_as_any_of():
    spec = JsonSchema(schema={"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
                              "required": ["n"]})
    assert accepts(spec, '{"n": 1}') and accepts(spec, '{"n": 1.5}') and not accepts(spec, '{"n": "1"}')


# ---------------------------------------------------------------- tools and response_format

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "c"%s}}\n</tool_call>'


def test_a_forced_calls_arguments_refuse_an_extra_key_unless_not_strict():
    functions = [{"name": "weather", "parameters": CITY}]
    forced = Grammar(grammar=tool_call_lark(functions))
    assert accepts(forced, CALL % "") and not accepts(forced, CALL % ', "when": "now"')
    lenient = Grammar(grammar=tool_call_lark([{**functions[0], "strict": False}]))
    assert accepts(lenient, CALL % ', "when": "now"')
    assert '"strict"' not in tools_system_text([{**functions[0], "strict": True}])  # nothing for the model


def test_function_strict_reaches_the_forcing_grammar():
    def plan(strict):
        tool = schemas.Tool(function=schemas.FunctionDefinition(name="weather", parameters=CITY, strict=strict))
        return plan_tools([tool], "required", parallel=False, parser_name="hermes")

    for strict, extra_allowed in ((None, False), (True, False), (False, True)):
        spec = as_structured(plan(strict).structured)
        assert accepts(spec, CALL % ""), strict
        assert accepts(spec, CALL % ', "when": "now"') is extra_allowed, strict


def test_response_format_passes_strict():
    def spec(strict):
        fmt = schemas.ResponseFormat(type="json_schema", json_schema=schemas.JsonSchemaFormat(
            name="p", schema=Person.model_json_schema(), strict=strict))
        return as_structured(_response_format(fmt))

    assert spec(None).strict is None and spec(True).strict is True and spec(False).strict is False
    assert accepts(spec(False), PERSON[:-1] + ', "age": 3}') and not accepts(spec(True), PERSON[:-1] + ', "age": 3}')
