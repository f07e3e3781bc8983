"""Several engines behind one facade (``EnginePool``), over three scripted in-process engines.

Proves: requests whose prompts share a leading text land on one engine (its prefix cache), and
distinct prompts are spread evenly; a burst on one prefix spills to the others when its engine
is overloaded; round robin takes the engines in turn; requests go only to the engines serving
their model (``/v1/models`` lists each model once); an engine that stops mid-stream ends its
streams with an error event while the other streams finish and ``/ready`` stays 200, new
requests (even ones routed to it before the health watch notices) are served by the others, and
it is taken back once it serves again; ``/metrics`` has each engine's gauges.
"""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http_facade.app import build_app
from sluice.http_facade.engine_pool import PREFIX_CHUNK, prefix_hashes
from sluice.http_facade.state import STATE_KEY, FacadeConfig
from tests.unit.test_facade_app import _sse
from tests.unit.test_facade_fake_engine import MODEL, start_fake_engine

SYSTEM = "You are the harbour master's assistant. " * 8          # > PREFIX_CHUNK characters


@pytest.fixture
async def engines():
    started = [await start_fake_engine() for _ in range(3)]
    yield started
    for server, _, _ in started:
        await server.stop(grace=None)


async def _client(engines, **config) -> TestClient:
    addrs = tuple(f"127.0.0.1:{port}" for _, _, port in engines)
    app = build_app(FacadeConfig(engine_addrs=addrs, **config))
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    return client


def _chat(question: str, system: str | None = SYSTEM, model: str = MODEL, **kw) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"model": model, "messages": messages, "max_tokens": 3, **kw}


def _counts(engines) -> list[int]:
    return [len(fake.requests) for _, fake, _ in engines]


async def test_shared_prefixes_go_to_one_engine_and_distinct_prompts_spread(engines):
    assert len(SYSTEM) > PREFIX_CHUNK and len(prefix_hashes(SYSTEM.encode())) >= 2
    client = await _client(engines)
    try:
        for i in range(9):
            resp = await client.post("/v1/chat/completions", json=_chat(f"When is high tide on day {i}?"))
            assert resp.status == 200, await resp.text()
        assert sorted(_counts(engines)) == [0, 0, 9]
        before = _counts(engines)
        for i in range(9):
            resp = await client.post("/v1/chat/completions", json=_chat(f"distinct question {i}", system=None))
            assert resp.status == 200
        assert [b - a for a, b in zip(before, _counts(engines))] == [3, 3, 3]
    finally:
        await client.close()


async def test_a_burst_on_one_prefix_spills_to_the_other_engines(engines):
    client = await _client(engines)
    try:
        async def one(i: int) -> int:
            resp = await client.post("/v1/chat/completions", json=_chat(f"paced {i}", max_tokens=20))
            return resp.status

        assert await asyncio.gather(*(one(i) for i in range(18))) == [200] * 18
        counts = _counts(engines)
        assert sum(counts) == 18 and max(counts) < 18 and min(counts) >= 1, counts
    finally:
        await client.close()


async def test_round_robin_takes_the_engines_in_turn(engines):
    client = await _client(engines, routing="round_robin")
    try:
        for i in range(6):
            assert (await client.post("/v1/chat/completions", json=_chat(f"q{i}"))).status == 200
        assert _counts(engines) == [2, 2, 2]
    finally:
        await client.close()


async def test_requests_go_to_the_engines_serving_their_model(engines):
    engines[2][1].model_name = "other-model"
    client = await _client(engines)
    try:
        names = sorted(m["id"] for m in (await (await client.get("/v1/models")).json())["data"])
        assert names == [MODEL, "other-model"]
        for i in range(4):
            assert (await client.post("/v1/chat/completions", json=_chat(f"x{i}", model="other-model"))).status == 200
            assert (await client.post("/v1/chat/completions", json=_chat(f"y{i}", system=None))).status == 200
        assert _counts(engines)[2] == 4 and sum(_counts(engines)[:2]) == 4
        resp = await client.post("/v1/chat/completions", json=_chat("z", model="missing-model"))
        assert resp.status == 404 and "missing-model" in (await resp.json())["error"]["message"]
    finally:
        await client.close()


async def test_a_stopped_engine_ends_its_streams_and_the_rest_is_served(engines):
    client = await _client(engines)
    pool = client.app[STATE_KEY].link
    try:
        async def stream(i: int):
            resp = await client.post("/v1/chat/completions",
                                     json=_chat(f"paced {i}", system=None, max_tokens=40, stream=True))
            assert resp.status == 200
            return await _sse(resp)

        tasks = [asyncio.ensure_future(stream(i)) for i in range(6)]
        await asyncio.sleep(0.3)                               # every stream has begun
        victim_server, victim, victim_port = engines[1]
        on_victim = len(victim.requests)
        assert on_victim == 2
        await victim_server.stop(grace=None)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        errors = [r for r in results if any("error" in e for e in r if isinstance(e, dict))]
        finished = [r for r in results if r[-1] == "[DONE]" and not any("error" in e for e in r if isinstance(e, dict))]
        assert len(errors) == on_victim and len(finished) == 6 - on_victim
        ready = await client.get("/ready")
        assert ready.status == 200
        states = {e["engine"]: e["serving"] for e in (await ready.json())["engines"]}
        assert states[f"127.0.0.1:{victim_port}"] is False and sum(states.values()) == 2
        # Routed before the watch noticed, or after: every new request is served by the others.
        for i in range(6):
            resp = await client.post("/v1/chat/completions", json=_chat(f"after {i}", system=None))
            assert resp.status == 200, await resp.text()
        assert len(victim.requests) == on_victim
        assert not next(e for e in pool.engines if e.address.endswith(f":{victim_port}")).up
        metrics = await (await client.get("/metrics")).text()
        assert f'sluice_engine_serving{{engine="127.0.0.1:{victim_port}"}} 0.0' in metrics
        assert metrics.count("sluice_engine_routed_requests{") == 3
    finally:
        await client.close()


async def test_an_engine_that_serves_again_is_taken_back(engines):
    from sluice.http_facade.engine_pool import EngineState

    client = await _client(engines)
    pool = client.app[STATE_KEY].link
    try:
        state: EngineState = pool.engines[0]
        pool._mark_down(state, "test")
        assert not state.up
        await pool.check_all()                                 # what the watch does every second
        assert state.up
    finally:
        await client.close()


def test_prefix_hashes_grow_by_doubling_and_short_prompts_hash_whole():
    key = b"a" * (PREFIX_CHUNK * 5)
    assert len(prefix_hashes(key)) == 3                        # 128, 256, 512 of 640 bytes
    assert len(prefix_hashes(b"short")) == 1 and prefix_hashes(b"") == []
    assert prefix_hashes(key)[0] == prefix_hashes(key[:PREFIX_CHUNK] + b"different tail")[0]
    assert json.dumps(FacadeConfig(engine_addrs=("a:1", "b:2")).engines) == '["a:1", "b:2"]'
    with pytest.raises(ValueError, match="named twice"):
        FacadeConfig(engine_addrs=("a:1", "a:1"))
