"""A client that cancels mid-stream, or whose deadline passes, has its request aborted and its KV
blocks freed: GetLoad returns to the idle baseline (nothing running or waiting, no block in use).
100 cancels in a loop (10 waves of 10 concurrent streams), at different points of the request's
life, leak nothing."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from sluice.engine.client import AsyncEngineClient, EngineClient, EngineRpcError
from tests.integration.conftest import wait_for_idle

pytestmark = pytest.mark.slow

LONG = dict(max_tokens=2000, ignore_eos=True, temperature=0.0)


def _assert_idle(client: EngineClient) -> None:
    load = wait_for_idle(client)
    assert (load.num_running, load.num_waiting, load.kv_blocks_used, load.num_in_flight) == (0, 0, 0, 0), load
    assert load.kv_blocks_total > 0


def test_cancel_mid_stream_frees_the_blocks(client: EngineClient) -> None:
    _assert_idle(client)
    stream = client.generate("Tell me everything about rivers.", **LONG)
    got = [next(stream) for _ in range(3)]
    assert all(not d.finished for d in got)
    busy = client.load()
    assert busy.num_running == 1 and busy.kv_blocks_used > 0
    stream.cancel()
    assert list(stream) == []    # a cancelled stream just ends
    _assert_idle(client)


def test_deadline_expiry_aborts_the_request(client: EngineClient) -> None:
    _assert_idle(client)
    stream = client.generate("Describe the sea at length.", timeout=1.5, **LONG)
    with pytest.raises(EngineRpcError) as info:
        for _ in stream:
            pass
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    _assert_idle(client)


async def _cancel_one(client: AsyncEngineClient, wanted: int) -> None:
    """Cancel a stream after ``wanted`` deltas (0: before any output arrives)."""
    stream = client.generate("Wind:", **LONG)
    if wanted:
        seen = 0
        async for _ in stream:
            seen += 1
            if seen >= wanted:
                break
    stream.cancel()


async def _cancel_many(target: str, waves: int, per_wave: int) -> int:
    """``waves`` rounds of ``per_wave`` concurrent streams, each cancelled at a different point of
    its life (queued, after its first token, after two), so the engine batches them."""
    async with AsyncEngineClient(target, timeout=60.0) as client:
        for wave in range(waves):
            await asyncio.gather(*(_cancel_one(client, (wave + i) % 3) for i in range(per_wave)))
    return waves * per_wave


def test_100_cancels_leave_nothing_behind(client: EngineClient) -> None:
    _assert_idle(client)
    assert asyncio.run(_cancel_many(client.target, waves=10, per_wave=10)) == 100
    _assert_idle(client)
    # The engine still serves after all that.
    assert client.generate("Hi", max_tokens=2, ignore_eos=True).collect()[0].finish_reason == "length"
