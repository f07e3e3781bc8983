"""Proves the facade's request parsing: every OpenAI parameter reaches the engine request in the
right field, bad values are refused with a 400 naming the parameter (a suffix with token
prompts among them), unsupported features are refused rather than ignored, unknown fields are
ignored, and engine error messages / gRPC codes map to the right HTTP status and param."""
from __future__ import annotations

import grpc
import pytest

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import protocol
from sluice.http_facade.errors import ApiError, from_rpc_error, param_from_details


def _chat(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def _err(fn, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body)
    assert info.value.status == 400
    return info.value


def test_chat_parameters_reach_the_engine_request():
    plan = protocol.parse_chat(_chat(
        messages=[{"role": "system", "content": "be brief", "name": "boss"},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, n=2, seed=1 << 40,
        stop="END", presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1,
        logit_bias={"42": -100, "7": 3}, logprobs=True, top_logprobs=3, stream=True,
        stream_options={"include_usage": True}, user="u1", ignore_eos=True, min_tokens=2, unknown_field={"x": 1}))
    (req,) = plan.requests
    sp = req.sampling
    assert [m.role for m in req.chat.messages] == [pb.ROLE_SYSTEM, pb.ROLE_USER]
    assert req.chat.messages[0].name == "boss" and req.chat.messages[1].content == "ab"
    assert sp.max_tokens == 7 and not sp.max_tokens_unlimited       # max_completion_tokens wins
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.n, sp.seed) == (0.5, 0.9, 5, 0.1, 2, 1 << 40)
    assert list(sp.stop) == ["END"] and dict(sp.logit_bias) == {42: -100.0, 7: 3.0}
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.1, 0.2, 1.1)
    assert sp.logprobs and sp.top_logprobs == 3 and sp.ignore_eos and sp.min_tokens == 2
    assert plan.stream and plan.include_usage and plan.n == 2 and plan.user == "u1"


def test_chat_without_max_tokens_is_unlimited_and_completions_default_to_16():
    assert protocol.parse_chat(_chat()).requests[0].sampling.max_tokens_unlimited
    assert protocol.parse_chat(_chat(), default_max_tokens=48).requests[0].sampling.max_tokens == 48
    sp = protocol.parse_completion({"model": "m", "prompt": "x"}).requests[0].sampling
    assert sp.max_tokens == 16 and not sp.HasField("temperature")


@pytest.mark.parametrize("prompt, kinds", [
    ("abc", ["text"]),
    (["a", "b"], ["text", "text"]),
    ([1, 2, 3], ["token_ids"]),
    ([[1, 2], [3]], ["token_ids", "token_ids"]),
])
def test_completion_prompt_shapes(prompt, kinds):
    plan = protocol.parse_completion({"model": "m", "prompt": prompt, "logprobs": 2, "n": 3})
    assert [r.WhichOneof("input") for r in plan.requests] == kinds
    assert all(r.sampling.logprobs and r.sampling.top_logprobs == 2 and r.sampling.n == 3 for r in plan.requests)


@pytest.mark.parametrize("body, param", [
    (_chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice=3), "tool_choice"),
    (_chat(tools=[{"type": "function", "function": {"name": ""}}], tool_choice="required"), "tools[0].function.name"),
    (_chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                          "function": {"name": "g"}}), "tool_choice"),
    (_chat(functions=[{"name": "f"}]), "functions"),
    (_chat(tool_choice="auto"), "tool_choice"),
    (_chat(response_format={"type": "yaml"}), "response_format"),
    (_chat(temperature="hot"), "temperature"),
    (_chat(n=1.5), "n"),
    (_chat(stop=[1]), "stop"),
    (_chat(logit_bias={"abc": 1}), "logit_bias"),
    (_chat(top_logprobs=2), "top_logprobs"),
    (_chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(stream_options={"include_usage": True}), "stream_options"),
    (_chat(messages=[]), "messages"),
    (_chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0]"),
    (_chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
    (_chat(messages=[{"role": "user", "content": "x", "tool_calls": [{}]}]), "messages[0].tool_calls"),
    (_chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]),
     "messages[0].tool_calls[0].function.name"),
    (_chat(messages=[{"role": "assistant", "tool_calls": [{"type": "custom", "function": {"name": "f"}}]}]),
     "messages[0].tool_calls[0].type"),
    (_chat(messages=[{"role": "assistant", "tool_calls": ["f()"]}]), "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_chat_bad_parameters_name_the_parameter(body, param):
    assert _err(protocol.parse_chat, body).param == param


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [[1], []]}, "prompt[1]"),
    ({"model": "m", "prompt": "x", "suffix": 5}, "suffix"),
    ({"model": "m", "prompt": "", "suffix": ""}, "suffix"),
    ({"model": "m", "prompt": [1, 2], "suffix": "y"}, "prompt"),
    ({"model": "m", "prompt": ["a", [1]], "suffix": "y"}, "prompt"),
    ({"model": "m", "prompt": [[1], [2]], "suffix": "y"}, "prompt[0]"),
    ({"model": "m", "prompt": "x", "suffix": "y", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
])
def test_completion_bad_parameters_name_the_parameter(body, param):
    assert _err(protocol.parse_completion, body).param == param


def test_suffix_makes_infill_requests():
    plan = protocol.parse_completion({"model": "m", "prompt": ["def f(", "x = "], "suffix": "\n", "max_tokens": 4})
    assert [(r.infill.prefix, r.infill.suffix) for r in plan.requests] == [("def f(", "\n"), ("x = ", "\n")]
    assert all(r.sampling.max_tokens == 4 for r in plan.requests)


def test_assistant_tool_calls_reach_the_engine_as_typed_calls():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]
    plan = protocol.parse_chat(_chat(messages=[
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]))
    (req,) = plan.requests
    got = req.chat.messages[1].tool_calls
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in got] == [
        ("call_1", pb.TOOL_TYPE_FUNCTION, "weather", '{"city": "Oslo"}'),
        ("call_2", pb.TOOL_TYPE_FUNCTION, "time", "{}")]
    assert req.chat.messages[2].tool_call_id == "call_1" and not req.chat.messages[2].tool_calls


def test_tool_choice_none_and_text_response_format_are_accepted():
    plan = protocol.parse_chat(_chat(tool_choice="none", response_format={"type": "text"}, tools=[]))
    assert plan.kind == "chat"


def test_malformed_json_is_a_400():
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(ApiError) as info:
            protocol.parse_json(raw)
        assert info.value.status == 400


@pytest.mark.parametrize("details, param", [
    ("sampling.top_p: must be in (0, 1], got 2.0", "top_p"),
    ("sampling.max_tokens_unlimited: conflicts", "max_tokens"),
    ("chat.messages[1].role: must be system", "messages[1].role"),
    ("token_ids: token id 99999 is outside the vocabulary", "prompt"),
    ("something went wrong", None),
])
def test_engine_field_paths_become_openai_params(details, param):
    assert param_from_details(details) == param


class _FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code, status, err_code", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, None),
    (grpc.StatusCode.OUT_OF_RANGE, 400, "context_length_exceeded"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "queue_full"),
    (grpc.StatusCode.UNAVAILABLE, 503, "engine_unavailable"),
    (grpc.StatusCode.INTERNAL, 500, "internal_error"),
])
def test_grpc_codes_map_to_http(code, status, err_code):
    err = from_rpc_error(_FakeRpcError(code, "sampling.n: bad"))
    assert (err.status, err.code) == (status, err_code)
    assert "Traceback" not in err.message
    if status == 429:
        assert err.headers["Retry-After"] == "1"
