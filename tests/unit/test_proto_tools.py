"""Tools and tool calls travel as typed messages (ToolDefinition, ToolCall) and reach the chat
template in the OpenAI shape the client wrote: the client SDK builds the messages from
OpenAI-shaped dicts, the servicer's conversion turns them back into the same dicts (the JSON
Schema with its integers and key order intact), and bad input names the field on either side."""
from __future__ import annotations

import json

import pytest

from sluice.engine.chat_template import render_chat_template
from sluice.engine.client import chat_input
from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc.convert import chat_from_proto

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    # properties deliberately not in alphabetical order; integers that a Struct would make floats
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                    "city": {"type": "string", "maxLength": 64}},
                   "required": ["city"], "minProperties": 1}}}
BARE = {"type": "function", "function": {"name": "now"}}
CALL = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
CHAT = [{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "rain, 4 C", "tool_call_id": "call_7"}]


def _wire(msg: pb.ChatInput) -> pb.ChatInput:
    """What the servicer receives: the message after serialisation."""
    return pb.ChatInput.FromString(msg.SerializeToString())


def test_client_dicts_come_back_to_the_template_unchanged() -> None:
    messages, tools, add_gen = chat_from_proto(_wire(chat_input(CHAT, tools=[WEATHER, BARE])))
    assert tools == [WEATHER, BARE]
    # same key order, and 64 / 1 are still ints: the prompt the model reads is what the client wrote
    assert json.dumps(tools[0]) == json.dumps(WEATHER)
    assert messages[1]["tool_calls"] == [CALL] and messages[2]["tool_call_id"] == "call_7"
    assert "tool_calls" not in messages[0] and "tool_calls" not in messages[2] and add_gen is True


def test_typed_fields_on_the_wire() -> None:
    msg = chat_input(CHAT, tools=[WEATHER, BARE])
    weather, bare = msg.tools
    assert weather.type == pb.TOOL_TYPE_FUNCTION and weather.function.name == "get_weather"
    assert weather.function.description == "Current weather in a city"
    assert json.loads(weather.function.parameters_json) == WEATHER["function"]["parameters"]
    assert not bare.function.HasField("description") and not bare.function.HasField("parameters_json")
    (call,) = msg.messages[1].tool_calls
    assert (call.id, call.type, call.function.name, call.function.arguments) == (
        "call_7", pb.TOOL_TYPE_FUNCTION, "get_weather", '{"city": "Oslo"}')


def test_no_tools_is_none_for_the_template() -> None:
    _, tools, _ = chat_from_proto(_wire(chat_input(CHAT[:1])))
    assert tools is None


def test_unspecified_tool_type_is_function() -> None:
    raw = pb.ChatInput(messages=[pb.ChatMessage(role=pb.ROLE_USER, content="hi")],
                       tools=[pb.ToolDefinition(function=pb.FunctionDefinition(name="f"))])
    _, tools, _ = chat_from_proto(raw)
    assert tools == [{"type": "function", "function": {"name": "f"}}]


def test_tools_reach_a_template_that_renders_them() -> None:
    template = "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}:" \
               "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments }})]{% endfor %}" \
               "{{ m.content }}\n{% endfor %}"
    messages, tools, add_gen = chat_from_proto(_wire(chat_input(CHAT, tools=[WEATHER])))
    text = render_chat_template(template, messages, tools=tools, add_generation_prompt=add_gen)
    assert text.splitlines() == [
        "TOOLS:" + json.dumps([WEATHER], ensure_ascii=False), "user:Weather in Oslo?",
        'assistant:[get_weather({"city": "Oslo"})]', "tool:rain, 4 C"]


def _engine_error(raw: pb.ChatInput) -> str:
    with pytest.raises(ValueError) as info:
        chat_from_proto(raw)
    return str(info.value)


def _with_tool(tool: pb.ToolDefinition) -> pb.ChatInput:
    return pb.ChatInput(messages=[pb.ChatMessage(role=pb.ROLE_USER, content="hi")], tools=[BARE_PB, tool])


BARE_PB = pb.ToolDefinition(type=pb.TOOL_TYPE_FUNCTION, function=pb.FunctionDefinition(name="now"))


@pytest.mark.parametrize("tool, message", [
    (pb.ToolDefinition(), "chat.tools[1].function.name: must not be empty"),
    (pb.ToolDefinition(type=7, function=pb.FunctionDefinition(name="f")),
     "chat.tools[1].type: must be TOOL_TYPE_FUNCTION, got 7"),
    (pb.ToolDefinition(function=pb.FunctionDefinition(name="f", parameters_json="{")),
     "chat.tools[1].function.parameters_json: not valid JSON"),
    (pb.ToolDefinition(function=pb.FunctionDefinition(name="f", parameters_json="[1, 2]")),
     "chat.tools[1].function.parameters_json: must be a JSON object (a JSON Schema), got list"),
])
def test_engine_refuses_bad_tools_naming_the_field(tool: pb.ToolDefinition, message: str) -> None:
    assert _engine_error(_with_tool(tool)).startswith(message)


@pytest.mark.parametrize("call, message", [
    (pb.ToolCall(id="c"), "chat.messages[1].tool_calls[0].function.name: must not be empty"),
    (pb.ToolCall(type=9, function=pb.FunctionCall(name="f")),
     "chat.messages[1].tool_calls[0].type: must be TOOL_TYPE_FUNCTION, got 9"),
])
def test_engine_refuses_bad_tool_calls_naming_the_field(call: pb.ToolCall, message: str) -> None:
    raw = pb.ChatInput(messages=[pb.ChatMessage(role=pb.ROLE_USER, content="hi"),
                                 pb.ChatMessage(role=pb.ROLE_ASSISTANT, tool_calls=[call])])
    assert _engine_error(raw) == message


def test_arguments_are_kept_as_the_model_wrote_them() -> None:
    """Arguments need not parse (a model's output may not): the engine passes the text on."""
    call = pb.ToolCall(id="c", function=pb.FunctionCall(name="f", arguments='{"city": "Os'))
    raw = pb.ChatInput(messages=[pb.ChatMessage(role=pb.ROLE_ASSISTANT, tool_calls=[call])])
    messages, _, _ = chat_from_proto(raw)
    assert messages[0]["tool_calls"] == [{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": '{"city": "Os'}}]


@pytest.mark.parametrize("tools, messages, message", [
    ([{"type": "retrieval"}], CHAT[:1], "tools[0].type: must be 'function', got 'retrieval'"),
    ([{"type": "function"}], CHAT[:1], "tools[0].function: must be an object (a dict), got NoneType"),
    ([{"function": {"name": ""}}], CHAT[:1], "tools[0].function.name: must be a non-empty string"),
    ([{"function": {"name": "f", "parameters": [1]}}], CHAT[:1],
     "tools[0].function.parameters: must be an object (a dict) or its JSON text, got list"),
    ([{"function": {"name": "f", "description": 3}}], CHAT[:1], "tools[0].function.description: must be a string"),
    ([BARE], [{"role": "assistant", "tool_calls": {"id": "x"}}],
     "messages[0].tool_calls: must be a list of tool calls, got dict"),
    ([BARE], [{"role": "assistant", "tool_calls": [{"id": 5, "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].id: must be a string"),
])
def test_client_refuses_bad_tools_naming_the_field(tools, messages, message) -> None:
    with pytest.raises(ValueError) as info:
        chat_input(messages, tools=tools)
    assert str(info.value).startswith(message), str(info.value)


def test_client_serialises_mapping_arguments_and_takes_text_parameters() -> None:
    tool = {"function": {"name": "f", "parameters": '{"type": "object"}'}}
    call = {"id": "c", "function": {"name": "f", "arguments": {"x": 1}}}
    msg = chat_input([{"role": "assistant", "tool_calls": [call]}], tools=[tool])
    assert msg.tools[0].function.parameters_json == '{"type": "object"}'
    assert json.loads(msg.messages[0].tool_calls[0].function.arguments) == {"x": 1}
