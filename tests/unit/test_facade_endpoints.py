"""The endpoints that editors and RAG tools call, over a scripted engine (``FakeEngine`` of
test_facade_fake_engine, extended here with Tokenize, Rerank and infilling): ``suffix`` on
/v1/completions, /tokenize and /detokenize, /v1/rerank, /rerank and /v1/score, and
/v1/responses (shapes, the streamed event sequence, tool calls, previous_response_id, retrieve
and delete, the bounded store). Every bad input: its status, parameter and message."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from sluice.http_facade.app import build_app
from sluice.http_facade.routes_responses import ResponseStore
from sluice.http_facade.state import FacadeConfig
from tests.unit.test_facade_fake_engine import MODEL, FakeEngine

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class Engine(FakeEngine):
    """``FakeEngine`` plus: Tokenize (one id per word, 1 first with special tokens), Rerank (the
    score of a document is its length / 100), and a prompt holding ``call-tool`` answers with a
    weather call in three pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenized: list[pb.TokenizeRequest] = []
        self.reranked: list[pb.RerankRequest] = []

    async def Generate(self, request, context):
        text = " ".join(m.content for m in request.chat.messages)
        if "call-tool" not in text:
            async for msg in super().Generate(request, context):
                yield msg
            return
        self.requests.append(request)
        pieces = ["Sure. ", CALL[:20], CALL[20:]]
        for k, piece in enumerate(pieces):
            msg = pb.GenerateResponse(request_id=request.request_id)
            c = msg.choices.add(index=0, text=piece, token_ids=[100 + k])
            if k == len(pieces) - 1:
                c.final.finish_reason = pb.FINISH_REASON_STOP
                c.final.usage.prompt_tokens, c.final.usage.completion_tokens = 5, 3
            yield msg

    async def Tokenize(self, request, context):
        self.tokenized.append(request)
        if request.WhichOneof("input") == "chat":
            prompt = "|".join(m.content for m in request.chat.messages)
            return pb.TokenizeResponse(token_ids=[7] * len(request.chat.messages), prompt=prompt, max_model_len=2048)
        words = request.text.split()
        ids = ([1] if request.add_special_tokens else []) + [10 + i for i, _ in enumerate(words)]
        resp = pb.TokenizeResponse(token_ids=ids, max_model_len=2048)
        if request.with_pieces:   # a word's first two bytes: "€" (3 bytes) leaves a partial character
            resp.pieces.extend(([b"<s>"] if request.add_special_tokens else []) + [w.encode()[:2] for w in words])
            resp.spellings.extend((["<s>"] if request.add_special_tokens else []) + ["\u0120" + w for w in words])
        return resp

    async def Detokenize(self, request, context):
        if any(t >= 1000 for t in request.token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "token_ids: token id 5000 is outside the vocabulary (size 1000)")
        return await super().Detokenize(request, context)

    async def Rerank(self, request, context):
        self.reranked.append(request)
        if request.pairs:
            scores = [len(p.document) / 100 for p in request.pairs]
            results = [pb.RerankResult(index=i, score=s) for i, s in enumerate(scores)]
        else:
            scores = [len(d) / 100 for d in request.documents]
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            results = [pb.RerankResult(index=i, score=scores[i]) for i in order]
            if request.HasField("top_n"):
                results = results[:request.top_n]
        return pb.RerankResponse(scores=scores, results=results, usage=pb.Usage(prompt_tokens=9),
                                 method="cross-encoder", model="tiny-reranker")


@pytest.fixture
async def http():
    server = grpc.aio.server()
    fake = Engine()
    fake.capabilities = ["chat", "generate", "rerank"]
    pb_grpc.add_EngineServiceServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    client = TestClient(TestServer(build_app(FacadeConfig(engine_addr=f"127.0.0.1:{port}")),
                                   handler_cancellation=True))
    await client.start_server()
    yield client, fake
    await client.close()
    await server.stop(grace=None)


async def _error(resp, status: int, param, fragment: str) -> dict:
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == param and fragment in err["message"], err
    return err


# ------------------------------------------------------------------------------- suffix
async def test_suffix_is_an_infill_request_on_a_model_with_fim_tokens(http):
    client, fake = http
    fake.capabilities = ["generate", "infilling"]
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "def f(", "suffix": "):\n",
                                                      "max_tokens": 2})
    body = await resp.json()
    assert resp.status == 200 and body["choices"][0]["text"] == "c0w0 c0w1 "
    sent = fake.requests[-1]
    assert sent.WhichOneof("input") == "infill" and (sent.infill.prefix, sent.infill.suffix) == ("def f(", "):\n")


async def test_suffix_without_fim_tokens_is_a_400_naming_suffix(http):
    client, fake = http
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "def f(", "suffix": "):"})
    err = await _error(resp, 400, "suffix", "cannot fill in the middle")
    assert err["code"] == "model_not_supported" and not fake.requests


# ------------------------------------------------------------------------------ tokenize
async def test_tokenize_vllm_and_llama_cpp_shapes(http):
    client, fake = http
    body = await (await client.post("/tokenize", json={"model": MODEL, "prompt": "a b c"})).json()
    assert body == {"tokens": [1, 10, 11, 12], "count": 4, "max_model_len": 2048}
    body = await (await client.post("/tokenize", json={"content": "a b"})).json()   # llama.cpp: no BOS
    assert body["tokens"] == [10, 11] and body["count"] == 2
    body = await (await client.post("/tokenize", json={"content": "a b", "add_special": True})).json()
    assert body["tokens"] == [1, 10, 11]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = await (await client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False})).json()
    assert body == {"tokens": [7, 7], "count": 2, "max_model_len": 2048, "prompt": "be brief|hi"}
    chat = fake.tokenized[-1].chat
    assert [m.role for m in chat.messages] == [pb.ROLE_SYSTEM, pb.ROLE_USER] and not chat.add_generation_prompt


async def test_tokenize_token_strings_in_vllm_and_llama_cpp_shapes(http):
    client, fake = http
    body = await (await client.post("/tokenize", json={"prompt": "ab é", "return_token_strs": True})).json()
    assert body == {"tokens": [1, 10, 11], "count": 3, "max_model_len": 2048,
                    "token_strs": ["<s>", "\u0120ab", "\u0120é"]}
    assert fake.tokenized[-1].with_pieces
    body = await (await client.post("/tokenize", json={"content": "ab €", "with_pieces": True})).json()
    assert body == {"tokens": [{"id": 10, "piece": "ab"}, {"id": 11, "piece": [0xE2, 0x82]}], "count": 2,
                    "max_model_len": 2048}
    body = await (await client.post("/tokenize", json={"content": "ab", "with_pieces": False})).json()
    assert body["tokens"] == [10] and not fake.tokenized[-1].with_pieces


async def test_detokenize_answers_both_shapes(http):
    client, _ = http
    body = await (await client.post("/detokenize", json={"model": MODEL, "tokens": [5, 6]})).json()
    assert body == {"prompt": "<5><6>", "content": "<5><6>"}


@pytest.mark.parametrize("path, body, status, param, fragment", [
    ("/tokenize", {}, 400, "prompt", "exactly one of prompt, content"),
    ("/tokenize", {"prompt": "a", "content": "b"}, 400, "content", "got prompt and content"),
    ("/tokenize", {"prompt": ""}, 400, "prompt", "non-empty string"),
    ("/tokenize", {"content": 5}, 400, "content", "content: must be a string, got 5"),
    ("/tokenize", {"messages": []}, 400, "messages", "non-empty list"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "must be one of"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens", "boolean"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, 400, "return_token_strs", "boolean"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, 400, "with_pieces", "boolean"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model", "does not exist"),
    ("/tokenize", {"model": 3, "prompt": "a"}, 400, "model", "model: must be a string"),
    ("/tokenize", {"model": "", "prompt": "a"}, 400, "model", "served model's name"),
    ("/detokenize", {}, 400, "tokens", "tokens: required"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens", "list of token ids"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "not a vocabulary index"),
    ("/detokenize", {"tokens": [5000]}, 400, "tokens", "outside the vocabulary"),
])
async def test_tokenize_bad_inputs(http, path, body, status, param, fragment):
    client, _ = http
    await _error(await client.post(path, json=body), status, param, fragment)


# -------------------------------------------------------------------------------- rerank
@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
async def test_rerank_jina_cohere_shape(http, path):
    client, fake = http
    resp = await client.post(path, json={"model": MODEL, "query": "q", "top_n": 2,
                                         "documents": ["a", {"text": "ccc"}, "bb"]})
    body = await resp.json()
    assert resp.status == 200 and body["id"].startswith("rerank-") and body["model"] == MODEL
    assert body["results"] == [{"index": 1, "relevance_score": 0.03, "document": {"text": "ccc"}},
                               {"index": 2, "relevance_score": 0.02, "document": {"text": "bb"}}]
    assert body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert list(fake.reranked[-1].documents) == ["a", "ccc", "bb"] and fake.reranked[-1].top_n == 2
    body = await (await client.post(path, json={"model": MODEL, "query": "q", "documents": ["a"],
                                                "return_documents": False})).json()
    assert body["results"] == [{"index": 0, "relevance_score": 0.01}]


async def test_score_one_to_many_and_pairwise(http):
    client, fake = http
    body = await (await client.post("/v1/score", json={"model": MODEL, "text_1": "q", "text_2": ["a", "bb"]})).json()
    assert body["object"] == "list" and body["id"].startswith("score-") and body["model"] == MODEL
    assert body["data"] == [{"index": 0, "object": "score", "score": 0.01},
                            {"index": 1, "object": "score", "score": 0.02}]
    assert [(p.query, p.document) for p in fake.reranked[-1].pairs] == [("q", "a"), ("q", "bb")]
    await client.post("/v1/score", json={"model": MODEL, "text_1": ["x", "y"], "text_2": ["a", "bb"]})
    assert [(p.query, p.document) for p in fake.reranked[-1].pairs] == [("x", "a"), ("y", "bb")]


@pytest.mark.parametrize("path, body, status, param, fragment", [
    ("/v1/rerank", {"query": "q", "documents": ["a"]}, 400, "model", "model: required"),
    ("/v1/rerank", {"model": MODEL, "documents": ["a"]}, 400, "query", "query: required"),
    ("/v1/rerank", {"model": MODEL, "query": "", "documents": ["a"]}, 400, "query", "non-empty string"),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": []}, 400, "documents", "non-empty list"),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", {"txt": "b"}]}, 400, "documents[1]",
     "non-empty"),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n", ">= 1"),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"], "top_n": "2"}, 400, "top_n", "integer"),
    ("/rerank", {"model": "nope", "query": "q", "documents": ["a"]}, 404, "model", "does not exist"),
    ("/v1/score", {"model": MODEL, "text_1": "q"}, 400, "text_2", "text_2: required"),
    ("/v1/score", {"model": MODEL, "text_1": "q", "text_2": []}, 400, "text_2", "non-empty"),
    ("/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["c"]}, 400, "text_2", "as many texts"),
    ("/v1/score", {"model": MODEL, "text_1": [""], "text_2": ["c"]}, 400, "text_1[0]", "non-empty"),
])
async def test_rerank_bad_inputs(http, path, body, status, param, fragment):
    client, _ = http
    await _error(await client.post(path, json=body), status, param, fragment)


async def test_rerank_without_an_encoder_is_model_not_supported(http):
    client, fake = http
    fake.capabilities = ["chat", "generate"]
    resp = await client.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["a"]})
    err = await _error(resp, 400, "model", "does not support reranking")
    assert err["code"] == "model_not_supported"


# ----------------------------------------------------------------------------- responses
async def _events(resp) -> list[tuple[str, dict]]:
    out = []
    for block in (await resp.text()).split("\n\n"):
        if block:
            head, data = block.split("\n", 1)
            assert head.startswith("event: ") and data.startswith("data: "), block
            out.append((head[7:], json.loads(data[6:])))
    return out


async def test_responses_text_shape_and_instructions(http):
    client, fake = http
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "instructions": "be brief",
                                                    "max_output_tokens": 2, "metadata": {"k": "v"}})
    body = await resp.json()
    assert resp.status == 200 and body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "c0w0 c0w1 ", "annotations": [], "logprobs": []}]
    assert body["usage"]["input_tokens"] == 3 and body["usage"]["output_tokens"] == 2   # "be brief hi"
    assert body["usage"]["total_tokens"] == 5 and body["metadata"] == {"k": "v"}
    assert body["instructions"] == "be brief" and body["max_output_tokens"] == 2
    chat = fake.requests[-1].chat
    assert [(m.role, m.content) for m in chat.messages] == [(pb.ROLE_SYSTEM, "be brief"), (pb.ROLE_USER, "hi")]
    assert fake.requests[-1].sampling.max_tokens == 2


async def test_responses_stream_event_sequence(http):
    client, _ = http
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                    "stream": True})
    events = await _events(resp)
    kinds = [k for k, _ in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(e["type"] == k for k, e in events)
    assert events[0][1]["response"]["status"] == "in_progress"
    assert "".join(e["delta"] for k, e in events if k == "response.output_text.delta") == "c0w0 c0w1 "
    assert events[6][1]["text"] == "c0w0 c0w1 "
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == "c0w0 c0w1 " and final["usage"]["output_tokens"] == 2


async def test_responses_tool_call_stream_and_whole(http):
    client, _ = http
    ask = {"model": MODEL, "input": "call-tool for Paris", "tools": [WEATHER]}
    body = await (await client.post("/v1/responses", json=ask)).json()
    assert body["status"] == "completed"
    message, call = body["output"]
    assert message["content"][0]["text"] == "Sure."
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["status"] == "completed"
    events = await _events(await client.post("/v1/responses", json={**ask, "stream": True}))
    kinds = [k for k, _ in events]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    added = events[-5][1]
    assert added["item"]["type"] == "function_call" and added["output_index"] == 1
    assert json.loads(events[-3][1]["arguments"]) == {"city": "Paris"}
    assert [i["type"] for i in events[-1][1]["response"]["output"]] == ["message", "function_call"]


async def test_previous_response_id_continues_the_conversation(http):
    client, fake = http
    first = await (await client.post("/v1/responses", json={"model": MODEL, "input": "call-tool", "tools": [WEATHER],
                                                            "instructions": "only once"})).json()
    call = first["output"][1]
    follow = {"model": MODEL, "previous_response_id": first["id"], "tools": [WEATHER], "max_output_tokens": 1,
              "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]}
    second = await (await client.post("/v1/responses", json=follow)).json()
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    msgs = fake.requests[-1].chat.messages
    assert [m.role for m in msgs] == [pb.ROLE_USER, pb.ROLE_ASSISTANT, pb.ROLE_ASSISTANT, pb.ROLE_TOOL]
    assert msgs[2].tool_calls[0].id == call["call_id"] and msgs[2].tool_calls[0].function.name == "get_weather"
    assert msgs[3].tool_call_id == call["call_id"] and msgs[3].content == "sunny"
    got = await (await client.get(f"/v1/responses/{second['id']}")).json()
    assert got == second
    deleted = await (await client.delete(f"/v1/responses/{first['id']}")).json()
    assert deleted == {"id": first["id"], "object": "response", "deleted": True}
    await _error(await client.get(f"/v1/responses/{first['id']}"), 404, "response_id", "no stored response")
    await _error(await client.delete(f"/v1/responses/{first['id']}"), 404, "response_id", "no stored response")
    await _error(await client.post("/v1/responses", json={**follow, "previous_response_id": first["id"]}),
                 400, "previous_response_id", "no stored response")


async def test_store_false_is_not_retrievable(http):
    client, _ = http
    body = await (await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": False,
                                                           "max_output_tokens": 1})).json()
    assert body["store"] is False
    await _error(await client.get(f"/v1/responses/{body['id']}"), 404, "response_id", "no stored response")


@pytest.mark.parametrize("body, param, fragment", [
    ({"input": "x"}, "model", "model: required"),
    ({"model": "", "input": "x"}, "model", "model name"),
    ({"model": MODEL}, "input", "required"),
    ({"model": MODEL, "input": []}, "input", "non-empty list"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be one of"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]",
     "only text parts"),
    ({"model": MODEL, "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "non-empty"),
    ({"model": MODEL, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments", "string of JSON"),
    ({"model": MODEL, "input": [{"type": "web_search_call"}]}, "input[0].type", "must be message"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "name"),
    ({"model": MODEL, "input": "x", "tool_choice": 5, "tools": [WEATHER]}, "tool_choice", "must be auto"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema",
     "required"),
    ({"model": MODEL, "input": "x", "temperature": "hot"}, "temperature", "number"),
    ({"model": MODEL, "input": "x", "metadata": {"k": 1}}, "metadata", "does not match the documented types"),
    ({"model": MODEL, "input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"model": MODEL, "input": "x", "background": True, "store": False}, "background", "store false"),
    ({"model": MODEL, "input": "x", "background": True, "stream": True}, "stream", "cannot be streamed"),
    ({"model": MODEL, "input": "x", "include": ["file_search_call.results"]}, "include",
     "'file_search_call.results' is not supported"),
    ({"model": MODEL, "input": "x", "include": "message.output_text.logprobs"}, "include", "list of strings"),
    ({"model": MODEL, "input": "x", "include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include",
     "cannot be combined with tools"),
    ({"model": MODEL, "input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21},
     "top_logprobs", "20"),
    ({"model": MODEL, "input": "x", "reasoning": {"effort": "low"}}, "reasoning.effort", "no reasoning mode"),
    ({"model": MODEL, "input": "x", "reasoning": {"effort": None, "summary": "auto"}}, "reasoning.summary",
     "not supported with this model"),
    ({"model": MODEL, "input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"model": MODEL, "input": "x", "previous_response_id": 7}, "previous_response_id", "string"),
])
async def test_responses_bad_inputs(http, body, param, fragment):
    client, fake = http
    await _error(await client.post("/v1/responses", json=body), 400, param, fragment)
    assert not fake.requests


async def test_responses_engine_error_before_output_is_plain_http(http):
    client, _ = http
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "context-too-long", "stream": True})
    err = await _error(resp, 400, "input", "context window")
    assert err["code"] == "context_length_exceeded"
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "temperature": 3})
    await _error(resp, 400, "temperature", "must be <= 2")


async def test_responses_error_mid_stream_is_an_error_event_and_nothing_is_stored(http):
    client, _ = http
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "fail-midway", "stream": True})
    events = await _events(resp)
    assert [k for k, _ in events][-2:] == ["error", "response.failed"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and "injected fault" in failed["error"]["message"]
    await _error(await client.get(f"/v1/responses/{failed['id']}"), 404, "response_id", "no stored response")


async def test_responses_include_output_text_logprobs_whole_and_streamed(http):
    client, fake = http
    ask = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "include": ["message.output_text.logprobs"],
           "top_logprobs": 1, "reasoning": {"effort": None}}
    body = await (await client.post("/v1/responses", json=ask)).json()
    assert fake.requests[-1].sampling.logprobs and fake.requests[-1].sampling.top_logprobs == 1
    part = body["output"][0]["content"][0]
    assert part["text"] == "c0w0 c0w1 " and [lp["token"] for lp in part["logprobs"]] == ["c0w0 ", "c0w1 "]
    assert part["logprobs"][0]["logprob"] == -0.25 and part["logprobs"][0]["bytes"] == list(b"c0w0 ")
    assert part["logprobs"][0]["top_logprobs"] == [{"token": "alt0", "logprob": -0.25, "bytes": list(b"alt0")}]
    events = await _events(await client.post("/v1/responses", json={**ask, "stream": True}))
    deltas = [e for k, e in events if k == "response.output_text.delta"]
    assert [[lp["token"] for lp in d["logprobs"]] for d in deltas] == [["c0w0 "], ["c0w1 "]]
    assert events[-1][1]["response"]["output"][0]["content"][0]["logprobs"] == part["logprobs"]
    plain = await (await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1})
                   ).json()
    assert plain["output"][0]["content"][0]["logprobs"] == [] and not fake.requests[-1].sampling.logprobs


async def _settled(client, resp_id: str) -> dict:
    for _ in range(200):
        got = await (await client.get(f"/v1/responses/{resp_id}")).json()
        if got["status"] not in ("queued", "in_progress"):
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"{resp_id} still {got['status']}")


async def test_background_response_runs_after_the_answer_and_is_retrieved(http):
    client, fake = http
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                    "background": True})
    queued = await resp.json()
    assert resp.status == 200 and queued["status"] == "queued" and queued["background"] is True
    assert queued["output"] == [] and queued["usage"] is None
    done = await _settled(client, queued["id"])
    assert done["status"] == "incomplete" and done["output"][0]["content"][0]["text"] == "c0w0 c0w1 "
    assert done["usage"]["output_tokens"] == 2 and fake.requests[-1].request_id == f"{queued['id']}-0"
    again = await client.post(f"/v1/responses/{queued['id']}/cancel")   # finished: answered as it is
    assert (await again.json()) == done
    plain = await (await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1})
                   ).json()
    assert plain["background"] is False
    await _error(await client.post(f"/v1/responses/{plain['id']}/cancel"), 400, "response_id", "background true")
    await _error(await client.post("/v1/responses/resp_nope/cancel"), 404, "response_id", "no stored response")


async def test_background_response_that_fails_is_stored_failed(http):
    client, _ = http
    queued = await (await client.post("/v1/responses", json={"model": MODEL, "input": "fail-midway",
                                                             "background": True})).json()
    failed = await _settled(client, queued["id"])
    assert failed["status"] == "failed" and "injected fault" in failed["error"]["message"]


async def test_background_response_cancelled_aborts_the_engine_request(http):
    client, fake = http
    queued = await (await client.post("/v1/responses", json={"model": MODEL, "input": "slow", "background": True})
                    ).json()
    rid = f"{queued['id']}-0"
    for _ in range(200):
        if rid in fake.active:
            break
        await asyncio.sleep(0.01)
    got = await (await client.get(f"/v1/responses/{queued['id']}")).json()
    assert got["status"] == "in_progress"
    await _error(await client.post("/v1/responses", json={"model": MODEL, "input": "more",
                                                          "previous_response_id": queued["id"]}),
                 400, "previous_response_id", "still in_progress")
    cancelled = await (await client.post(f"/v1/responses/{queued['id']}/cancel")).json()
    assert cancelled["status"] == "cancelled" and cancelled["id"] == queued["id"]
    for _ in range(200):
        if rid in fake.aborted and rid not in fake.active:
            break
        await asyncio.sleep(0.01)
    assert rid in fake.aborted and rid not in fake.active           # the engine request is gone
    assert (await (await client.get(f"/v1/responses/{queued['id']}")).json())["status"] == "cancelled"
    second = await (await client.post("/v1/responses", json={"model": MODEL, "input": "slow", "background": True})
                    ).json()
    for _ in range(500):            # running: its engine request started (a fixed sleep raced a busy host)
        if f"{second['id']}-0" in fake.active:
            break
        await asyncio.sleep(0.01)
    assert f"{second['id']}-0" in fake.active
    deleted = await client.delete(f"/v1/responses/{second['id']}")     # deleting a running one cancels it
    for _ in range(200):
        if f"{second['id']}-0" in fake.aborted:
            break
        await asyncio.sleep(0.01)
    assert deleted.status == 200 and f"{second['id']}-0" in fake.aborted


def test_store_is_bounded_by_count_and_bytes():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    store.put({"id": "r3"}, [{"role": "user", "content": "y" * 20_000}])   # alone over the bytes: kept alone
    assert len(store) == 1 and store.get("r3") is not None
    assert store.delete("r3") and store.bytes == 0
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(max_entries=0)


async def test_new_routes_need_the_api_key():
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    from sluice.http_facade.auth import AuthPolicy
    client = TestClient(TestServer(build_app(FacadeConfig(engine_addr=f"127.0.0.1:{port}",
                                                          auth=AuthPolicy(keys=("k",))))))
    await client.start_server()
    try:
        for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/x"), ("DELETE", "/v1/responses/x"),
                             ("POST", "/v1/rerank"), ("POST", "/rerank"), ("POST", "/v1/score"),
                             ("POST", "/tokenize"), ("POST", "/detokenize")):
            resp = await client.request(method, path, json={})
            assert resp.status == 401, (method, path)
    finally:
        await client.close()
        await server.stop(grace=None)
        await asyncio.sleep(0)
