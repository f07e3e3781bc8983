"""AFS request validation and function-call handling without a server: the parameter defaults
and ranges of the seed (each violation is a 422 naming the parameter), ``seed: null`` = random,
``stop`` as a synonym of ``stop_sequences``, the role mapping (human → user, function → a tool
result), the function prompt in the system message, ``<FILL_ME>`` counting, and the parser that
finds a JSON function call in a model's answer. The rules are the models of ``api_models`` (what
/openapi.json shows): a violation's message is the field's documented description."""
from __future__ import annotations

import json

import pytest

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import afs_functions as af
from sluice.http_facade import afs_protocol as ap
from sluice.http_facade import api_models as am
from sluice.http_facade.errors import ApiError

WEATHER = {"name": "get_current_weather", "description": "Get the current weather in a given location",
           "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                          "required": ["location"]}}


def _conv(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "human", "content": "hi"}], **kw}


def test_defaults_are_the_seeds():
    sp = ap.parse_generate({"model": "m", "inputs": "x"}).request.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.seed) == \
        (350, 1.0, 1.0, 50, 1.0, 42)
    assert not sp.logprobs and list(sp.stop) == [] and not sp.include_stop_str_in_output
    # null takes the default, except seed: null = random (no seed sent)
    params = {"max_new_tokens": None, "temperature": None, "seed": None}
    sp = ap.parse_generate({"model": "m", "inputs": "x", "parameters": params}).request.sampling
    assert sp.max_tokens == 350 and sp.temperature == 1.0 and not sp.HasField("seed")


def test_parameters_are_passed_on():
    params = {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.93, "top_k": 100, "frequence_penalty": 1.03,
              "stop_sequences": ["a", "b"], "show_probabilities": True, "seed": 0}
    sp = ap.parse_generate({"model": "m", "inputs": "x", "parameters": params}).request.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (7, 0.5, 0.93, 100, 0)
    assert sp.repetition_penalty == pytest.approx(1.03) and list(sp.stop) == ["a", "b"] and sp.logprobs
    langchain = ap.parse_generate({"model": "m", "inputs": "x", "parameters": {"stop": ["END"]}})
    assert list(langchain.request.sampling.stop) == ["END"]


@pytest.mark.parametrize("name, value", [
    ("max_new_tokens", 0), ("max_new_tokens", 1.5), ("max_new_tokens", True), ("max_new_tokens", "9"),
    ("temperature", 0), ("temperature", -0.1), ("temperature", "hot"),
    ("top_p", 0), ("top_p", 1.01),
    ("top_k", 0), ("top_k", 101), ("top_k", 2.5),
    ("frequence_penalty", 0), ("frequence_penalty", -1),
    ("stop_sequences", ["a", "b", "c", "d", "e"]), ("stop_sequences", [1]), ("stop_sequences", [""]),
    ("show_probabilities", "yes"), ("seed", -1), ("seed", 1.5), ("seed", "42"),
])
def test_range_violations_are_422_naming_the_parameter(name, value):
    with pytest.raises(ApiError) as info:
        ap.parse_params({"parameters": {name: value}})
    assert info.value.status == 422 and info.value.param == name and info.value.message.startswith(name)


@pytest.mark.parametrize("model, body, param, value", [
    (am.AfsParameters, {"parameters": {"top_k": 101}}, "top_k", 101),
    (am.AfsParameters, {"parameters": {"top_p": 0}}, "top_p", 0),
    (am.AfsParameters, {"parameters": {"seed": "42"}}, "seed", "42"),
    (am.AfsGenerateRequest, {"model": "m", "inputs": ""}, "inputs", ""),
    (am.AfsMessage, _conv(messages=[{"role": "robot", "content": "x"}]), "role", "robot"),
    (am.AfsRerankParameters, {"model": "m", "query": "q", "documents": ["d"], "parameters": {"top_n": 0}}, "top_n", 0),
    (am.AfsEmbedParameters, {"model": "m", "input": "x", "parameters": {"normalize": "no"}}, "normalize", "no"),
])
def test_a_violation_says_what_the_model_documents(model, body, param, value):
    request = (am.AfsRerankRequest if "query" in body else am.AfsEmbeddingsRequest if "input" in body
               else am.AfsConversationRequest if "messages" in body else am.AfsGenerateRequest)
    with pytest.raises(ApiError) as info:
        ap.check(request, {"model": "m", "inputs": "x", **body} if request is am.AfsGenerateRequest else body)
    wanted = model.model_fields[param].description
    assert info.value.status == 422 and info.value.message == f"{info.value.param}: must be {wanted}, got {value!r}"
    assert info.value.param.endswith(param)


def test_null_takes_the_default_except_for_seed():
    gen = ap.parse_generate({"model": "m", "inputs": "x", "stream": None,
                             "parameters": {"temperature": None, "top_k": None, "seed": None}})
    sp = gen.request.sampling
    assert not gen.stream and sp.temperature == 1.0 and sp.top_k == 50 and not sp.HasField("seed")
    assert ap.parse_generate({"model": "m", "inputs": "x"}).request.sampling.seed == 42


def test_request_shape_errors():
    cases = [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
             ({"messages": [{"role": "human", "content": 3}]}, "messages[0].content"),
             ({"messages": [{"role": "function", "content": "{}"}]}, "messages[0].name"),
             ({"parameters": [1]}, "parameters"), ({"stream": "yes"}, "stream"),
             ({"functions": [{"description": "no name"}]}, "functions[0].name"),
             ({"functions": [WEATHER, WEATHER]}, "functions[1].name")]
    for patch, param in cases:
        with pytest.raises(ApiError) as info:
            ap.parse_conversation({**_conv(), **patch})
        assert info.value.status == 422 and info.value.param == param, (patch, info.value)
    with pytest.raises(ApiError) as info:
        ap.parse_conversation({"messages": [{"role": "human", "content": "x"}]})
    assert info.value.param == "model"


def test_roles_and_function_history():
    body = {"model": "m", "functions": [WEATHER], "messages": [
        {"role": "user", "content": "What is the weather like in Boston?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_current_weather", "arguments": {"location": "Boston, MA"}}},
        {"role": "function", "name": "get_current_weather", "content": "{\"temperature\": \"22\"}"},
        {"role": "human", "content": "thanks"}]}
    msgs = list(ap.parse_conversation(body).request.chat.messages)
    assert [m.role for m in msgs] == [pb.ROLE_SYSTEM, pb.ROLE_USER, pb.ROLE_ASSISTANT, pb.ROLE_TOOL, pb.ROLE_USER]
    assert msgs[0].content == af.function_prompt(af.parse_functions([WEATHER]))
    assert json.loads(msgs[0].content.splitlines()[1]) == WEATHER
    assert json.loads(msgs[2].content) == {"name": "get_current_weather", "arguments": {"location": "Boston, MA"}}
    assert msgs[3].name == "get_current_weather" and msgs[3].content == "{\"temperature\": \"22\"}"
    # an existing system message keeps its text, the functions come after it
    with_system = ap.parse_conversation({**body, "messages": [{"role": "system", "content": "Be brief."},
                                                              *body["messages"]]})
    first = with_system.request.chat.messages[0].content
    assert first.startswith("Be brief.\n\n") and "get_current_weather" in first
    plain = ap.parse_conversation(_conv())
    assert [m.role for m in plain.request.chat.messages] == [pb.ROLE_USER] and plain.functions == ()


def test_functions_constrain_the_call_the_model_starts():
    gen = ap.parse_conversation({**_conv(), "functions": [WEATHER]})
    so = gen.request.sampling.structured_output
    assert so.param == "functions" and so.WhichOneof("constraint") == "triggered_tags"
    tags = so.triggered_tags
    assert list(tags.triggers) == ['{"name"'] and tags.stop_after_first     # one call, then the answer ends
    assert [t.begin for t in tags.tags] == ['{"name": "get_current_weather", "arguments": ']
    assert json.loads(tags.tags[0].schema_json) == WEATHER["parameters"] and tags.tags[0].end == "}"
    assert not ap.parse_conversation(_conv()).request.sampling.HasField("structured_output")


def test_fill_me_must_appear_once():
    assert ap.split_fill_me("def f():\n<FILL_ME>\n    return 1\n") == ("def f():\n", "\n    return 1\n")
    for text, count in (("no marker", 0), ("<FILL_ME> and <FILL_ME>", 2)):
        with pytest.raises(ApiError) as info:
            ap.split_fill_me(text)
        assert info.value.status == 400 and info.value.param == "inputs" and f"found {count}" in info.value.message


@pytest.mark.parametrize("answer, args, rest", [
    ('{"name": "get_current_weather", "arguments": {"location": "Boston, MA"}}', {"location": "Boston, MA"}, ""),
    ('```json\n{"name": "get_current_weather", "arguments": "{\\"location\\": \\"Paris\\"}"}\n```',
     {"location": "Paris"}, ""),
    ('Sure! {"function_call": {"name": "get_current_weather", "parameters": {"location": "Oslo"}}}',
     {"location": "Oslo"}, "Sure!"),
    ('{"a": 1} then {"name": "get_current_weather"}', {}, '{"a": 1} then'),
])
def test_find_call(answer, args, rest):
    call = af.find_call(answer, af.parse_functions([WEATHER]))
    assert call is not None and call.name == "get_current_weather" and call.arguments == args and call.text == rest


@pytest.mark.parametrize("answer", [
    "It is sunny in Boston.", '{"name": "other_function", "arguments": {}}',
    '{"name": "get_current_weather", "arguments": [1, 2]}', '{"name": "get_current_weather", "arguments": {',
])
def test_no_call_is_an_ordinary_answer(answer):
    assert af.find_call(answer, af.parse_functions([WEATHER])) is None
