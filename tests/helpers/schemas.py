"""A suite of JSON Schemas for structured-output tests: nested objects, arrays with min/max
items, enums, ``anyOf``, ``$ref``/``$defs``, string formats and patterns, numbers with bounds,
required and optional keys. Strings are bounded (``maxLength``, ``pattern``, ``enum``) so that a
135M model sampling at temperature 1 finishes within the tests' token budget: an unbounded
string is valid at any length, and a small model can fill it until ``max_tokens``.
"""
from __future__ import annotations

S = {"type": "string", "maxLength": 12}          # a short free string
NAME = {"type": "string", "minLength": 1, "maxLength": 16}
INT = {"type": "integer", "minimum": -9999, "maximum": 9999}   # digits are a string too

SCHEMAS: dict[str, dict] = {
    "flat_required": {"type": "object", "properties": {"name": NAME, "age": INT},
                      "required": ["name", "age"]},
    "optional_keys": {"type": "object", "properties": {"a": S, "b": {"type": "boolean"}, "c": {"type": "number", "minimum": 0, "maximum": 10}},
                      "required": ["a"]},
    "int_bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
                   "required": ["n"]},
    "exclusive_bounds": {"type": "object", "properties": {"x": {"type": "integer", "exclusiveMinimum": 0,
                                                                "exclusiveMaximum": 5}}, "required": ["x"]},
    "number_range": {"type": "object", "properties": {"t": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
                     "required": ["t"]},
    "negative_ints": {"type": "object", "properties": {"d": {"type": "integer", "maximum": -10, "minimum": -99}},
                      "required": ["d"]},
    "enum_string": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"]},
    "enum_mixed": {"type": "object", "properties": {"v": {"enum": [1, "two", None, True]}}, "required": ["v"]},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": INT},
              "required": ["kind", "x"]},
    "array_bounds": {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1,
                                                               "maxItems": 3}}, "required": ["tags"]},
    "array_of_ints": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                      "minItems": 2, "maxItems": 4},
    "exact_items": {"type": "object", "properties": {"rgb": {"type": "array", "items": INT,
                                                             "minItems": 3, "maxItems": 3}}, "required": ["rgb"]},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 8}, INT],
                     "items": False},
    "nested_object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "address": {
            "type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}}, "required": ["name", "address"]}}, "required": ["user"]},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": INT, "label": S}, "required": ["id", "label"]}}},
        "required": ["items"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [INT, {"type": "boolean"}]}},
               "required": ["value"]},
    "any_of_objects": {"anyOf": [
        {"type": "object", "properties": {"cat": NAME}, "required": ["cat"], "additionalProperties": False},
        {"type": "object", "properties": {"dog": INT}, "required": ["dog"],
         "additionalProperties": False}]},
    "nullable": {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 8}},
                 "required": ["maybe"]},
    "ref_defs": {"$defs": {"point": {"type": "object", "properties": {"x": INT, "y": INT},
                                     "required": ["x", "y"]}},
                 "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                 "required": ["a", "b"]},
    "ref_in_array": {"$defs": {"tag": {"type": "string", "enum": ["x", "y", "z"]}},
                     "type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 4},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "format_date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                    "required": ["day"]},
    "format_email": {"type": "object", "properties": {"email": {"type": "string", "format": "email"}}, "required": ["email"]},
    "format_ipv4": {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
                    "required": ["ip"]},
    "format_uuid": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                    "required": ["id"]},
    "string_lengths": {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 5}},
                       "required": ["s"]},
    "closed_object": {"type": "object", "properties": {"only": {"type": "boolean"}}, "required": ["only"],
                      "additionalProperties": False},
    "boolean_root": {"type": "boolean"},
    "integer_root": {"type": "integer", "minimum": 10, "maximum": 20},
    "string_enum_root": {"enum": ["alpha", "beta"]},
    "deep_nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "object", "properties": {"d": INT},
                                               "required": ["d"]}}, "required": ["c"]}}, "required": ["b"]}},
                     "required": ["a"]},
    "person_full": {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "golf", "music"]}, "maxItems": 3},
        "married": {"type": "boolean"}}, "required": ["name", "age", "hobbies"]},
}
