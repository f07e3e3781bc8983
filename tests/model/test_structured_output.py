"""Structured output on the default model (SmolLM2-135M-Instruct, in its default weight format):
what the grammar promises holds.

Proves: for every schema of the suite (``tests/helpers/schemas.py``, 32 schemas), every output
parses and validates with ``jsonschema`` (formats checked), greedy and sampled at temperature 1,
in one batch together with unconstrained requests that stay unconstrained; regex and choice
outputs match; a request ends with EOS only when its grammar is complete (finish "stop", and the
grammar's matcher accepts the text as whole); the engine keeps no matcher after a request ends;
a grammar that does not compile is refused by ``add_request`` with the parameter named and
nothing allocated; n = 2 gives each choice its own matcher; with n-gram speculative decoding
the outputs still validate, greedy and sampled, while drafts are verified; constrained requests
preempted and recomputed in a small KV pool keep their matchers where their tokens are (greedy
outputs identical to a roomy pool's, every one valid, no matcher left, every block back).
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured import GrammarSpec
from tests.helpers.schemas import SCHEMAS

pytestmark = pytest.mark.slow

ASK = "Reply with a JSON value for this JSON schema: {schema}"


@pytest.fixture(scope="module")
def llm(smollm2_default):
    return LLM(loaded=smollm2_default, max_num_seqs=64)


def _chat(schema: dict) -> list[dict]:
    return [{"role": "user", "content": ASK.format(schema=json.dumps(schema))}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_suite_outputs_always_validate(llm, temperature):
    names = list(SCHEMAS)
    # Not strict where the schema closes its objects itself: an open object lets a small model
    # add keys until max_tokens (valid JSON so far, but never finished).
    params = [SamplingParams(max_tokens=160, temperature=temperature, seed=7 if temperature else None,
                             structured=GrammarSpec("json_schema", json.dumps(SCHEMAS[n]),
                                                    strict="additionalProperties" not in json.dumps(SCHEMAS[n])))
              for n in names]
    # Unconstrained requests in the same steps: the mask must not leak into their rows.
    free = [SamplingParams(max_tokens=24, temperature=temperature, seed=3)] * 2
    messages = [_chat(SCHEMAS[n]) for n in names] + [[{"role": "user", "content": "Tell me a story."}]] * 2
    results = llm.chat(messages, params + free)
    failures = []
    for name, res in zip(names, results):
        out = res.outputs[0]
        try:
            value = json.loads(out.text)
            jsonschema.Draft202012Validator(SCHEMAS[name], format_checker=jsonschema.FormatChecker()).validate(value)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name}: {out.finish_reason} {out.text!r}: {exc}")
        if out.finish_reason != "stop":
            failures.append(f"{name}: finish_reason {out.finish_reason} {out.text!r}")
    assert not failures, "\n".join(failures)
    for res in results[len(names):]:   # the free rows are free: plain prose, not JSON
        assert res.outputs[0].text and not res.outputs[0].text.lstrip().startswith("{")
    assert not llm.engine.structured.request_ids()


def test_regex_and_choice_outputs_match(llm):
    regex = r"(Mon|Tue|Wed) [0-2][0-9]:[0-5][0-9]"
    choices = ("positive", "negative", "neutral")
    specs = [GrammarSpec("regex", regex), GrammarSpec("choice", choices=choices),
             GrammarSpec("ebnf", 'root ::= "The answer is " [0-9]+ "."')]
    prompts = ["When is the meeting?", "Sentiment of 'I love it':", "What is 6 times 7?"]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=40, temperature=temperature, seed=11, structured=s) for s in specs]
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        texts = [r.outputs[0].text for r in results]
        assert re.fullmatch(regex, texts[0]), texts
        assert texts[1] in choices, texts
        assert re.fullmatch(r"The answer is [0-9]+\.", texts[2]), texts
        assert all(r.outputs[0].finish_reason == "stop" for r in results)


def test_eos_only_when_the_grammar_is_complete(llm):
    import xgrammar as xgr

    eos = llm.tokenizer.eos_token_ids
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["array_of_objects"]))
    compiled = llm.engine.structured.compile(spec)
    results = llm.chat([_chat(SCHEMAS["array_of_objects"])] * 3,
                       [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured=spec) for s in (1, 2, 3)])
    vocab = llm.engine.model_info.vocab_size
    for res in results:
        ids = res.outputs[0].token_ids
        assert res.outputs[0].finish_reason == "stop" and ids[-1] in eos and not (set(ids[:-1]) & eos)
        json.loads(res.outputs[0].text)
        matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
        for t in ids[:-1]:   # before the closing brace, EOS was never an option
            matcher.fill_next_token_bitmask(bitmask)
            assert not any(int(bitmask[0, e // 32]) >> (e % 32) & 1 for e in eos)
            assert matcher.accept_token(t)
        assert matcher.accept_token(ids[-1]) and matcher.is_terminated()   # ... and here it was


def test_a_short_max_tokens_cuts_a_constrained_output_with_length(llm):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["person_full"]))
    out = llm.chat([_chat(SCHEMAS["person_full"])], SamplingParams(max_tokens=5, temperature=0, structured=spec))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 5
    assert not llm.engine.structured.request_ids()


def test_compile_error_is_refused_at_add_and_allocates_nothing(llm):
    core = llm.engine
    before = core.get_load()
    bad = SamplingParams(structured=GrammarSpec("regex", "(unclosed", field="guided_regex"))
    with pytest.raises(ValueError, match=r"^guided_regex: invalid regex"):
        core.add_request("bad-regex", "hello", bad)
    assert not core.is_active("bad-regex") and not core.structured.request_ids()
    assert core.get_load() == before


def test_each_choice_has_its_own_matcher(llm):
    spec = GrammarSpec("choice", choices=("apple", "banana", "cherry"))
    res = llm.chat([[{"role": "user", "content": "Name a fruit."}]],
                   SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=5, structured=spec))
    assert [o.text in spec.choices for o in res[0].outputs] == [True, True]


def test_preempted_constrained_requests_resume_where_their_matchers_are(smollm2_default, llm):
    names = ["nested_object", "ref_defs", "array_of_objects", "person_full", "flat_required", "optional_keys"]
    params = [SamplingParams(max_tokens=120, temperature=0.0,
                             structured=GrammarSpec("json_schema", json.dumps(SCHEMAS[n]), strict=True))
              for n in names]
    chats = [_chat(SCHEMAS[n]) for n in names]
    want = [r.outputs[0].token_ids for r in llm.chat(chats, params)]
    small = LLM(loaded=smollm2_default, block_size=16, max_total_tokens=384, enable_prefix_caching=False)   # 2 prompts fill it
    results = small.chat(chats, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [r.outputs[0].token_ids for r in results] == want
    for name, res in zip(names, results):
        jsonschema.validate(json.loads(res.outputs[0].text), SCHEMAS[name])
    assert not small.engine.structured.request_ids()
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_total_blocks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schemas_validate_with_speculative_decoding(smollm2_default, temperature):
    """n-gram drafts (the prompt holds the schema's JSON, so they are plentiful): drafted rows are
    masked through their drafts, a draft the grammar forbids is rejected, and the matcher ends
    where the accepted tokens end."""
    spec_llm = LLM(loaded=smollm2_default, speculative_mode="ngram", spec_draft_length=4)
    names = ["nested_object", "ref_defs", "array_of_objects", "person_full"]
    params = [SamplingParams(max_tokens=160, temperature=temperature, seed=21,
                             structured=GrammarSpec("json_schema", json.dumps(SCHEMAS[n]), strict=True))
              for n in names]
    results = spec_llm.chat([_chat(SCHEMAS[n]) for n in names], params)
    for name, res in zip(names, results):
        out = res.outputs[0]
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.Draft202012Validator(SCHEMAS[name], format_checker=jsonschema.FormatChecker()).validate(
            json.loads(out.text))
    assert sum(r.usage.draft_tokens for r in results) > 0           # drafts were verified
    assert not spec_llm.engine.structured.request_ids()


def test_logprobs_cover_the_text_and_only_tokens_the_grammar_allowed(llm):
    """OpenAI's shape: the logprob tokens join to the text (the EOS that ended the output, which
    the text leaves out, has none), and the alternatives are tokens the grammar allowed (a masked
    token's -inf is never listed)."""
    tok = llm.engine.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                              "days": {"type": "integer"}}, "required": ["city", "days"]}
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=20,
                            structured=GrammarSpec("json_schema", json.dumps(schema), strict=True))
    out = llm.chat([_chat(schema)], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert out.token_ids[-1] in tok.eos_token_ids
    ids = [lp.token_id for lp in out.logprobs]
    assert ids == out.token_ids[:-1] and tok.decode(ids) == out.text
    assert all(v > float("-inf") for lp in out.logprobs for _, v in lp.top)
    # Inside the enum's string most of the vocabulary is masked: fewer than 20 alternatives remain.
    assert min(len(lp.top) for lp in out.logprobs) < 20
