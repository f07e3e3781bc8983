"""Every JSON Schema keyword is enforced or refused, never silently ignored (issue 38).

For each keyword of ``schema.KEYWORDS`` this suite holds at least one case:
  * ``enforced``: a schema using it, instances valid against it (checked with ``jsonschema``)
    that the compiled grammar accepts, and instances that break the keyword (invalid for
    ``jsonschema``) that the grammar refuses;
  * ``refused``: a schema using it that ``GrammarSpec`` refuses with a message naming it;
  * ``annotation``: a schema using it that compiles to the same grammar as without it.
Instances are written as the engine writes JSON (``", "`` and ``": "`` separators). The set of
keywords with cases must equal the table's, and README.md's table is the table's Markdown.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from sluice.engine.structured import GrammarSpec
from sluice.engine.structured.manager import json_schema_grammar
from sluice.engine.structured.schema import KEYWORDS, keyword_table, normalize

DRAFT7 = "http://json-schema.org/draft-07/schema#"
OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

# keyword -> [(schema, valid instances, invalid instances)]
ENFORCED = {
    "type": [({"type": "integer"}, [3], ["3", 1.5, None]),
             ({"type": ["string", "null"]}, ["x", None], [1])],
    "enum": [({"enum": ["a", 1, None]}, ["a", 1, None], ["b", 2]),
             ({"type": "string", "enum": ["a", 1]}, ["a"], [1])],
    "const": [({"const": {"k": [1, 2]}}, [{"k": [1, 2]}], [{"k": [1]}])],
    "properties": [(OBJ_AB, [{"a": 1}, {}], [{"a": "x"}])],
    "required": [({**OBJ_AB, "required": ["a"]}, [{"a": 1}], [{}, {"b": 2}]),
                 ({"type": "object", "required": ["z"]}, [{"z": 1}], [{}])],
    "additionalProperties": [({**OBJ_AB, "additionalProperties": False}, [{"a": 1}], [{"a": 1, "c": 2}]),
                             ({"type": "object", "additionalProperties": {"type": "integer"}},
                              [{"x": 1, "y": 2}], [{"x": "s"}])],
    "patternProperties": [({"type": "object", "patternProperties": {"^n_[a-z]+$": {"type": "integer"}},
                            "additionalProperties": False}, [{"n_a": 1}], [{"m": 1}, {"n_a": "x"}])],
    "propertyNames": [({"type": "object", "propertyNames": {"pattern": "^[a-c]+$"},
                        "additionalProperties": {"type": "integer"}}, [{"ab": 1}], [{"z": 1}])],
    "minProperties": [({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
                       [{"a": 1, "b": 2}], [{"a": 1}])],
    "maxProperties": [({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                       [{"a": 1}], [{"a": 1, "b": 2}])],
    "unevaluatedProperties": [({**OBJ_AB, "unevaluatedProperties": False}, [{"a": 1}], [{"a": 1, "c": 2}]),
                              ({"type": "object", "properties": {"a": {"type": "integer"}},
                                "anyOf": [{"required": ["a"]}], "unevaluatedProperties": False},
                               [{"a": 1}], [{"a": 1, "c": 2}])],
    "items": [({"type": "array", "items": {"type": "integer"}}, [[1, 2]], [[1, "a"]]),
              ({"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}, {"type": "string"}]},
               [[1, "a"]], [[1, 2]])],
    "prefixItems": [({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, [[1]], [[1, 2], ["a"]])],
    "additionalItems": [({"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}], "additionalItems": False},
                         [[1]], [[1, 2]])],
    "unevaluatedItems": [({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
                          [[1]], [[1, 2]])],
    "minItems": [({"type": "array", "minItems": 2}, [[1, 2]], [[1]])],
    "maxItems": [({"type": "array", "maxItems": 1}, [[1]], [[1, 2]])],
    "minLength": [({"type": "string", "minLength": 2}, ["ab"], ["a"])],
    "maxLength": [({"type": "string", "maxLength": 2}, ["ab"], ["abc"])],
    "pattern": [({"type": "string", "pattern": "^[a-c]+$"}, ["abc"], ["abd"])],
    "format": [({"type": "string", "format": "date"}, ["2026-12-05"], ["yesterday"]),
               ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["12"]),
               ({"type": "integer", "format": "int32"}, [5, -(1 << 31)], [])],   # bounds: test_int_formats
    "minimum": [({"type": "number", "minimum": 2.5}, [2.5, 3], [2.4]), ({"minimum": 5}, [6], [4])],
    "maximum": [({"type": "integer", "maximum": 3}, [3], [4])],
    "exclusiveMinimum": [({"type": "integer", "exclusiveMinimum": 2}, [3], [2])],
    "exclusiveMaximum": [({"type": "number", "exclusiveMaximum": 2}, [1.5], [2])],
    "multipleOf": [({"type": "integer", "multipleOf": 3}, [9], [10]),
                   ({"type": "number", "multipleOf": 2}, [4], [3, 2.5])],
    "anyOf": [({"anyOf": [{"type": "integer"}, {"type": "null"}]}, [1, None], ["a"]),
              ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}, [6, -6], [1, "a"])],
    "oneOf": [({"oneOf": [{"type": "integer"}, {"type": "string"}]}, [1, "a"], [None]),
              ({"$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                                  "required": ["kind"]},
                          "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                                  "required": ["kind"]}},
                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                "discriminator": {"propertyName": "kind"}},
               [{"kind": "cat", "lives": 9}], [{"kind": "cow"}])],
    "allOf": [({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
               [{"a": 1}], [{}, {"a": "x"}])],
    "$ref": [({"$defs": {"A": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}},
              [{"x": 1}], [{"x": "a"}]),
             ({"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}}},
              [{"v": 1, "next": {"v": 2}}], [{"next": {"v": "x"}}])],
    "$defs": [({"$defs": {"N": {"type": "string"}}, "$ref": "#/$defs/N"}, ["a"], [1])],
    "definitions": [({"definitions": {"N": {"type": "string"}}, "$ref": "#/definitions/N"}, ["a"], [1])],
    # OpenAPI's keyword: jsonschema knows it as the type list it stands for.
    "nullable": [({"type": "integer", "nullable": True}, [1, None], ["a"])],
}

# keyword -> [(schema, message pattern)]
REFUSED = {
    "not": [({"not": {"type": "integer"}}, "'not' at /")],
    "if": [({"if": {"type": "integer"}, "then": {"minimum": 5}}, "'if'")],
    "then": [({"then": {"minimum": 5}}, "'then'")],
    "else": [({"else": {"minimum": 5}}, "'else'")],
    "uniqueItems": [({"type": "array", "uniqueItems": True}, "'uniqueItems'")],
    "contains": [({"type": "array", "contains": {"type": "integer"}}, "'contains'")],
    "minContains": [({"type": "array", "minContains": 2}, "'minContains'")],
    "maxContains": [({"type": "array", "maxContains": 2}, "'maxContains'")],
    "dependentRequired": [({**OBJ_AB, "dependentRequired": {"a": ["b"]}}, "'dependentRequired'")],
    "dependentSchemas": [({**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, "'dependentSchemas'")],
    "dependencies": [({**OBJ_AB, "dependencies": {"a": ["b"]}}, "'dependencies'")],
    "$dynamicRef": [({"$dynamicRef": "#meta"}, r"'\$dynamicRef'")],
    "$recursiveRef": [({"$recursiveRef": "#"}, r"'\$recursiveRef'")],
    "contentEncoding": [({"type": "string", "contentEncoding": "base64"}, "'contentEncoding'")],
    "contentMediaType": [({"type": "string", "contentMediaType": "application/json"}, "'contentMediaType'")],
    "contentSchema": [({"type": "string", "contentSchema": {"type": "object"}}, "'contentSchema'")],
}

# Refused uses of enforced keywords (the table's notes), each naming its keyword.
REFUSED_USES = [
    ({"type": "string", "pattern": "^(?!abc).*$"}, "'pattern' at / is not supported: lookaround"),
    ({"type": "string", "pattern": "^a(?<=a)$"}, "'pattern' .*lookaround"),
    ({"type": "object", "patternProperties": {"^(?=x)": {}}}, "'patternProperties' .*lookaround"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' at / is not supported: a fractional value"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]},
     "'oneOf' at / is not supported: branches 0 and 1 may both match"),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "'oneOf'"),
    ({"$ref": "https://example.com/schema.json"}, r"'\$ref' at / is not supported: only local JSON pointers"),
    ({"$defs": {"A": {"$anchor": "a", "type": "integer"}}, "$ref": "#a"}, r"'\$ref'"),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "minimum": 5}, r"'\$ref' .*beside it \(minimum\)"),
    ({"type": "string", "format": "password"}, "'format' at / is not supported: 'password'"),
    ({"format": "color"}, "'format'"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "'minLength' .*together with 'pattern'"),
    ({"type": "integer", "exclusiveMinimum": True, "minimum": 1}, "'exclusiveMinimum' .*boolean"),
    ({"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 1}]}, "'allOf' .*overlap on type"),
    ({"type": "integer", "anyOf": [{"type": "integer", "minimum": 1}]}, "'anyOf' .*overlap branch 0 on type"),
    ({"type": "object", "additionalProperties": False, "required": ["a"]}, "'required' .*additionalProperties"),
    ({"type": "string", "const": 1}, "'const'"),
    ({"type": "string", "enum": [1, 2]}, "'enum'"),
]

ANNOTATION_USES = {
    "title": "T", "description": "d", "default": 1, "examples": [1], "deprecated": False, "readOnly": True,
    "writeOnly": False, "$comment": "c", "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://example.com/a", "$anchor": "a", "$dynamicAnchor": "m", "$recursiveAnchor": False,
    "$vocabulary": {}, "discriminator": {"propertyName": "kind"},
}


def _grammar(schema, strict: bool = False):
    text = json.dumps(schema)
    GrammarSpec("json_schema", text, strict=strict)          # the request-time check passes
    return json_schema_grammar(text, strict)


def _accepts(grammar, value) -> bool:
    """The engine writes ", " and ": " between items; xgrammar writes a const or enum value
    compactly (``{"k":[1,2]}``): either form counts."""
    return any(_is_grammar_accept_string(grammar, json.dumps(value, separators=seps))
               for seps in ((", ", ": "), (",", ":")))


def _validate(value, schema) -> None:
    """``jsonschema``'s verdict (formats checked), with OpenAPI's nullable as its type list."""
    if schema.get("nullable") is True:
        schema = {**schema, "type": [schema["type"], "null"]}
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def test_every_keyword_of_the_table_has_a_case():
    covered = set(ENFORCED) | set(REFUSED) | set(ANNOTATION_USES)
    assert covered == set(KEYWORDS)
    for kw, (how, _) in KEYWORDS.items():
        assert kw in {"enforced": ENFORCED, "refused": REFUSED, "annotation": ANNOTATION_USES}[how], kw


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_enforced_keywords_hold_the_output_to_them(keyword):
    for schema, good, bad in ENFORCED[keyword]:
        grammar = _grammar(schema)
        for value in good:
            _validate(value, schema)                            # the case itself is right
            assert _accepts(grammar, value), f"{keyword}: {schema} refused the valid {value!r}"
        for value in bad:
            with pytest.raises(jsonschema.ValidationError):
                _validate(value, schema)
            assert not _accepts(grammar, value), f"{keyword}: {schema} let the invalid {value!r} through"


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_refused_keywords_are_a_clear_error(keyword):
    for schema, message in REFUSED[keyword]:
        with pytest.raises(ValueError, match=f"^response_format: JSON Schema keyword {message}"):
            GrammarSpec("json_schema", json.dumps(schema), field="response_format")


@pytest.mark.parametrize("schema, message", REFUSED_USES)
def test_unenforceable_uses_of_enforced_keywords_are_refused(schema, message):
    with pytest.raises(ValueError, match=f"^guided_json: JSON Schema keyword {message}"):
        GrammarSpec("json_schema", json.dumps(schema), field="guided_json")


@pytest.mark.parametrize("keyword", sorted(ANNOTATION_USES))
def test_annotations_change_nothing(keyword):
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    annotated = {**plain, keyword: ANNOTATION_USES[keyword]}
    assert str(_grammar(annotated)) == str(_grammar(plain))


def test_a_lookaround_regex_is_refused_as_guided_regex():
    with pytest.raises(ValueError, match=r"^guided_regex: lookaround \(\(\?!\.\.\.\) at position 1"):
        GrammarSpec("regex", "^(?!abc)[a-z]+$", field="guided_regex")
    GrammarSpec("regex", r"^\(?!x[(?!]$", field="guided_regex")   # escaped or in a class: plain characters


def test_strict_closes_objects_that_name_no_properties():
    """OpenAI's strict: every object schema that says nothing of additionalProperties is closed,
    including objects without properties, nested ones, and ones inside anyOf and type lists."""
    for schema, value in [({"type": "object"}, {"x": 1}),
                          ({"type": "object", "properties": {"m": {"type": "object"}}}, {"m": {"x": 1}}),
                          ({"anyOf": [{"type": "object"}, {"type": "null"}]}, {"x": 1}),
                          ({"type": "array", "items": {"type": "object"}}, [{"x": 1}]),
                          ({"type": ["object", "null"]}, {"x": 1})]:
        assert _accepts(_grammar(schema), value), schema                     # not strict: open
        assert not _accepts(_grammar(schema, strict=True), value), schema    # strict: closed
        assert _accepts(_grammar(schema, strict=True), json.loads(json.dumps(value).replace('"x": 1', "")) or {})
    explicit = {"type": "object", "additionalProperties": True}
    assert _accepts(_grammar(explicit, strict=True), {"x": 1})               # said open: stays open


def test_int_formats_are_bounds():
    g = _grammar({"type": "integer", "format": "int32"})
    assert _accepts(g, (1 << 31) - 1) and not _accepts(g, 1 << 31) and not _accepts(g, -(1 << 31) - 1)
    g = _grammar({"type": "number", "format": "int64"})
    assert _accepts(g, 1 << 62) and not _accepts(g, 1 << 63) and not _accepts(g, 1.5)


def test_normalize_leaves_the_callers_schema_alone():
    schema = {"type": "number", "multipleOf": 2, "anyOf": [{"minimum": 1}]}
    before = json.dumps(schema)
    normalize(schema, True, "f")
    assert json.dumps(schema) == before


def test_readme_keyword_table_is_the_generated_one():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    m = re.search(r"<!-- json-schema-keywords:begin -->\n(.*?)\n<!-- json-schema-keywords:end -->", readme, re.S)
    assert m, "README.md has no json-schema-keywords region"
    assert m.group(1).strip() == keyword_table(), \
        "README.md's keyword table differs from schema.keyword_table(); paste its output between the markers"


def test_xgrammar_still_ignores_what_we_rewrite():
    """The rewrites exist because xgrammar compiles these without keeping them; if a new
    xgrammar enforces one, this fails and the rewrite (and the table's note) can go."""
    raw = {"type": "object", "properties": {"a": {"type": "integer"}}, "dependencies": {"a": ["b"]}}
    g = xgr.Grammar.from_json_schema(json.dumps(raw), any_whitespace=False)
    assert _accepts(g, {"a": 1})                                   # dependencies ignored
    g = xgr.Grammar.from_json_schema(json.dumps({"type": "number", "multipleOf": 0.5}), any_whitespace=False)
    assert _accepts(g, 0.3)                                        # fractional multipleOf ignored
