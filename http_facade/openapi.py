"""The OpenAPI document (``/openapi.json``) and the ``/docs`` page (Swagger UI, shipped in the
package under ``static/swagger-ui``; no CDN).

Both are built from ``ENDPOINTS``, the same table ``app.py`` registers routes from. The OpenAI
dialect and the endpoints beside it are described by their pydantic models (``api_models``,
``api_responses``): the request bodies the routes check against and the response bodies they
send, whole and, for
streams, per server-sent event (``text/event-stream``, with the event's schema under
``itemSchema``). The AFS dialect's requests and responses are models too, and its routes check
requests against them as well (``afs_protocol.check``, in AFS's error shape).
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from sluice.http_facade import api_models as am
from sluice.http_facade import api_responses as ar

@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    summary: str
    public: bool = False                       # no API key needed
    schema: type[BaseModel] | dict | None = None   # the JSON request body
    dialect: str = "openai"                    # "afs": X-API-KEY security and the AFS error body
    response: type[BaseModel] | dict | None = None  # the 200 JSON body
    stream: type[BaseModel] | None = None      # one SSE event's data, when the body asks to stream
    content_type: str = "application/json"     # of the 200 body when it is not described by a model
    example: dict | None = None                # a request body that works ("$MODEL": a served model)


_HEALTH = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/v1/models", "List the served models", response=ar.ModelList),
    Endpoint("GET", "/v1/models/{model}", "Describe one served model", response=ar.ModelCard),
    Endpoint("POST", "/v1/chat/completions", "Chat completion, streaming (SSE) or not",
             schema=am.ChatCompletionRequest, response=ar.ChatCompletion, stream=ar.ChatCompletionChunk,
             example={"model": "$MODEL", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}),
    Endpoint("POST", "/v1/completions", "Text completion (suffix: fill in the middle), streaming (SSE) or not",
             schema=am.CompletionRequest, response=ar.Completion, stream=ar.Completion,
             example={"model": "$MODEL", "prompt": "Once upon a time", "max_tokens": 8}),
    Endpoint("POST", "/v1/embeddings", "Embeddings (models with the embeddings capability)",
             schema=am.EmbeddingRequest, response=ar.EmbeddingList),
    Endpoint("POST", "/v1/responses", "OpenAI Responses API: create a response, streaming (SSE events) or not",
             schema=am.ResponseCreateRequest, response=ar.ResponseObject, stream=ar.ResponseStreamEvent,
             example={"model": "$MODEL", "input": "Hello!", "instructions": "Be brief.", "max_output_tokens": 8}),
    Endpoint("GET", "/v1/responses/{response_id}", "Retrieve a stored response", response=ar.ResponseObject),
    Endpoint("DELETE", "/v1/responses/{response_id}", "Delete a stored response", response=ar.ResponseDeleted),
    Endpoint("POST", "/v1/responses/{response_id}/cancel", "Cancel a background response",
             response=ar.ResponseObject),
    Endpoint("POST", "/v1/rerank", "Rerank documents against a query (Jina / Cohere shape)",
             schema=am.RerankRequest, response=ar.RerankResponse),
    Endpoint("POST", "/rerank", "Rerank documents against a query (Jina / Cohere shape)",
             schema=am.RerankRequest, response=ar.RerankResponse),
    Endpoint("POST", "/v1/score", "Score text pairs (vLLM shape: text_1 against text_2)",
             schema=am.ScoreRequest, response=ar.ScoreResponse),
    Endpoint("POST", "/tokenize", "Tokenize a text or chat messages (vLLM / llama.cpp shape)",
             schema=am.TokenizeRequest, response=ar.TokenizeResponse,
             example={"model": "$MODEL", "prompt": "Hello world"}),
    Endpoint("POST", "/detokenize", "Token ids back to text (vLLM / llama.cpp shape)",
             schema=am.DetokenizeRequest, response=ar.DetokenizeResponse,
             example={"model": "$MODEL", "tokens": [1, 2, 3]}),
    Endpoint("POST", "/models/conversation", "AFS: chat (human/assistant/system/function), streaming or not",
             schema=am.AfsConversationRequest, dialect="afs", response=ar.AfsRecord, stream=ar.AfsRecord),
    Endpoint("POST", "/models/generate", "AFS: text generation, streaming or not", schema=am.AfsGenerateRequest,
             dialect="afs", response=ar.AfsRecord, stream=ar.AfsRecord,
             example={"model": "$MODEL", "inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}),
    Endpoint("POST", "/models/text_infilling", "AFS: fill the one <FILL_ME> (models with FIM tokens)",
             schema=am.AfsGenerateRequest, dialect="afs", response=ar.AfsRecord, stream=ar.AfsRecord),
    Endpoint("POST", "/models/embeddings", "AFS: embeddings (V1 inputs, V2 input/parameters)",
             schema=am.AfsEmbeddingsRequest,
             dialect="afs", response=ar.AfsEmbeddings),
    Endpoint("POST", "/models/rerank", "AFS: rerank [query, document] pairs or query + documents",
             schema=am.AfsRerankRequest, dialect="afs", response=ar.AfsRerank),
    Endpoint("GET", "/health", "Liveness: the facade process is up", public=True, response=_HEALTH),
    Endpoint("GET", "/ready", "Readiness: the engine reports SERVING", public=True, response=_HEALTH),
    Endpoint("GET", "/metrics", "Prometheus metrics (public with --public-metrics)", content_type="text/plain"),
    Endpoint("GET", "/docs", "This API's documentation (Swagger UI)", public=True, content_type="text/html"),
    Endpoint("GET", "/docs/swagger-ui-bundle.js", "Swagger UI's script (shipped in the package)", public=True,
             content_type="text/javascript"),
    Endpoint("GET", "/docs/swagger-ui.css", "Swagger UI's style sheet (shipped in the package)", public=True,
             content_type="text/css"),
    Endpoint("GET", "/openapi.json", "The OpenAPI document", public=True, response={"type": "object"}),
    Endpoint("GET", "/", "The chat page (the API key, when one is needed, is typed into it)", public=True,
             content_type="text/html"),
    Endpoint("GET", "/ui/chat.js", "The chat page's script", public=True, content_type="text/javascript"),
    Endpoint("GET", "/ui/chat.css", "The chat page's style sheet", public=True, content_type="text/css"),
    Endpoint("POST", "/debug/dump_event_trace", "Per-request event trace (needs --enable-tracing)",
             response={"type": "object", "required": ["object", "data"], "properties": {
                 "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}}}}),
)
PUBLIC_PATHS = frozenset(ep.path for ep in ENDPOINTS if ep.public)


def _models() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = [ar.ErrorResponse, ar.AfsError]
    for ep in ENDPOINTS:
        for m in (ep.schema, ep.response, ep.stream):
            if isinstance(m, type) and m not in seen:
                seen.append(m)
    return seen


def _schemas() -> tuple[dict, dict]:
    """(model → its $ref, the components' schemas). One mode for every model: a model's request
    and response shapes are the same here."""
    refs, defs = models_json_schema([(m, "validation") for m in _models()],
                                    ref_template="#/components/schemas/{model}")
    return {m: ref for (m, _), ref in refs.items()}, defs.get("$defs", {})


def _body(spec: Any, refs: dict) -> dict:
    return refs[spec] if isinstance(spec, type) else spec


def _operation(ep: Endpoint, refs: dict, model: str | None) -> dict:
    error = refs[ar.AfsError] if ep.dialect == "afs" else refs[ar.ErrorResponse]
    ok: dict = {"description": "OK"}
    if ep.response is not None:
        ok["content"] = {"application/json": {"schema": _body(ep.response, refs)}}
    else:
        ok["content"] = {ep.content_type: {"schema": {"type": "string"}}}
    if ep.stream is not None:
        # One event (OpenAPI 3.2's itemSchema): its data is the JSON of the event's schema, or
        # "[DONE]" at the end of an OpenAI chat or completion stream, or the dialect's error body
        # (an error after the stream began), or for AFS a ping's UTC time.
        data = [{"type": "string", "contentMediaType": "application/json", "contentSchema": refs[s]}
                for s in (ep.stream, ar.AfsError if ep.dialect == "afs" else ar.ErrorResponse)]
        last = {"type": "string", "pattern": r"^\d{4}-\d\d-\d\d"} if ep.dialect == "afs" else {"const": "[DONE]"}
        event = {"type": "object", "required": ["data"], "properties": {
            "data": {"anyOf": [last, *data]}, "event": {"type": "string"}}}
        ok["content"]["text/event-stream"] = {"itemSchema": event}
    op: dict = {"summary": ep.summary, "operationId": _operation_id(ep), "responses": {
        "200": ok, "default": {"description": "Error", "content": {"application/json": {"schema": error}}}}}
    if not ep.public:
        op["security"] = [{"bearer": []}, {"x_api_key": []}]
    if ep.schema is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _body(ep.schema, refs)}}}
        if ep.example is not None and model is not None:
            value = json.loads(json.dumps(ep.example).replace('"$MODEL"', json.dumps(model)))
            op["requestBody"]["content"]["application/json"]["examples"] = {"basic": {"value": value}}
    for name in ("model", "response_id"):
        if "{" + name + "}" in ep.path:
            param = {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            if name == "model" and model is not None:
                param["examples"] = {"served": {"value": model}}
            op["parameters"] = [param]
    return op


def _operation_id(ep: Endpoint) -> str:
    words = ep.path.strip("/").replace("{", "").replace("}", "").replace(".", "_").replace("-", "_")
    return ep.method.lower() + "_" + (words.replace("/", "_") or "root")


def openapi_document(title: str = "sluice", version: str = "0.1.0", model: str | None = None) -> dict:
    """``model``: a served model's name, which the request examples use (none without it)."""
    refs, defs = _schemas()
    paths: dict[str, dict] = {}
    for ep in ENDPOINTS:
        paths.setdefault(ep.path, {})[ep.method.lower()] = _operation(ep, refs, model)
    return {"openapi": "3.1.0", "info": {"title": title, "version": version,
                                         "description": "OpenAI-, MLC- and AFS-compatible REST API of sluice"},
            "paths": paths,
            "components": {"schemas": defs, "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x_api_key": {"type": "apiKey", "in": "header", "name": "X-API-KEY"}}}}


def docs_page() -> str:
    """Swagger UI over /openapi.json, and the endpoint table for readers without JavaScript."""
    rows = "\n".join(
        f"<tr><td><code>{ep.method}</code></td><td><code>{html.escape(ep.path)}</code></td>"
        f"<td>{html.escape(ep.summary)}</td><td>{'no' if ep.public else 'if keys are set'}</td></tr>"
        for ep in ENDPOINTS)
    config = json.dumps({"url": "/openapi.json", "dom_id": "#swagger-ui", "deepLinking": True})
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sluice API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<noscript><h1>sluice REST API</h1>
<p>OpenAI-compatible endpoints under <code>/v1</code>; the AFS (Formosa Foundation Model) API under
<code>/models</code>. Machine-readable: <a href="/openapi.json">/openapi.json</a>. Keys go in
<code>Authorization: Bearer &lt;key&gt;</code> or <code>X-API-KEY: &lt;key&gt;</code>.</p>
<table><tr><th>method</th><th>path</th><th>what</th><th>API key</th></tr>
{rows}
</table></noscript>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({config});</script>
</body></html>
"""
