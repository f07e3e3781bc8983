"""Operations over the scripted engine: ``--served-model-name`` aliases (listed, accepted, named in
answers and metrics; the model's own name refused), metrics labelled by model, ``/metrics`` open
or key-guarded, ``X-Request-Id`` (accepted, sent as the engine request id, returned; made up when
absent; a malformed one a 400 in each dialect's shape), the JSON request log line, and the
command-line flags that set them."""
from __future__ import annotations

import json
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.engine.cli import _build_parser
from sluice.http_facade.app import build_app
from sluice.http_facade.auth import AuthPolicy, PUBLIC_PATHS
from sluice.http_facade.options import facade_config, operations_flags
from sluice.http_facade.request_context import request_log
from sluice.http_facade.state import FacadeConfig
from tests.unit.test_facade_fake_engine import MODEL, fake_engine  # noqa: F401 - fixture

KEY = "sk-ops"


async def _client(port: int, **config) -> TestClient:
    client = TestClient(TestServer(build_app(FacadeConfig(engine_addr=f"127.0.0.1:{port}", **config)),
                                   handler_cancellation=True))
    await client.start_server()
    return client


def _chat(model: str = MODEL, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


async def test_served_model_names_are_listed_accepted_and_labelled(fake_engine):  # noqa: F811
    fake, port = fake_engine
    client = await _client(port, served_model_names=("team-llm", "gpt-4o-mini"))
    try:
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["team-llm", "gpt-4o-mini"]
        body = await (await client.post("/v1/chat/completions", json=_chat("gpt-4o-mini"))).json()
        assert body["model"] == "gpt-4o-mini" and body["choices"][0]["message"]["content"] == "c0w0 c0w1 "
        resp = await client.post("/v1/responses", json={"model": "team-llm", "input": "hi", "max_output_tokens": 1})
        assert (await resp.json())["model"] == "team-llm"
        resp = await client.post("/v1/chat/completions", json=_chat(MODEL))
        assert resp.status == 404
        err = (await resp.json())["error"]
        assert err["param"] == "model" and "team-llm, gpt-4o-mini" in err["message"]
        metrics = await (await client.get("/metrics")).text()
        assert 'sluice_generation_tokens_total{model="gpt-4o-mini"} 2.0' in metrics
        assert 'sluice_generation_tokens_total{model="team-llm"} 1.0' in metrics
    finally:
        await client.close()


async def test_metrics_key_guarded_by_default_and_open_by_flag(fake_engine):  # noqa: F811
    _, port = fake_engine
    guarded = await _client(port, auth=AuthPolicy(keys=(KEY,)))
    public = await _client(port, auth=AuthPolicy(keys=(KEY,), public_paths=PUBLIC_PATHS | {"/metrics"}))
    try:
        assert (await guarded.get("/metrics")).status == 401
        assert (await guarded.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})).status == 200
        assert (await public.get("/metrics")).status == 200
        assert (await public.get("/v1/models")).status == 401      # only /metrics opened
    finally:
        await guarded.close()
        await public.close()


async def test_x_request_id_is_the_engine_request_id_and_comes_back(fake_engine):  # noqa: F811
    fake, port = fake_engine
    client = await _client(port)
    try:
        resp = await client.post("/v1/chat/completions", json=_chat(), headers={"X-Request-Id": "trace-42.a:b_c"})
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "trace-42.a:b_c"
        assert fake.requests[-1].request_id == "trace-42.a:b_c-0"
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1,
                                                          "stream": True}, headers={"X-Request-Id": "multi"})
        await resp.read()
        assert resp.headers["X-Request-Id"] == "multi"
        assert sorted(r.request_id for r in fake.requests[-2:]) == ["multi-0", "multi-1"]
        resp = await client.post("/models/generate", json={"model": MODEL, "inputs": "hi"},
                                 headers={"X-Request-Id": "afs-1"})
        assert resp.status == 200 and fake.requests[-1].request_id == "afs-1-0"
        resp = await client.get("/v1/models")
        made = resp.headers["X-Request-Id"]
        assert made.startswith("req-") and len(made) == 36
        resp = await client.get("/v1/nothing-here")
        assert resp.status == 404 and resp.headers["X-Request-Id"].startswith("req-")
    finally:
        await client.close()


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "é"])
async def test_a_malformed_x_request_id_is_a_400_in_each_dialect(fake_engine, bad):  # noqa: F811
    fake, port = fake_engine
    client = await _client(port)
    try:
        resp = await client.post("/v1/chat/completions", json=_chat(), headers={"X-Request-Id": bad})
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["param"] == "X-Request-Id" and "1 to 128 characters" in err["message"]
        resp = await client.post("/models/generate", json={"model": MODEL, "inputs": "hi"},
                                 headers={"X-Request-Id": bad})
        body = await resp.json()
        assert resp.status == 400 and body["param"] == "X-Request-Id" and "1 to 128" in body["detail"]
        assert not fake.requests
    finally:
        await client.close()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def test_json_request_log_one_line_per_request_with_timings(fake_engine):  # noqa: F811
    _, port = fake_engine
    lines = _Lines()
    request_log.addHandler(lines)
    try:
        client = await _client(port, request_log="json")
        try:
            resp = await client.post("/v1/chat/completions", json=_chat(max_tokens=3, stream=True),
                                     headers={"X-Request-Id": "log-1"})
            await resp.read()
            await client.post("/v1/chat/completions", json={"model": MODEL})
        finally:
            await client.close()
        quiet = await _client(port)
        try:
            await quiet.get("/v1/models")
        finally:
            await quiet.close()
    finally:
        request_log.removeHandler(lines)
    assert len(lines.lines) == 2                                   # the third app logs nothing
    # the stream's line is written once its handler returns, which may follow the client's EOF
    first, second = sorted((json.loads(line) for line in lines.lines), key=lambda e: e["status"])
    assert first["request_id"] == "log-1" and first["status"] == 200 and first["outcome"] == "ok"
    assert first["route"] == "/v1/chat/completions" and first["model"] == MODEL
    assert first["prompt_tokens"] == 1 and first["completion_tokens"] == 3
    assert 0 <= first["ttft_s"] <= first["duration_s"] and first["tokens_per_s"] > 0
    assert second["status"] == 400 and second["outcome"] == "error" and "ttft_s" not in second


def test_flags_set_the_operations_config():
    parser = _build_parser()
    args = parser.parse_args(["facade", "--engine", "127.0.0.1:1", "--served-model-name", "a", "b",
                              "--public-metrics", "--request-log", "json"])
    config = facade_config(args, args.engine)
    assert config.served_model_names == ("a", "b") and config.request_log == "json"
    assert "/metrics" in config.auth.public_paths
    plain = facade_config(parser.parse_args(["facade", "--engine", "127.0.0.1:1"]), ["127.0.0.1:1"])
    assert "/metrics" not in plain.auth.public_paths and plain.served_model_names == ()
    serve = parser.parse_args(["serve", "m", "--served-model-name", "x", "--request-log", "json"])
    assert operations_flags(serve) == ["--served-model-name", "x", "--request-log", "json"]



@pytest.mark.oracle   # needs the dev extra's OpenTelemetry (the otel extra)
def test_the_otlp_flag_reaches_the_config_and_both_processes():
    parser = _build_parser()
    args = parser.parse_args(["facade", "--engine", "127.0.0.1:1", "--otlp-traces-endpoint",
                              "http://127.0.0.1:4318/v1/traces"])
    assert facade_config(args, args.engine).otlp_traces_endpoint.endswith("/v1/traces")
    from sluice.http_facade.supervisor import build_plan
    traced = build_plan(parser.parse_args(["serve", "m", "--otlp-traces-endpoint", "http://c:4318/v1/traces",
                                           "--public-metrics"]))
    for cmd in (traced.engines[0].cmd, traced.facade_cmd):      # both sides export their spans
        assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == "http://c:4318/v1/traces"
    assert "--public-metrics" in traced.facade_cmd and "--public-metrics" not in traced.engines[0].cmd


def test_bad_operations_flags_name_the_flag(monkeypatch, capsys):
    parser = _build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["facade", "--engine", "127.0.0.1:1", "--request-log", "xml"])
    assert "--request-log" in capsys.readouterr().err
    with pytest.raises(ValueError, match="served_model_names: names must be non-empty"):
        FacadeConfig(served_model_names=("",))
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("opentelemetry")
                        else real(name, *a))
    args = parser.parse_args(["facade", "--engine", "127.0.0.1:1", "--otlp-traces-endpoint", "http://x:4318"])
    with pytest.raises(ValueError, match=r"--otlp-traces-endpoint: tracing needs OpenTelemetry: pip install"):
        facade_config(args, args.engine)
