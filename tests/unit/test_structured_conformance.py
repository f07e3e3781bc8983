"""Issue 38's conformance fixes at the engine's grammar layer (SmolLM2's tokenizer, no weights):
  * a tool whose parameters use ``$defs``/``$ref`` (what pydantic and
    ``openai.pydantic_function_tool`` write for a nested model, spelled out here) compiles under every
    ``tool_choice``, and its calls are held to the referenced schema;
  * a generated object never repeats a key: the bitmask forbids every token that would close a
    key already written in that object (``additionalProperties``, ``json_object``, tool
    arguments, escaped spellings of the same key, drafted rows).
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from xgrammar.testing import _is_grammar_accept_string

from sluice.engine.rpc.convert import structured_from_proto
from sluice.engine.structured import GrammarSpec
from sluice.engine.structured.bitmask import unpack_bitmask
from sluice.engine.structured.json_keys import KeyTracker
from sluice.engine.structured.manager import json_schema_grammar
from sluice.http_facade import protocol
from tests.unit.test_structured_output import _Req, manager  # noqa: F401 - the manager fixture


# What ``openai.pydantic_function_tool`` sends for ``Order(items: list[Item], note: str | None)``
# with ``Item(sku: str, qty: int)`` (openai 2.x, pydantic 2.x): pydantic's nested-model shape.
ORDER_TOOL = {"type": "function", "function": {"name": "Order", "strict": True, "parameters": {
    "$defs": {"Item": {"properties": {"sku": {"title": "Sku", "type": "string"},
                                      "qty": {"title": "Qty", "type": "integer"}},
                       "required": ["sku", "qty"], "title": "Item", "type": "object", "additionalProperties": False}},
    "properties": {"items": {"items": {"$ref": "#/$defs/Item"}, "title": "Items", "type": "array"},
                   "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Note"}},
    "required": ["items", "note"], "title": "Order", "type": "object", "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
GOOD_CALL = {"name": "Order", "arguments": {"items": [{"sku": "a-1", "qty": 2}], "note": None}}
BAD_CALLS = [{"name": "Order", "arguments": {"items": [{"sku": "a-1", "qty": "two"}], "note": None}},
             {"name": "Order", "arguments": {"items": [{"sku": "a-1", "qty": 2, "x": 1}], "note": None}}]


def _spec(body: dict) -> GrammarSpec:
    """The facade's parse of a chat body, then the engine's conversion of its constraint."""
    plan = protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    return structured_from_proto(plan.requests[0].sampling.structured_output)


def _text(value) -> str:
    return json.dumps(value)          # the engine's separators: ", " and ": "


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Order"}}])
@pytest.mark.parametrize("tools", [[ORDER_TOOL], [TIME_TOOL, ORDER_TOOL]])
def test_tools_with_defs_compile_and_hold_calls_to_them_under_a_forced_choice(manager, tools, choice):
    spec = _spec({"tools": tools, "tool_choice": choice})
    assert spec.kind == "json_schema"
    manager.compile(spec)              # was: "Cannot find field '$defs' in #/$defs/Item"
    grammar = json_schema_grammar(spec.text, spec.strict)
    assert _is_grammar_accept_string(grammar, _text([GOOD_CALL]))
    for bad in BAD_CALLS:
        assert not _is_grammar_accept_string(grammar, _text([bad])), bad
    jsonschema.validate([GOOD_CALL], json.loads(spec.text))   # the rebased references resolve


def test_tools_with_defs_compile_under_auto(manager):
    spec = _spec({"tools": [ORDER_TOOL, TIME_TOOL], "tool_choice": "auto"})
    assert spec.kind == "triggered_tags"
    manager.compile(spec)


def _allowed_rows(manager, rid: str, drafts=()) -> list[torch.Tensor]:
    bm = manager.fill_bitmask([(_Req(rid), list(drafts))])
    return list(unpack_bitmask(bm, manager.vocab_size))


def _tok(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


SCORES = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
    "scores": {"type": "object", "additionalProperties": {"type": "integer"}}}, "required": ["scores"]}))


@pytest.mark.parametrize("spec, prefix", [
    (SCORES, '{"scores": {"a": 1, "b": 2, "'),
    (GrammarSpec("json_object"), '{"a": 1, "b": {"a": 2}, "'),
    (GrammarSpec("json_object"), '{"\\u0061": 1, "b": 2, "'),          # the same key, escaped
])
def test_a_key_already_in_the_object_cannot_be_closed_again(manager, smollm2_tokenizer, spec, prefix):
    tok = smollm2_tokenizer
    manager.compile(spec)
    manager.add("r", spec)
    try:
        assert manager.accept("r", tok.encode(prefix))
        row = _allowed_rows(manager, "r")[0]
        assert row[_tok(tok, "a")] and row[_tok(tok, "c")]        # a key may begin with a
        assert manager.accept("r", [_tok(tok, "a")])
        row = _allowed_rows(manager, "r")[0]
        closing = [i for i in range(tok.vocab_size) if tok.decode([i], False).startswith('"')]
        assert closing and not any(row[i] for i in closing)       # "a" is taken: no closing quote
        assert row[_tok(tok, "b")]                                # "ab" is still a new key
        assert manager.accept("r", [_tok(tok, "c")])
        assert any(_allowed_rows(manager, "r")[0][i] for i in closing)   # "ac" may close
    finally:
        manager.drop("r")


def test_a_drafted_row_sees_the_keys_of_the_drafts_before_it(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    manager.compile(SCORES)
    manager.add("d", SCORES)
    try:
        assert manager.accept("d", tok.encode('{"scores": {"a": 1, "'))
        quote = _tok(tok, '"')
        rows = _allowed_rows(manager, "d", drafts=[_tok(tok, "b"), quote])
        assert rows[0][_tok(tok, "a")] and rows[1][quote]          # "b" is new
        rows = _allowed_rows(manager, "d", drafts=[_tok(tok, "a")])
        assert not rows[1][quote]                                  # "a" again: cannot close
        assert manager.accept("d", [_tok(tok, "b")])               # the drafts left no trace
        assert _allowed_rows(manager, "d")[0][quote]
    finally:
        manager.drop("d")


def test_tool_arguments_in_free_text_keep_their_keys_unique(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    spec = _spec({"tools": [{"type": "function", "function": {"name": "tally", "parameters": {
        "type": "object", "additionalProperties": {"type": "integer"}}}}]})
    manager.compile(spec)
    manager.add("t", spec)
    try:
        text = 'Sure. {"a": 1} is not a call. {"name": "tally", "arguments": {"a": 1, "'
        assert manager.accept("t", tok.encode(text))
        assert manager.accept("t", [_tok(tok, "a")])
        assert not _allowed_rows(manager, "t")[0][_tok(tok, '"')]
    finally:
        manager.drop("t")


def test_the_key_lexer_follows_strings_escapes_and_nesting():
    tracker = KeyTracker()
    state, dup = tracker.feed(tracker.initial, b'{"a": "x\\"}, \\"a\\":", "b": [{"a": 1}], "c": {"b": 2}')
    assert not dup
    assert tracker.feed(state, b', "a"')[1] and tracker.feed(state, b', "b"')[1] and tracker.feed(state, b', "c"')[1]
    assert not tracker.feed(state, b', "d"')[1] and not tracker.feed(state, b', "a\\""')[1]
    tags = KeyTracker((b'{"name"',))
    state, dup = tags.feed(tags.initial, b'{"a": 1, "a": 2} then {"na')
    assert not dup and not tags.may_repeat(state)                  # free text is not JSON
    state, _ = tags.feed(state, b'me": "f", "arguments": {"k": 1}}')
    assert not tags.may_repeat(state) and state[1] == 3            # the call ended: free text again
