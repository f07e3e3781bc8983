"""Engine errors reach a gRPC client as status codes whose message names the field, and leave
nothing allocated: INVALID_ARGUMENT (bad parameters), OUT_OF_RANGE (context window),
UNIMPLEMENTED (a capability the chat model lacks), INTERNAL (a fault inside one request, while a
concurrent request finishes normally). RESOURCE_EXHAUSTED and UNAVAILABLE need an engine of their
own: see test_grpc_lifecycle.py."""
from __future__ import annotations

import threading

import grpc
import pytest

from sluice.engine.client import Choice, EngineClient, EngineRpcError
from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from tests.integration.conftest import wait_for_idle

pytestmark = pytest.mark.slow


def _status_of(fn) -> EngineRpcError:
    with pytest.raises(EngineRpcError) as info:
        fn()
    return info.value


def _assert_idle(client: EngineClient) -> None:
    load = wait_for_idle(client)
    assert (load.num_running, load.num_waiting, load.kv_blocks_used, load.num_in_flight) == (0, 0, 0, 0), load


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(n=0), "sampling.n"),
    (dict(top_logprobs=2), "sampling.top_logprobs"),
    (dict(logprobs=True, top_logprobs=50), "sampling.top_logprobs"),    # over the cap (max_logprobs)
    (dict(stop_token_ids=[10**6]), "stop_token_ids"),
    (dict(max_tokens=4, max_tokens_unlimited=True), "sampling.max_tokens"),
])
def test_invalid_argument_names_the_field(client: EngineClient, kwargs: dict, field: str) -> None:
    err = _status_of(lambda: client.generate("Hello", **kwargs).collect())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message.startswith(field), err.message
    _assert_idle(client)


def test_invalid_argument_for_inputs(client: EngineClient) -> None:
    err = _status_of(lambda: client.generate([1, 2, 10**6], max_tokens=2).collect())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message.startswith("prompt:")
    err = _status_of(lambda: client.generate("", max_tokens=2).collect())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message.startswith("text:")
    err = _status_of(lambda: client.detokenize([-1]))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message.startswith("token_ids:")
    # A raw request with a role the enum leaves unspecified (the SDK would refuse to build it).
    with grpc.insecure_channel(client.target) as channel:
        req = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(content="hi")]))
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.EngineServiceStub(channel).Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("chat.messages[0].role:")
    _assert_idle(client)


def test_invalid_tools_name_the_field(client: EngineClient) -> None:
    hi = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "now"}},
             {"type": "function", "function": {"name": "f", "parameters": "[1, 2]"}}]
    err = _status_of(lambda: client.tokenize(messages=hi, tools=tools))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == "chat.tools[1].function.parameters_json: must be a JSON object (a JSON Schema), got list"
    with grpc.insecure_channel(client.target) as channel:
        call = pb.ToolCall(id="c", function=pb.FunctionCall(arguments="{}"))
        chat = pb.ChatInput(messages=[pb.ChatMessage(role=pb.ROLE_USER, content="hi"),
                                      pb.ChatMessage(role=pb.ROLE_ASSISTANT, tool_calls=[call])])
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.EngineServiceStub(channel).Generate(pb.GenerateRequest(chat=chat), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "chat.messages[1].tool_calls[0].function.name: must not be empty"
    _assert_idle(client)


def test_out_of_range_when_the_prompt_exceeds_the_context_window(client: EngineClient) -> None:
    window = client.model_info().max_model_len
    err = _status_of(lambda: client.generate([42] * window, max_tokens=1).collect())
    assert err.code == grpc.StatusCode.OUT_OF_RANGE and err.message.startswith("prompt:")
    err = _status_of(lambda: client.generate("Hello", max_tokens=window).collect())
    assert err.code == grpc.StatusCode.OUT_OF_RANGE and err.message.startswith("max_tokens:")
    _assert_idle(client)


def test_unimplemented_for_a_capability_the_model_lacks(client: EngineClient) -> None:
    # SmolLM2's tokenizer has no fill-in-the-middle tokens: infilling is a capability it lacks.
    with grpc.insecure_channel(client.target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        req = pb.GenerateRequest(infill=pb.InfillInput(prefix="def f(", suffix="):\n    pass"),
                                 sampling=pb.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "does not support infilling" in info.value.details()


def test_internal_fault_in_one_request_leaves_the_others_running(client: EngineClient) -> None:
    """Needs SLUICE_DEBUG_FAULT_INJECTION=1 in the engine (the fixture sets it): a prompt with
    the marker raises inside the engine step for that request only."""
    healthy: dict = {}
    started = threading.Event()

    def run_healthy() -> None:
        choice = Choice(0)
        for d in client.generate("A calm and steady story:", max_tokens=16, ignore_eos=True):
            choice.add(d)
            started.set()
        healthy["choice"] = choice

    worker = threading.Thread(target=run_healthy)
    worker.start()
    assert started.wait(60), "the healthy request produced nothing"
    err = _status_of(lambda: client.generate("Please <<sluice-fault>> now", max_tokens=16, ignore_eos=True).collect())
    assert "choice" not in healthy, "the healthy request ended before the fault: no overlap was tested"
    worker.join(120)
    assert err.code == grpc.StatusCode.INTERNAL
    assert "injected fault" in err.message and "Traceback" not in err.message
    assert healthy["choice"].finish_reason == "length" and len(healthy["choice"].token_ids) == 16
    _assert_idle(client)
