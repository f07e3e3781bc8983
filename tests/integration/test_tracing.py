"""OpenTelemetry across the facade → engine hop: one chat request through the facade app and a
real engine server (the tiny random-weight Llama, in this process so that one in-memory exporter
sees both sides' spans, each side with its own tracer provider as in two processes) is one trace:
the facade's SERVER span for ``POST /v1/chat/completions`` and, as its child, the engine's
``sluice.engine/Generate`` span, which carries the request id and token counts. A request sent
without tracing on the facade gives the engine a root span of its own (no parent leaks in).
The unary RPCs are joined the same way (``/tokenize`` and ``/detokenize``: a ``sluice.engine/Tokenize``
and ``.../Detokenize`` span under the facade's), and a poll without a caller's trace (GetLoad,
ListModels) makes no span at all."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.client import AsyncEngineClient
from sluice.engine.llm import LLM
from sluice.engine.rpc.server import EngineServer, ServerConfig
from sluice.engine.rpc.tracing import Tracing
from sluice.http_facade.app import build_app
from sluice.http_facade.state import FacadeConfig
from tests.tiny_model import write_tiny_folder

pytestmark = pytest.mark.timeout(300)


def _tracing(exporter: InMemorySpanExporter, scope: str) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, scope)


async def test_one_chat_request_is_one_trace_with_facade_and_engine_spans(tmp_path):
    exporter = InMemorySpanExporter()
    core = LLM(str(write_tiny_folder(tmp_path / "tiny")), device="cpu").engine
    server = EngineServer(AsyncEngine(lambda: core), ServerConfig(port=0, grace_s=1.0),
                          tracing=_tracing(exporter, "sluice.engine"))
    port = await server.start()
    stop = asyncio.Event()
    running = asyncio.ensure_future(server.run_until(stop))
    await asyncio.wait_for(server.engine.wait_ready(), 120)
    traced = TestClient(TestServer(build_app(FacadeConfig(engine_addr=f"127.0.0.1:{port}"),
                                             tracing=_tracing(exporter, "sluice.facade"))))
    plain = TestClient(TestServer(build_app(FacadeConfig(engine_addr=f"127.0.0.1:{port}"))))
    await traced.start_server()
    await plain.start_server()
    try:
        model = (await (await traced.get("/v1/models")).json())["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 3,
                "ignore_eos": True}
        resp = await traced.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "traced-1"})
        assert resp.status == 200, await resp.text()
        spans = [s for s in exporter.get_finished_spans() if s.attributes.get("sluice.request_id", "").startswith(
            "traced-1")]
        facade = [s for s in spans if s.name == "POST /v1/chat/completions"]
        engine = [s for s in spans if s.name == "sluice.engine/Generate"]
        assert len(facade) == 1 and len(engine) == 1, [s.name for s in spans]
        (f,), (e,) = facade, engine
        assert f.kind == SpanKind.SERVER and f.parent is None
        assert e.context.trace_id == f.context.trace_id                      # one trace
        assert e.parent is not None and e.parent.span_id == f.context.span_id   # the engine's is the child
        assert e.attributes["sluice.request_id"] == "traced-1-0" and e.attributes["sluice.completion_tokens"] == 3
        assert f.attributes["http.response.status_code"] == 200 and f.end_time >= e.end_time
        resp = await plain.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "plain-1"})
        assert resp.status == 200
        (alone,) = [s for s in exporter.get_finished_spans() if s.attributes.get("sluice.request_id") == "plain-1-0"]
        assert alone.parent is None and alone.context.trace_id != f.context.trace_id
        for path, body, rpc in (("/tokenize", {"prompt": "w1 w2"}, "Tokenize"),
                                ("/detokenize", {"tokens": [3, 4]}, "Detokenize")):
            resp = await traced.post(path, json=body, headers={"X-Request-Id": f"unary-{rpc}"})
            assert resp.status == 200, await resp.text()
            (outer,) = [s for s in exporter.get_finished_spans()
                        if s.attributes.get("sluice.request_id") == f"unary-{rpc}"]
            inner = [s for s in exporter.get_finished_spans() if s.name == f"sluice.engine/{rpc}"]
            assert len(inner) == 1 and inner[0].kind == SpanKind.SERVER, [s.name for s in inner]
            assert inner[0].parent is not None and inner[0].parent.span_id == outer.context.span_id
            assert inner[0].context.trace_id == outer.context.trace_id
        before = len(exporter.get_finished_spans())
        async with AsyncEngineClient(f"127.0.0.1:{port}", timeout=30) as client:   # a router's polls
            assert (await client.load()) is not None and await client.list_models()
        assert len(exporter.get_finished_spans()) == before
    finally:
        await traced.close()
        await plain.close()
        stop.set()
        await asyncio.wait_for(running, 60)
