"""The generated OpenAPI document and /docs: every endpoint is described, every reference
resolves, request bodies come from the pydantic models the routes check against, and real
answers over the scripted engine (whole bodies, and each SSE event's data) validate against the
declared response schemas; /docs is Swagger UI from the package's own assets, public even when
keys are set."""
from __future__ import annotations

import json

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from sluice.http_facade.app import build_app
from sluice.http_facade.auth import AuthPolicy
from sluice.http_facade.openapi import ENDPOINTS, openapi_document
from sluice.http_facade.state import FacadeConfig
from tests.unit.test_facade_endpoints import WEATHER, http  # noqa: F401 - fixture
from tests.unit.test_facade_fake_engine import MODEL

KEY = "sk-doc"


def _refs(node, out: list) -> list:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            out.append(node["$ref"])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)
    return out


def test_the_document_describes_every_endpoint_and_its_refs_resolve():
    doc = openapi_document(model="m")
    assert doc["openapi"] == "3.1.0"
    for ep in ENDPOINTS:
        op = doc["paths"][ep.path][ep.method.lower()]
        assert op["responses"]["200"] and op["responses"]["default"], ep.path
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc, []):
        assert ref.startswith("#/components/schemas/") and ref.split("/")[-1] in schemas, ref
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert chat["requestBody"]["content"]["application/json"]["examples"]["basic"]["value"]["model"] == "m"
    sse = chat["responses"]["200"]["content"]["text/event-stream"]["itemSchema"]
    chunk = {"$ref": "#/components/schemas/ChatCompletionChunk"}
    assert sse["properties"]["data"]["anyOf"][1]["contentSchema"] == chunk
    props = schemas["ChatCompletionRequest"]["properties"]
    assert {"model", "messages", "temperature", "tools", "response_format"} <= set(props)
    assert "examples" not in json.dumps(openapi_document()["paths"]["/v1/completions"])   # no model: none


class _Doc:
    def __init__(self, doc: dict) -> None:
        self.doc = doc
        self.registry = Registry().with_resource("urn:doc", Resource.from_contents(doc, DRAFT202012))

    def validate(self, path: str, method: str, value, media: str = "application/json") -> None:
        content = self.doc["paths"][path][method]["responses"]["200"]["content"][media]
        if media == "text/event-stream":
            schema = content["itemSchema"]["properties"]["data"]["anyOf"][1]["contentSchema"]
        else:
            schema = content["schema"]
        schema = json.loads(json.dumps(schema).replace('"#/components', '"urn:doc#/components'))
        jsonschema.Draft202012Validator(schema, registry=self.registry).validate(value)


def test_every_request_example_fits_its_own_schema():
    doc = _Doc(openapi_document(model="m"))
    examples = 0
    for path, ops in doc.doc["paths"].items():
        for op in ops.values():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            for example in body.get("examples", {}).values():
                schema = json.loads(json.dumps(body["schema"]).replace('"#/components', '"urn:doc#/components'))
                jsonschema.Draft202012Validator(schema, registry=doc.registry).validate(example["value"])
                examples += 1
    assert examples == 6
    afs = doc.doc["components"]["schemas"]["AfsParameters"]["properties"]
    assert afs["top_k"] == {"default": 50, "maximum": 100, "minimum": 1, "title": "Top K", "type": "integer",
                            "description": "an integer in [1, 100]"}    # also what its 422 says it must be


async def _events(resp) -> list[dict]:
    out = []
    for block in (await resp.text()).split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


async def test_real_answers_validate_against_the_declared_schemas(http):  # noqa: F811
    client, fake = http
    doc = _Doc(await (await client.get("/openapi.json")).json())
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    doc.validate("/v1/chat/completions", "post", await (await client.post("/v1/chat/completions", json={
        **chat, "logprobs": True, "top_logprobs": 1})).json())
    for event in await _events(await client.post("/v1/chat/completions", json={
            **chat, "stream": True, "stream_options": {"include_usage": True}})):
        doc.validate("/v1/chat/completions", "post", event, "text/event-stream")
    tools = {**chat, "messages": [{"role": "user", "content": "call-tool"}],
             "tools": [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}]}
    doc.validate("/v1/chat/completions", "post", await (await client.post("/v1/chat/completions", json=tools)).json())
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1}
    doc.validate("/v1/completions", "post", await (await client.post("/v1/completions", json=completion)).json())
    for event in await _events(await client.post("/v1/completions", json={**completion, "stream": True})):
        doc.validate("/v1/completions", "post", event, "text/event-stream")
    ask = {"model": MODEL, "input": "call-tool", "tools": [WEATHER]}
    whole = await (await client.post("/v1/responses", json=ask)).json()
    doc.validate("/v1/responses", "post", whole)
    doc.validate("/v1/responses/{response_id}", "get", await (await client.get(f"/v1/responses/{whole['id']}")).json())
    events = await _events(await client.post("/v1/responses", json={**ask, "stream": True}))
    assert len(events) > 5
    for event in events:
        doc.validate("/v1/responses", "post", event, "text/event-stream")
    doc.validate("/v1/responses/{response_id}", "delete",
                 await (await client.delete(f"/v1/responses/{whole['id']}")).json())
    doc.validate("/v1/models", "get", await (await client.get("/v1/models")).json())
    doc.validate("/v1/rerank", "post", await (await client.post("/v1/rerank", json={
        "model": MODEL, "query": "q", "documents": ["a", "bb"]})).json())
    doc.validate("/v1/score", "post", await (await client.post("/v1/score", json={
        "model": MODEL, "text_1": "q", "text_2": ["a"]})).json())
    doc.validate("/tokenize", "post", await (await client.post("/tokenize", json={"prompt": "a b"})).json())
    doc.validate("/detokenize", "post", await (await client.post("/detokenize", json={"tokens": [1]})).json())
    afs = {"model": MODEL, "inputs": "hi", "parameters": {"max_new_tokens": 2}}
    doc.validate("/models/generate", "post", await (await client.post("/models/generate", json=afs)).json())
    for event in await _events(await client.post("/models/generate", json={**afs, "stream": True})):
        doc.validate("/models/generate", "post", event, "text/event-stream")
    for body in ({"model": MODEL, "inputs": [["q", "a"], ["q", "bb"]]}, {"model": MODEL, "query": "q",
                                                                         "documents": ["a", "bb"]}):
        doc.validate("/models/rerank", "post", await (await client.post("/models/rerank", json=body)).json())
    with pytest.raises(jsonschema.ValidationError):     # the check can fail: a chunk is not a completion
        doc.validate("/v1/chat/completions", "post", events[0])


async def test_docs_and_the_chat_page_come_from_the_package_and_are_public():
    # No engine behind it: the documentation does not need one (the examples are then left out).
    keyed = TestClient(TestServer(build_app(FacadeConfig(engine_addr="127.0.0.1:9", auth=AuthPolicy(keys=(KEY,))))))
    await keyed.start_server()
    try:
        page = await keyed.get("/docs")
        text = await page.text()
        assert page.status == 200 and 'src="/docs/swagger-ui-bundle.js"' in text and "SwaggerUIBundle(" in text
        assert '"url": "/openapi.json"' in text and "cdn" not in text.lower() and "https://" not in text
        js = await keyed.get("/docs/swagger-ui-bundle.js")
        assert js.status == 200 and js.headers["Content-Type"].startswith("text/javascript")
        assert len(await js.read()) > 1_000_000
        css = await keyed.get("/docs/swagger-ui.css")
        assert css.status == 200 and css.headers["Content-Type"].startswith("text/css")
        assert (await keyed.get("/openapi.json")).status == 200
        assert (await keyed.get("/v1/models")).status == 401
        assert (await keyed.get("/docs/other.js")).status == 401          # not a public asset
        for path, kind in (("/", "text/html"), ("/ui/chat.js", "text/javascript"), ("/ui/chat.css", "text/css")):
            resp = await keyed.get(path)                                   # the chat page: public, no CDN
            body = await resp.text()
            assert resp.status == 200 and resp.headers["Content-Type"].startswith(kind), path
            assert "https://" not in body and "http://" not in body, path
        assert 'src="/ui/chat.js"' in await (await keyed.get("/")).text()
    finally:
        await keyed.close()
