"""The OpenAPI document (``/openapi.json``) and the ``/docs`` page that lists the endpoints.

Both are built from ``ENDPOINTS``, the same table ``app.py`` registers routes from, so that the
documentation cannot drift from what is served.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"},
    "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number"}, "top_k": {"type": "integer"}, "min_p": {"type": "number"},
    "n": {"type": "integer", "minimum": 1}, "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "presence_penalty": {"type": "number"}, "frequency_penalty": {"type": "number"},
    "repetition_penalty": {"type": "number"},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number"}},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"}, "ignore_eos": {"type": "boolean"}, "min_tokens": {"type": "integer"},
}
_CHAT = {"type": "object", "required": ["model", "messages"], "properties": {
    "model": {"type": "string"},
    "messages": {"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "name": {"type": "string"}, "tool_call_id": {"type": "string"}}}},
    "max_completion_tokens": {"type": "integer"}, "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, **_SAMPLING}}
_COMPLETION = {"type": "object", "required": ["model", "prompt"], "properties": {
    "model": {"type": "string"},
    "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                         {"type": "array", "items": {"type": "integer"}},
                         {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]},
    "logprobs": {"type": "integer", "minimum": 0, "maximum": 5}, "echo": {"type": "boolean"}, **_SAMPLING}}
_EMBED_INPUT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                          {"type": "array", "items": {"type": "integer"}},
                          {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]}
_EMBED = {"type": "object", "required": ["model", "input"], "properties": {
    "model": {"type": "string"}, "input": _EMBED_INPUT,
    "encoding_format": {"enum": ["float", "base64"]}, "dimensions": {"type": "integer", "minimum": 1}}}

_TEXTS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_RERANK = {"type": "object", "required": ["model", "query", "documents"], "properties": {
    "model": {"type": "string"}, "query": {"type": "string"},
    "documents": {"type": "array", "items": {"oneOf": [
        {"type": "string"}, {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}]}},
    "top_n": {"type": "integer", "minimum": 1}, "return_documents": {"type": "boolean"}}}
_SCORE = {"type": "object", "required": ["model", "text_1", "text_2"], "properties": {
    "model": {"type": "string"}, "text_1": _TEXTS, "text_2": _TEXTS}}
_TOKENIZE = {"type": "object", "properties": {
    "model": {"type": "string"}, "prompt": {"type": "string"}, "content": {"type": "string"},
    "messages": _CHAT["properties"]["messages"], "add_special_tokens": {"type": "boolean"},
    "add_special": {"type": "boolean"}, "add_generation_prompt": {"type": "boolean"}}}
_DETOKENIZE = {"type": "object", "required": ["tokens"], "properties": {
    "model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "skip_special_tokens": {"type": "boolean"}}}
_RESPONSES = {"type": "object", "required": ["model", "input"], "properties": {
    "model": {"type": "string"}, "instructions": {"type": "string"},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    "previous_response_id": {"type": "string"}, "tools": {"type": "array", "items": {"type": "object"}},
    "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"}]},
    "parallel_tool_calls": {"type": "boolean"}, "text": {"type": "object"},
    "max_output_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number"},
    "top_p": {"type": "number"}, "stream": {"type": "boolean"}, "store": {"type": "boolean"},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}}, "user": {"type": "string"}}}

# ---- AFS (/models/...): see http_facade/routes_afs.py and afs_errors.py
_AFS_ERROR = {"type": "object", "properties": {
    "status_code": {"type": "integer"}, "error": {"type": "string"}, "detail": {"type": "string"},
    "param": {"type": ["string", "null"]}}}
_AFS_PARAMS = {"type": "object", "properties": {
    "max_new_tokens": {"type": "integer", "minimum": 1, "default": 350},
    "temperature": {"type": "number", "exclusiveMinimum": 0, "default": 1.0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
    "top_k": {"type": "integer", "minimum": 1, "maximum": 100, "default": 50},
    "frequence_penalty": {"type": "number", "exclusiveMinimum": 0, "default": 1.0},
    "stop_sequences": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "show_probabilities": {"type": "boolean", "default": False},
    "seed": {"type": ["integer", "null"], "minimum": 0, "default": 42}}}
_AFS_CONVERSATION = {"type": "object", "required": ["model", "messages"], "properties": {
    "model": {"type": "string"},
    "messages": {"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "human", "user", "assistant", "function"]},
        "content": {"type": ["string", "null"]}, "name": {"type": "string"},
        "function_call": {"type": "object"}}}},
    "functions": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    "parameters": _AFS_PARAMS, "stream": {"type": "boolean"}}}
_AFS_GENERATE = {"type": "object", "required": ["model", "inputs"], "properties": {
    "model": {"type": "string"}, "inputs": {"type": "string"}, "parameters": _AFS_PARAMS,
    "stream": {"type": "boolean"}}}
_AFS_EMBED = {"type": "object", "required": ["model"], "properties": {
    "model": {"type": "string"}, "inputs": {"type": "array", "items": {"type": "string"}}, "input": _EMBED_INPUT,
    "encoding_format": {"enum": ["float", "base64"]}, "dimensions": {"type": "integer", "minimum": 0},
    "parameters": {"type": "object", "properties": {"input_type": {"enum": ["query", "document"]},
                                                    "normalize": {"type": "boolean", "default": True}}}}}
_AFS_RERANK = {"type": "object", "required": ["model"], "properties": {
    "model": {"type": "string"},
    "inputs": {"type": "array", "items": {"type": "array", "items": {"type": "string"}, "minItems": 2,
                                          "maxItems": 2}},
    "query": {"type": "string"}, "documents": {"type": "array", "items": {"type": "string"}},
    "parameters": {"type": "object", "properties": {"top_n": {"type": "integer", "minimum": 1, "default": 3}}}}}


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    summary: str
    public: bool = False              # no API key needed
    schema: dict | None = None        # the JSON request body, for POST
    dialect: str = "openai"           # "afs": X-API-KEY security and the AFS error body


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/v1/models", "List the served models"),
    Endpoint("GET", "/v1/models/{model}", "Describe one served model"),
    Endpoint("POST", "/v1/chat/completions", "Chat completion, streaming (SSE) or not", schema=_CHAT),
    Endpoint("POST", "/v1/completions", "Text completion, streaming (SSE) or not", schema=_COMPLETION),
    Endpoint("POST", "/v1/embeddings", "Embeddings (models with the embeddings capability)", schema=_EMBED),
    Endpoint("POST", "/v1/responses", "OpenAI Responses API: create a response, streaming (SSE events) or not",
             schema=_RESPONSES),
    Endpoint("GET", "/v1/responses/{response_id}", "Retrieve a stored response"),
    Endpoint("DELETE", "/v1/responses/{response_id}", "Delete a stored response"),
    Endpoint("POST", "/v1/rerank", "Rerank documents against a query (Jina / Cohere shape)", schema=_RERANK),
    Endpoint("POST", "/rerank", "Rerank documents against a query (Jina / Cohere shape)", schema=_RERANK),
    Endpoint("POST", "/v1/score", "Score text pairs (vLLM shape: text_1 against text_2)", schema=_SCORE),
    Endpoint("POST", "/tokenize", "Tokenize a text or chat messages (vLLM / llama.cpp shape)", schema=_TOKENIZE),
    Endpoint("POST", "/detokenize", "Token ids back to text (vLLM / llama.cpp shape)", schema=_DETOKENIZE),
    Endpoint("POST", "/models/conversation", "AFS: chat (human/assistant/system/function), streaming or not",
             schema=_AFS_CONVERSATION, dialect="afs"),
    Endpoint("POST", "/models/generate", "AFS: text generation, streaming or not", schema=_AFS_GENERATE,
             dialect="afs"),
    Endpoint("POST", "/models/text_infilling", "AFS: fill the one <FILL_ME> (models with FIM tokens)",
             schema=_AFS_GENERATE, dialect="afs"),
    Endpoint("POST", "/models/embeddings", "AFS: embeddings (V1 inputs, V2 input/parameters)", schema=_AFS_EMBED,
             dialect="afs"),
    Endpoint("POST", "/models/rerank", "AFS: rerank [query, document] pairs or query + documents",
             schema=_AFS_RERANK, dialect="afs"),
    Endpoint("GET", "/health", "Liveness: the facade process is up", public=True),
    Endpoint("GET", "/ready", "Readiness: the engine reports SERVING", public=True),
    Endpoint("GET", "/metrics", "Prometheus metrics"),
    Endpoint("GET", "/docs", "This page"),
    Endpoint("GET", "/openapi.json", "The OpenAPI document"),
    Endpoint("POST", "/debug/dump_event_trace", "Per-request event trace (needs --enable-tracing)"),
)


def openapi_document(title: str = "sluice", version: str = "0.1.0") -> dict:
    paths: dict[str, dict] = {}
    for ep in ENDPOINTS:
        error = _AFS_ERROR if ep.dialect == "afs" else _ERROR
        op: dict = {"summary": ep.summary, "responses": {
            "200": {"description": "OK"},
            "default": {"description": "Error", "content": {"application/json": {"schema": error}}}}}
        if not ep.public:
            op["security"] = [{"bearer": []}, {"x_api_key": []}]
        if ep.schema is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ep.schema}}}
        for name in ("model", "response_id"):
            if "{" + name + "}" in ep.path:
                op["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(ep.path, {})[ep.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": version,
                                         "description": "OpenAI-, MLC- and AFS-compatible REST API of sluice"},
            "paths": paths,
            "components": {"securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x_api_key": {"type": "apiKey", "in": "header", "name": "X-API-KEY"}}}}


def docs_page() -> str:
    rows = "\n".join(
        f"<tr><td><code>{ep.method}</code></td><td><code>{html.escape(ep.path)}</code></td>"
        f"<td>{html.escape(ep.summary)}</td><td>{'no' if ep.public else 'if keys are set'}</td></tr>"
        for ep in ENDPOINTS)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>sluice API</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:4px 12px;text-align:left}}</style></head>
<body><h1>sluice REST API</h1>
<p>OpenAI-compatible endpoints under <code>/v1</code>; the AFS (Formosa Foundation Model) API under
<code>/models</code>. Machine-readable: <a href="/openapi.json">/openapi.json</a>. Keys go in
<code>Authorization: Bearer &lt;key&gt;</code> or <code>X-API-KEY: &lt;key&gt;</code> (<code>X-API-HOST</code>
is ignored). AFS errors are <code>{"status_code", "error", "detail", "param"}</code>.</p>
<table><tr><th>method</th><th>path</th><th>what</th><th>API key</th></tr>
{rows}
</table></body></html>
"""
