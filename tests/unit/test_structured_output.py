"""Structured output's engine mechanism, without a model: SmolLM2's tokenizer and xgrammar.

Proves: the bitmask stage forbids exactly the tokens whose bit is clear (odd vocabulary sizes,
all-ones rows untouched) and the sampler applies it after penalties and the min_tokens mask;
our tokenizer's token bytes spell every text back; each constraint kind compiles, and a bad
schema, regex or grammar is a ``ValueError`` naming the parameter; the compile cache returns
the same grammar for an equal spec; a grammar slower than the limit is refused in time and its
compile goes on without holding up another one; EOS is allowed exactly when the grammar can end;
a drafted request's rows see the matcher advanced through its drafts, and the matcher is rolled
back afterwards; a token the grammar rejects is reported; ``SamplingParams`` refuses a grammar
with min_tokens or ignore_eos.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
import torch

from sluice.engine.request import Request
from sluice.engine.sampler import SamplingBatch, penalize
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured import GrammarSpec, StructuredOutputConfig
from sluice.engine.structured.spec import Tag, triggered_tags_text
from sluice.engine.structured.bitmask import apply_bitmask, bitmask_words, unpack_bitmask
from sluice.engine.structured.manager import StructuredOutputManager
from sluice.engine.structured.vocab import token_bytes

# A regex whose compile takes seconds on SmolLM2's vocabulary (119 alternatives of counted runs:
# 6.8 s here on 2026-12-04; 59 took 1.6 s, under the model test's 2 s limit).
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x[0-9]{{{i % 7}}}" for i in range(1, 120)) + ")"


@dataclass
class _Req:
    request_id: str


@pytest.fixture(scope="module")
def manager(smollm2_tokenizer):
    m = StructuredOutputManager(smollm2_tokenizer, smollm2_tokenizer.vocab_size)
    yield m
    m.close()


def _allowed(manager, request_id: str, tok, drafts=()) -> list[set[int]]:
    bm = manager.fill_bitmask([(_Req(request_id), list(drafts))])
    return [set(torch.nonzero(row).flatten().tolist()) for row in unpack_bitmask(bm, tok.vocab_size)]


# ---- the stage ----------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 70, 49152, 49155])   # the last two: xgrammar's CPU loop
def test_bitmask_forbids_exactly_the_cleared_bits(vocab):
    gen = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(3, vocab, generator=gen) < 0.5                  # [3, V]
    allowed[2] = True
    padded = torch.zeros(3, bitmask_words(vocab) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.reshape(3, -1, 32) << torch.arange(32)).sum(-1)      # bit t % 32 of word t // 32
    bitmask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    bitmask[2] = -1                                                      # an unconstrained row
    logits = torch.randn(3, vocab, generator=gen)
    out = apply_bitmask(logits, bitmask)
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)
    assert torch.equal(out[allowed], logits[allowed])
    assert torch.isneginf(out[~allowed]).all()


def test_bitmask_shape_is_checked():
    with pytest.raises(ValueError, match=r"bitmask: expected int32 of shape \(B, 2\)"):
        apply_bitmask(torch.zeros(1, 40), torch.zeros(1, 1, dtype=torch.int32))


def test_sampler_applies_the_grammar_after_bias_and_min_tokens():
    vocab = 40
    req = Request("r", [1, 2], SamplingParams(temperature=0, logit_bias={5: 50.0}), eos_token_ids=frozenset({0}))
    bitmask = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    bitmask[0, 0] = (1 << 7) | (1 << 9)                                  # tokens 7 and 9 only
    batch = SamplingBatch.from_requests([req], vocab, "cpu", grammar_bitmask=bitmask)
    logits = torch.zeros(1, vocab)
    logits[0, 9] = 1.0
    out = penalize(logits, batch)
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == {7, 9}
    assert out[0].argmax().item() == 9                                   # the biased 5 is forbidden


# ---- vocabulary ---------------------------------------------------------------------------------
def test_token_bytes_spell_texts_back(smollm2_tokenizer):
    tok = smollm2_tokenizer
    table = token_bytes(tok, tok.vocab_size + 7)                         # padded ids are empty
    assert table[-7:] == [b""] * 7
    assert table[tok.eos_token_id] == b""                                # special: never grammar text
    for text in ["Hello, world!", " {\"a\": [1, 2.5e-3]}\n", "naïve café ☕ 日本語", "\t  x\r\n"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode("utf-8")


# ---- compiling ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [
    GrammarSpec("json_object"),
    GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}), strict=True),
    GrammarSpec("json_schema", json.dumps({"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3})),
    GrammarSpec("regex", r"\d{3}-[a-z]+"),
    GrammarSpec("choice", choices=("yes", "no", 'say "hi"\n')),
    GrammarSpec("ebnf", 'root ::= "a" root | "b"'),
    GrammarSpec("triggered_tags", triggered_tags_text(['{"name"'], [
        Tag('{"name": "f", "arguments": ', '{"type": "object", "properties": {"x": {"type": "integer"}}}', "}")],
        False)),
], ids=lambda s: s.kind)
def test_every_kind_compiles_and_is_cached(manager, spec):
    first = manager.compile(spec)
    assert manager.compile(GrammarSpec(spec.kind, spec.text, spec.choices, spec.strict)) is first


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", '{"type": "frobnicate"}', field="response_format"),
     r"^response_format: invalid JSON schema: .*frobnicate"),
    (GrammarSpec("regex", "[a-", field="guided_regex"), r"^guided_regex: invalid regex: .*Unclosed"),
    (GrammarSpec("ebnf", "root ::= ", field="guided_grammar"), r"^guided_grammar: invalid grammar: "),
    (GrammarSpec("ebnf", 'start ::= "a"', field="guided_grammar"), r"^guided_grammar: invalid grammar: .*root"),
])
def test_compile_errors_name_the_parameter(manager, spec, message):
    with pytest.raises(ValueError, match=message):
        manager.compile(spec)
    with pytest.raises(ValueError, match=message):   # the cached error says the same
        manager.compile(spec)


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "yaml"}, r"^structured_output: kind must be one of"),
    ({"kind": "regex"}, r"^structured_output: the regex must not be empty"),
    ({"kind": "json_schema", "text": "{not json", "field": "response_format"},
     r"^response_format: the JSON schema is not valid JSON"),
    ({"kind": "json_schema", "text": "[1]"}, r"^structured_output: a JSON schema must be an object"),
    ({"kind": "json_schema", "text": '{"minimum": NaN}'}, r"the JSON schema is not valid JSON"),
    ({"kind": "json_schema", "text": '{"type": "array", "uniqueItems": true}', "field": "response_format"},
     r"^response_format: JSON Schema keyword 'uniqueItems' at / is not supported"),
    ({"kind": "json_schema", "text": '{"properties": {"a": {"items": {"not": {"type": "string"}}}}}'},
     r"keyword 'not' at /properties/a/items is not supported"),
    ({"kind": "json_schema", "text": '{"$defs": {"x": {"if": {}, "then": {}}}}'}, r"'if' at /\$defs/x"),
    ({"kind": "json_schema", "text": '{"allOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]}'},
     r"'allOf' at / is not supported: its schemas overlap on type"),
    ({"kind": "json_schema", "text": '{"type": "string", "format": "email", "maxLength": 9}'},
     r"'maxLength' at / is not supported: together with 'format'"),
    ({"kind": "choice"}, r"^structured_output: needs at least one choice"),
    ({"kind": "choice", "choices": ("a", "")}, r"every choice must be a non-empty string"),
])
def test_bad_specs_are_refused_before_compiling(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GrammarSpec(**kwargs)


def test_keywords_named_like_unsupported_ones_are_fine_as_property_names():
    GrammarSpec("json_schema", '{"type": "object", "properties": {"not": {"type": "integer"}, '
                               '"contains": {"type": "string"}}, "required": ["not"]}')


def test_sampling_params_refuse_a_grammar_with_min_tokens_or_ignore_eos():
    spec = GrammarSpec("json_object", field="response_format")
    with pytest.raises(ValueError, match=r"^min_tokens: cannot be combined with response_format"):
        SamplingParams(min_tokens=3, structured=spec)
    with pytest.raises(ValueError, match=r"^ignore_eos: cannot be combined with response_format"):
        SamplingParams(ignore_eos=True, structured=spec)
    with pytest.raises(ValueError, match=r"^structured: must be a GrammarSpec"):
        SamplingParams(structured={"type": "json_object"})


def test_grammar_size_is_capped(smollm2_tokenizer):
    m = StructuredOutputManager(smollm2_tokenizer, smollm2_tokenizer.vocab_size,
                                StructuredOutputConfig(max_grammar_chars=10))
    with pytest.raises(ValueError, match=r"^guided_regex: 11 characters of grammar exceed the limit of 10"):
        m.compile(GrammarSpec("regex", "a" * 11, field="guided_regex"))
    m.close()


def test_a_slow_grammar_times_out_without_holding_up_another(smollm2_tokenizer):
    m = StructuredOutputManager(smollm2_tokenizer, smollm2_tokenizer.vocab_size,
                                StructuredOutputConfig(compile_timeout_s=0.3, compile_workers=2))
    m.warm_up().result()                                                # the tokenizer info, once
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^guided_regex: the grammar did not compile within 0.3 s"):
        m.compile(GrammarSpec("regex", SLOW_REGEX, field="guided_regex"))
    assert time.monotonic() - t0 < 3.0   # refused near the limit, not after the compile (seconds)
    m.compile(GrammarSpec("regex", r"[0-9]+"))                          # the other worker is free
    m.close()


# ---- matchers -----------------------------------------------------------------------------------
def test_eos_is_allowed_exactly_when_the_grammar_can_end(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    eos = tok.eos_token_id
    manager.add("eos", GrammarSpec("regex", "ab+"))
    a, b = tok.encode("a", add_special_tokens=False), tok.encode("b", add_special_tokens=False)
    assert eos not in _allowed(manager, "eos", tok)[0]
    assert manager.accept("eos", a)
    assert eos not in _allowed(manager, "eos", tok)[0]                   # "a" is not yet "ab+"
    assert manager.accept("eos", b)
    after_ab = _allowed(manager, "eos", tok)[0]
    assert eos in after_ab and b[0] in after_ab
    assert manager.accept("eos", [eos]) and manager.is_finished("eos")
    manager.drop("eos")

    manager.add("done", GrammarSpec("choice", choices=("yes",)))
    assert manager.accept("done", tok.encode("yes", add_special_tokens=False))
    assert _allowed(manager, "done", tok)[0] == {eos}                    # complete: only the end
    manager.drop("done")


CALLS = GrammarSpec("triggered_tags", triggered_tags_text(['{"name"'], [
    Tag('{"name": "get_weather", "arguments": ', json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}), "}"),
    Tag('{"name": "get_time", "arguments": ', '{"type": "object"}', "}")], False), field="tools")


@pytest.mark.parametrize("text, accepted, can_end", [
    ("No tool is needed: it is sunny.", True, True),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', True, True),
    ('Both: [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     True, True),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True, True),
    ('[{"name": "get_weather", "arguments": {"town": "Paris"}}]', False, False),   # not its schema
    ('[{"name": "get_wind", "arguments": {}}]', False, False),                       # not a tool
    ('[{"name":"get_time", "arguments": {}}]', False, False),                        # after the trigger: exact
    ('[{"name": "get_weather", "arguments": {"city": "Pa', True, False),              # inside a call: no end
])
def test_triggered_tags_leave_text_free_and_constrain_each_call(manager, smollm2_tokenizer, text, accepted, can_end):
    tok = smollm2_tokenizer
    manager.add("t", CALLS)
    try:
        ids = tok.encode(text, add_special_tokens=False)
        ok = all(manager.accept("t", [i]) for i in ids)
        assert ok == accepted
        if ok:
            assert (tok.eos_token_id in _allowed(manager, "t", tok)[0]) == can_end
    finally:
        manager.drop("t")


@pytest.mark.parametrize("triggers, tags, message", [
    ([], [Tag("a", "{}", "b")], "at least one trigger and one tag"),
    (["{"], [Tag("x", "{}", "}")], r"tags\[0\].begin 'x' must start with exactly one trigger"),
    (["{", '{"'], [Tag('{"n', "{}", "}")], "exactly one trigger, it starts with 2"),
    (["{", "<"], [Tag("{", "{}", "}")], "trigger '<' begins no tag"),
    (["{"], [Tag("{", '{"type": "array", "uniqueItems": true}', "}")], r"tools.tags\[0\]: JSON Schema keyword"),
])
def test_bad_triggered_tags_are_refused_naming_the_parameter(triggers, tags, message):
    with pytest.raises(ValueError, match=message):
        GrammarSpec("triggered_tags", triggered_tags_text(triggers, tags, False), field="tools")


def test_rejected_token_is_reported_and_the_matcher_stays(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    manager.add("r", GrammarSpec("choice", choices=("yes", "no")))
    before = _allowed(manager, "r", tok)[0]
    assert not manager.accept("r", tok.encode("maybe", add_special_tokens=False))
    assert _allowed(manager, "r", tok)[0] == before
    manager.drop("r")
    assert not manager.is_constrained("r")
    assert manager.accept("r", [1, 2, 3])                                # unconstrained: anything


def test_drafted_rows_follow_the_drafts_and_roll_back(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    eos = tok.eos_token_id
    manager.add("d", GrammarSpec("choice", choices=("yes", "no")))
    yes = tok.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    first = _allowed(manager, "d", tok)[0]
    rows = _allowed(manager, "d", tok, drafts=[yes[0], eos])
    assert rows[0] == first and yes[0] in first
    assert rows[1] == {eos}
    assert len(rows[2]) == tok.vocab_size           # past the end: never sampled, left open
    assert _allowed(manager, "d", tok)[0] == first  # rolled back
    # A draft the grammar rejects: its own row forbids it, the rows after it stay open.
    bad = tok.encode("maybe", add_special_tokens=False)[0]
    rows = _allowed(manager, "d", tok, drafts=[bad, yes[0]])
    assert bad not in rows[0] and len(rows[1]) == len(rows[2]) == tok.vocab_size
    assert _allowed(manager, "d", tok)[0] == first
    manager.drop("d")


def test_unconstrained_rows_are_all_ones_and_no_grammar_means_no_mask(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert manager.fill_bitmask([(_Req("free"), [])]) is None
    manager.add("c", GrammarSpec("regex", "[0-9]"))
    bm = manager.fill_bitmask([(_Req("free"), [5, 6]), (_Req("c"), [])])
    assert bm.shape == (4, bitmask_words(tok.vocab_size)) and (bm[:3] == -1).all()
    assert not (bm[3] == -1).all()
    manager.drop("c")


def test_bounded_json_strings_refuse_control_characters(manager, smollm2_tokenizer):
    """xgrammar 0.2 lets a string with maxLength hold raw control characters, which JSON forbids
    (json.loads refused a sampled {"name": "...\\x01..."}): the manager's grammar does not."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    spec = GrammarSpec("json_schema", json.dumps(schema), strict=True)
    control = next(i for i, b in enumerate(token_bytes(smollm2_tokenizer, smollm2_tokenizer.vocab_size))
                   if b == b"\x01")
    m = xgr.GrammarMatcher(manager.compile(spec))
    assert m.accept_string('{"name": "Ann')
    assert not m.accept_token(control)
    assert m.accept_string(' Lee", "age": 30}')                     # the rest still follows
    # Unbounded strings were right already; the text left unchanged there.
    plain = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"s": {"type": "string"}}}))
    m = xgr.GrammarMatcher(manager.compile(plain))
    assert m.accept_string('{"s": "a') and not m.accept_token(control)
