"""The AFS routes (and the real /v1/embeddings) over a scripted in-process gRPC engine (the double
of test_facade_fake_engine, extended here with Embed, Rerank, infilling and a function-calling
answer): record shapes, defaults reaching the engine, streaming (one record per token, totals on
the last, pings while the engine is silent, an error record mid-stream), finish reasons, the
AFS error body for every failure (422 naming the parameter, 400, 401, 404), X-API-KEY, function
calling, infilling, embeddings (V1, V2, base64, dimensions, query prefix) and rerank."""
from __future__ import annotations

import asyncio
import base64
import json
import struct

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from sluice.http_facade.app import build_app
from sluice.http_facade.auth import AuthPolicy
from sluice.http_facade.routes_afs import AfsConfig
from sluice.http_facade.state import STATE_KEY, FacadeConfig
from tests.unit.test_facade_fake_engine import MODEL, FakeEngine

KEY = "afs-key"
EMBEDDER = "fake-minilm"
CALL = '{"name": "get_current_weather", "arguments": {"location": "Boston, MA"}}'


def _vector(text: str) -> list[float]:
    return [float(len(text)), 0.5, -1.25, 2.0]


def _words(text: str) -> set[str]:
    return set(text.lower().replace("?", "").replace(".", "").split())


class AfsFakeEngine(FakeEngine):
    """Adds: Embed (vector = [len, 0.5, -1.25, 2], cut at ``dimensions``), Rerank (score = shared
    words), ``pause`` prompts (3 tokens 0.15 s apart), a JSON call when functions are offered."""

    def __init__(self) -> None:
        super().__init__()
        self.capabilities = ["chat", "generate", "embeddings", "rerank"]
        self.embeds: list[pb.EmbedRequest] = []
        self.reranks: list[pb.RerankRequest] = []

    async def _steps(self, request, text):
        if "pause" in text:
            for k in range(3):
                await asyncio.sleep(0.15)
                msg = pb.GenerateResponse(request_id=request.request_id)
                self._delta(msg.choices.add(), 0, k, 3, request.sampling, 2)
                yield msg
            return
        if request.WhichOneof("input") == "chat" and "You can call these functions" in text:
            pieces = [CALL[i:i + 9] for i in range(0, len(CALL), 9)]
            for k, piece in enumerate(pieces):
                msg = pb.GenerateResponse(request_id=request.request_id)
                c = msg.choices.add(index=0, text=piece, token_ids=[300 + k])
                if k == len(pieces) - 1:
                    c.final.finish_reason = pb.FINISH_REASON_STOP
                    c.final.usage.prompt_tokens, c.final.usage.completion_tokens = 40, len(pieces)
                yield msg
            return
        async for msg in super()._steps(request, text):
            if "stopword" in text and msg.choices[0].HasField("final"):
                msg.choices[0].final.finish_reason = pb.FINISH_REASON_STOP
                msg.choices[0].final.stop_string = "stopword"
            yield msg

    async def ListModels(self, request, context):
        resp = await super().ListModels(request, context)
        resp.models[0].embedding_model = EMBEDDER if "embeddings" in self.capabilities else ""
        return resp

    async def Embed(self, request, context):
        self.embeds.append(request)
        texts = list(request.texts) or [" ".join(map(str, t.ids)) for t in request.token_ids]
        resp = pb.EmbedResponse(model=EMBEDDER, usage=pb.Usage(prompt_tokens=3 * len(texts)))
        for i, t in enumerate(texts):
            values = _vector(t)[: request.dimensions or None]
            resp.embeddings.add(values=values, index=i, num_tokens=3)
        return resp

    async def Rerank(self, request, context):
        self.reranks.append(request)
        pairs = [(p.query, p.document) for p in request.pairs] or [(request.query, d) for d in request.documents]
        scores = [len(_words(q) & _words(d)) / 10 for q, d in pairs]
        order = range(len(scores)) if request.pairs else sorted(range(len(scores)), key=lambda i: -scores[i])
        order = list(order)[: request.top_n if request.HasField("top_n") else None]
        return pb.RerankResponse(scores=scores, usage=pb.Usage(prompt_tokens=5 * len(pairs)),
                                 results=[pb.RerankResult(index=i, score=scores[i]) for i in order],
                                 method="embedding-cosine", model=EMBEDDER)


@pytest.fixture
async def afs():
    server = grpc.aio.server()
    fake = AfsFakeEngine()
    pb_grpc.add_EngineServiceServicer_to_server(fake, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    app = build_app(FacadeConfig(engine_addr=f"127.0.0.1:{port}", auth=AuthPolicy(keys=(KEY,))),
                    afs=AfsConfig(ping_interval_s=0.05, query_prefix="query: "))
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    yield client, fake
    await client.close()
    await server.stop(grace=None)


H = {"X-API-KEY": KEY, "X-API-HOST": "afs-inference"}
FIELDS = ["generated_text", "function_call", "details", "total_time_taken", "prompt_tokens", "generated_tokens",
          "total_tokens", "finish_reason"]


def _conv(content: str = "hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "human", "content": content}], **kw}


async def _afs_error(resp, status: int, param) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"status_code", "error", "detail", "param"}, body
    assert body["status_code"] == status and body["error"] == body["detail"] and body["param"] == param, body
    return body


async def _lines(resp) -> list[str]:
    return [line.decode() for line in (await resp.read()).split(b"\n") if line]


def _records(lines: list[str]) -> list[dict]:
    return [json.loads(line[5:]) for line in lines if line.startswith("data: {")]


# ---------------------------------------------------------------------------- generation
async def test_conversation_answer_and_defaults(afs):
    client, fake = afs
    resp = await client.post("/models/conversation", json=_conv(parameters={"max_new_tokens": 3}), headers=H)
    assert resp.status == 200
    body = await resp.json()
    assert list(body) == FIELDS
    assert body["generated_text"] == "c0w0 c0w1 c0w2 " and body["function_call"] is None and body["details"] is None
    assert (body["prompt_tokens"], body["generated_tokens"], body["total_tokens"]) == (1, 3, 4)
    assert body["finish_reason"] == "length" and body["total_time_taken"].endswith(" sec")
    float(body["total_time_taken"].split()[0])
    sp = fake.requests[-1].sampling
    assert (sp.max_tokens, sp.top_k, sp.seed, sp.repetition_penalty) == (3, 50, 42, 1.0)
    assert fake.requests[-1].chat.messages[0].role == pb.ROLE_USER


async def test_finish_reasons_and_probabilities(afs):
    client, _ = afs
    resp = await client.post("/models/generate", headers=H, json={
        "model": MODEL, "inputs": "stopword", "parameters": {"max_new_tokens": 2, "show_probabilities": True}})
    body = await resp.json()
    assert body["finish_reason"] == "stop_sequence"
    assert body["details"] == {"tokens": [{"id": 100, "text": "c0w0 ", "logprob": -0.25},
                                          {"id": 101, "text": "c0w1 ", "logprob": -0.25}]}


async def test_streaming_records(afs):
    client, _ = afs
    resp = await client.post("/models/generate", headers=H, json={
        "model": MODEL, "inputs": "x", "stream": True, "parameters": {"max_new_tokens": 4}})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    recs = _records(await _lines(resp))
    assert len(recs) == 4 and all(list(r) == FIELDS for r in recs)
    assert "".join(r["generated_text"] for r in recs) == "c0w0 c0w1 c0w2 c0w3 "
    for r in recs[:-1]:
        assert (r["total_time_taken"], r["finish_reason"], r["prompt_tokens"], r["total_tokens"]) == (None, None, 0, 0)
    last = recs[-1]
    assert last["generated_text"] == "c0w3 " and last["finish_reason"] == "length"
    assert (last["prompt_tokens"], last["generated_tokens"], last["total_tokens"]) == (1, 4, 5)


async def test_pings_while_the_engine_is_silent(afs):
    client, _ = afs
    resp = await client.post("/models/conversation", json=_conv("pause", stream=True), headers=H)
    lines = await _lines(resp)
    pings = [i for i, line in enumerate(lines) if line == "event: ping"]
    assert pings and all(lines[i + 1].startswith("data: 20") for i in pings)   # data: <UTC time>, not JSON
    assert lines.index("event: ping") < min(i for i, line in enumerate(lines) if line.startswith("data: {"))
    assert "".join(r["generated_text"] for r in _records(lines)) == "c0w0 c0w1 c0w2 "


async def test_errors_before_and_during_a_stream(afs):
    client, _ = afs
    resp = await client.post("/models/conversation", json=_conv("fail-midway", stream=True), headers=H)
    recs = _records(await _lines(resp))
    assert recs[0]["generated_text"] == "c0w0 "
    assert recs[-1]["status_code"] == 500 and "injected fault" in recs[-1]["error"]
    resp = await client.post("/models/conversation", json=_conv("context-too-long", stream=True), headers=H)
    body = await _afs_error(resp, 400, "inputs")
    assert "context window" in body["error"]


async def test_validation_errors_are_422_with_the_afs_body(afs):
    client, fake = afs
    n = len(fake.requests)
    await _afs_error(await client.post("/models/conversation", json=_conv(parameters={"top_k": 0}), headers=H),
                     422, "top_k")
    await _afs_error(await client.post("/models/generate", json={"model": MODEL}, headers=H), 422, "inputs")
    await _afs_error(await client.post("/models/generate", data=b"{nope", headers={**H, "Content-Type": "application/json"}), 400, None)
    await _afs_error(await client.post("/models/generate", json={"model": "nope", "inputs": "x"}, headers=H),
                     404, "model")
    assert len(fake.requests) == n     # nothing reached the engine


async def test_x_api_key(afs):
    client, _ = afs
    await _afs_error(await client.post("/models/generate", json={"model": MODEL, "inputs": "x"}), 401, None)
    await _afs_error(await client.post("/models/generate", json={"model": MODEL, "inputs": "x"},
                                       headers={"X-API-KEY": "wrong"}), 401, None)
    ok = await client.post("/models/generate", headers={"x-api-key": KEY},
                           json={"model": MODEL, "inputs": "x", "parameters": {"max_new_tokens": 1}})
    assert ok.status == 200
    models = await client.get("/v1/models", headers={"X-API-Key": KEY})   # the same keys on every route
    assert models.status == 200


async def test_function_call_round_trip(afs):
    client, fake = afs
    weather = {"name": "get_current_weather", "parameters": {"type": "object", "properties": {}}}
    resp = await client.post("/models/conversation", headers=H, json=_conv("weather?", functions=[weather]))
    body = await resp.json()
    assert body["function_call"] == {"name": "get_current_weather", "arguments": {"location": "Boston, MA"}}
    assert body["finish_reason"] == "function_call" and body["generated_text"] == ""
    resp = await client.post("/models/conversation", headers=H, json=_conv("weather?", functions=[weather],
                                                                           stream=True))
    recs = _records(await _lines(resp))
    assert "".join(r["generated_text"] for r in recs) == CALL
    assert recs[-1]["finish_reason"] == "function_call" and recs[-1]["function_call"]["name"] == weather["name"]
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "function_call": json.loads(CALL)},
               {"role": "function", "name": "get_current_weather", "content": "{\"temperature\": \"22\"}"}]
    resp = await client.post("/models/conversation", headers=H, json={"model": MODEL, "messages": history,
                                                                      "parameters": {"max_new_tokens": 2}})
    assert resp.status == 200
    sent = fake.requests[-1].chat.messages
    assert [m.role for m in sent] == [pb.ROLE_USER, pb.ROLE_ASSISTANT, pb.ROLE_TOOL] and sent[2].name == weather["name"]


async def test_text_infilling(afs):
    client, fake = afs
    body = {"model": MODEL, "inputs": "def f(x):\n    <FILL_ME>\n    return y\n", "parameters": {"max_new_tokens": 2}}
    resp = await _afs_error(await client.post("/models/text_infilling", json=body, headers=H), 400, "model")
    assert "does not support infilling" in resp["error"]
    fake.capabilities.append("infilling")
    client.app[STATE_KEY].link.engines[0].link._models = None     # the model list is cached for 5 s
    resp = await client.post("/models/text_infilling", json=body, headers=H)
    assert resp.status == 200 and (await resp.json())["generated_text"] == "c0w0 c0w1 "
    sent = fake.requests[-1]
    assert sent.WhichOneof("input") == "infill"
    assert (sent.infill.prefix, sent.infill.suffix) == ("def f(x):\n    ", "\n    return y\n")
    for text in ("no marker", "<FILL_ME><FILL_ME>"):
        await _afs_error(await client.post("/models/text_infilling", json={**body, "inputs": text}, headers=H),
                         400, "inputs")


# ---------------------------------------------------------------------------- embeddings
async def test_afs_embeddings_v1_and_v2(afs):
    client, fake = afs
    resp = await client.post("/models/embeddings", headers=H, json={"model": EMBEDDER, "inputs": ["ab", "abcd"]})
    body = await resp.json()
    assert set(body) == {"data", "total_time_taken", "usage"} and body["usage"] == {"prompt_tokens": 6,
                                                                                  "total_tokens": 6}
    assert body["data"] == [{"embedding": _vector("ab"), "index": 0, "object": "embedding"},
                            {"embedding": _vector("abcd"), "index": 1, "object": "embedding"}]
    req = fake.embeds[-1]
    assert req.normalize and req.input_type == pb.EMBED_INPUT_TYPE_DOCUMENT and req.dimensions == 0
    resp = await client.post("/models/embeddings", headers=H, json={
        "model": MODEL, "input": ["abc"], "encoding_format": "base64", "dimensions": 2,
        "parameters": {"input_type": "query", "normalize": False}})
    data = (await resp.json())["data"][0]["embedding"]
    assert list(struct.unpack("<2f", base64.b64decode(data))) == _vector("abc")[:2]
    req = fake.embeds[-1]
    assert req.prefix == "query: " and not req.normalize and req.dimensions == 2
    for patch, param in (({"inputs": []}, "inputs"), ({"input": ["a"], "dimensions": -1}, "dimensions"),
                         ({"input": ["a"], "encoding_format": "hex"}, "encoding_format"),
                         ({"input": ["a"], "parameters": {"input_type": "passage"}}, "input_type"),
                         ({"input": ["a"], "inputs": ["b"]}, "inputs")):
        await _afs_error(await client.post("/models/embeddings", json={"model": EMBEDDER, **patch}, headers=H),
                         422, param)


async def test_openai_embeddings(afs):
    client, fake = afs
    auth = {"Authorization": f"Bearer {KEY}"}
    resp = await client.post("/v1/embeddings", headers=auth, json={"model": EMBEDDER, "input": [[1, 2], [3]],
                                                                   "dimensions": 3, "encoding_format": "base64"})
    body = await resp.json()
    assert body["object"] == "list" and body["model"] == EMBEDDER and body["usage"]["total_tokens"] == 6
    assert list(struct.unpack("<3f", base64.b64decode(body["data"][1]["embedding"]))) == _vector("3")[:3]
    assert [list(t.ids) for t in fake.embeds[-1].token_ids] == [[1, 2], [3]] and fake.embeds[-1].dimensions == 3
    resp = await client.post("/v1/embeddings", headers=auth, json={"model": MODEL, "input": "hello"})
    assert (await resp.json())["data"][0]["embedding"] == _vector("hello")
    for bad in ({"input": ""}, {"input": [[1], ["a"]]}, {"input": "x", "dimensions": 0}):
        resp = await client.post("/v1/embeddings", headers=auth, json={"model": MODEL, **bad})
        assert resp.status == 400 and (await resp.json())["error"]["param"] in ("input", "dimensions", "input[1]")


async def test_no_embedding_model_is_a_clear_400(afs):
    client, fake = afs
    fake.capabilities = ["chat", "generate"]
    resp = await client.post("/models/embeddings", headers=H, json={"model": MODEL, "inputs": ["a"]})
    body = await _afs_error(resp, 400, "model")
    assert "does not support embeddings" in body["error"]
    resp = await client.post("/models/rerank", headers=H, json={"model": MODEL, "inputs": [["a", "b"]]})
    assert "does not support reranking" in (await _afs_error(resp, 400, "model"))["error"]


# -------------------------------------------------------------------------------- rerank
async def test_rerank_both_forms(afs):
    client, fake = afs
    pairs = [["Where is the capital of Canada?", "Europe is a continent."],
             ["Where is the capital of Canada?", "The capital of Canada is Ottawa."],
             ["Where is the capital of Canada?", "Canada is a big country."]]
    body = await (await client.post("/models/rerank", headers=H, json={"model": EMBEDDER, "inputs": pairs})).json()
    assert body["scores"] == [0.1, 0.5, 0.2] and body["usage"] == {"prompt_tokens": 15, "total_tokens": 15}
    assert body["total_time_taken"].endswith(" sec") and "results" not in body
    docs = [p[1] for p in pairs]
    query = {"model": EMBEDDER, "query": pairs[0][0], "documents": docs}
    body = await (await client.post("/models/rerank", headers=H, json=query)).json()
    assert body["results"] == [{"score": 0.5, "index": 1}, {"score": 0.2, "index": 2}, {"score": 0.1, "index": 0}]
    assert fake.reranks[-1].top_n == 3
    body = await (await client.post("/models/rerank", headers=H, json={**query, "parameters": {"top_n": 2}})).json()
    assert [r["index"] for r in body["results"]] == [1, 2]
    for patch, param in (({"parameters": {"top_n": 0}}, "top_n"), ({"documents": ["a", ""]}, "documents[1]"),
                         ({"query": None}, "query"), ({"inputs": pairs}, "inputs")):
        await _afs_error(await client.post("/models/rerank", headers=H, json={**query, **patch}), 422, param)
    await _afs_error(await client.post("/models/rerank", headers=H, json={"model": EMBEDDER,
                                                                          "inputs": [["only one"]]}), 422, "inputs[0]")
