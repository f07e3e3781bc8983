"""The facade process's life cycle around its connections, over the fake engine:

* SIGTERM (``stop``) drains: the listener closes, new requests on open connections get 503, the
  requests in flight run on for the grace and finish normally if they can; after the grace each
  stream still open gets an error event and ends (it used to be cut by a kill, with no event);
* a connection that sends no complete request within the idle timeout is closed (idle, and
  headers dribbled a byte at a time: slowloris), and a body slower than the body timeout is a 408.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from sluice.http_facade.cli import serve_facade
from sluice.http_facade.state import FacadeConfig
from tests.unit.test_facade_fake_engine import MODEL, fake_engine  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Facade:
    def __init__(self, engine_port: int, grace_s: float, **config) -> None:
        self.port = _free_port()
        self.stop = asyncio.Event()
        self.config = FacadeConfig(engine_addr=f"127.0.0.1:{engine_port}", **config)
        self.task = asyncio.ensure_future(serve_facade(self.config, "127.0.0.1", self.port, self.stop,
                                                       grace_s=grace_s))

    async def started(self) -> None:
        for _ in range(200):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.02)
        raise AssertionError("the facade did not listen")

    async def open(self):
        return await asyncio.open_connection("127.0.0.1", self.port)


def _post(path: str, body: dict, keep_alive: bool = True) -> bytes:
    data = json.dumps(body).encode()
    conn = b"" if keep_alive else b"Connection: close\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n").encode() + conn + b"\r\n" + data


async def _read_head(reader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return int(head.split()[1]), head


async def _events_until_eof(reader, timeout: float) -> list[str]:
    raw = await asyncio.wait_for(reader.read(-1), timeout)
    return [line[6:] for line in raw.decode(errors="replace").split("\n") if line.startswith("data: ")]


SLOW = {"model": MODEL, "prompt": "slow", "stream": True}            # 1000 steps of 20 ms
SHORT = {"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True}


async def test_sigterm_drains_then_ends_open_streams_with_an_error_event(fake_engine):  # noqa: F811
    fake, engine_port = fake_engine
    facade = Facade(engine_port, grace_s=1.5)
    await facade.started()
    slow_r, slow_w = await facade.open()
    slow_w.write(_post("/v1/completions", SLOW, keep_alive=False))
    assert (await _read_head(slow_r))[0] == 200
    idle_r, idle_w = await facade.open()      # a keep-alive connection with a request behind it
    idle_w.write(_post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}))
    assert (await _read_head(idle_r))[0] == 200
    await asyncio.wait_for(idle_r.readuntil(b"}"), 5)

    t0 = time.monotonic()
    facade.stop.set()
    await asyncio.sleep(0.3)
    with pytest.raises(OSError):               # the listener is closed
        await facade.open()
    short_r, short_w = slow_r, slow_w
    events = await _events_until_eof(short_r, 10)
    ended = time.monotonic() - t0
    assert 1.4 <= ended < 4.0, ended
    assert len(events) > 20                    # it ran on during the grace
    last = json.loads(events[-1])
    assert last["error"]["code"] == "shutting_down" and "shutting down" in last["error"]["message"]
    await asyncio.wait_for(facade.task, 10)
    assert time.monotonic() - t0 < 6.0
    assert fake.active == set()                # the engine stream was cancelled
    for w in (slow_w, idle_w):
        w.close()


async def test_requests_that_finish_within_the_grace_finish_normally(fake_engine):  # noqa: F811
    _, engine_port = fake_engine
    facade = Facade(engine_port, grace_s=5.0)
    await facade.started()
    reader, writer = await facade.open()
    writer.write(_post("/v1/completions", SHORT, keep_alive=False))
    assert (await _read_head(reader))[0] == 200
    facade.stop.set()
    events = await _events_until_eof(reader, 10)
    assert events[-1] == "[DONE]"
    await asyncio.wait_for(facade.task, 10)
    writer.close()


async def test_new_requests_on_an_open_connection_get_503_while_draining(fake_engine):  # noqa: F811
    _, engine_port = fake_engine
    facade = Facade(engine_port, grace_s=2.0)
    await facade.started()
    slow_r, slow_w = await facade.open()
    slow_w.write(_post("/v1/completions", SLOW, keep_alive=False))     # keeps the drain going
    assert (await _read_head(slow_r))[0] == 200
    r, w = await facade.open()
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, head = await _read_head(r)
    assert status == 200
    await asyncio.wait_for(r.readuntil(b"}"), 5)
    facade.stop.set()
    await asyncio.sleep(0.2)
    w.write(_post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))
    try:
        status, head = await _read_head(r)
        assert status == 503
    except (asyncio.IncompleteReadError, ConnectionError):
        pass                                   # or aiohttp closed the idle connection first
    await asyncio.wait_for(facade.task, 10)
    for x in (w, slow_w):
        x.close()


async def test_idle_and_slowloris_connections_are_closed(fake_engine):  # noqa: F811
    _, engine_port = fake_engine
    facade = Facade(engine_port, grace_s=0.5, idle_timeout_s=1.0)
    await facade.started()
    idle_r, idle_w = await facade.open()
    slow_r, slow_w = await facade.open()

    async def dribble():
        for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200:
            slow_w.write(bytes([b]))
            await asyncio.sleep(0.05)

    dribbler = asyncio.ensure_future(dribble())
    t0 = time.monotonic()
    assert await asyncio.wait_for(idle_r.read(-1), 5) == b""
    assert await asyncio.wait_for(slow_r.read(-1), 5) == b""
    assert time.monotonic() - t0 < 3.0
    dribbler.cancel()
    facade.stop.set()
    await asyncio.wait_for(facade.task, 10)
    for w in (idle_w, slow_w):
        w.close()


async def test_a_slow_body_is_a_408(fake_engine):  # noqa: F811
    fake, engine_port = fake_engine
    facade = Facade(engine_port, grace_s=0.5, body_timeout_s=1.0)
    await facade.started()
    reader, writer = await facade.open()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")
    t0 = time.monotonic()
    status, _ = await _read_head(reader)
    assert status == 408 and time.monotonic() - t0 < 3.0
    assert await asyncio.wait_for(reader.read(-1), 5)          # the error body, then the close
    assert fake.requests == []
    facade.stop.set()
    await asyncio.wait_for(facade.task, 10)
    writer.close()
