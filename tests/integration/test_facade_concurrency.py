"""32 concurrent streaming chat clients (the ``openai`` SDK's ``AsyncOpenAI``) against a real facade
over a real engine (smollm2, CPU, float32) configured to run 32 sequences at once: every stream
finishes with one final chunk and its usage; each stream's concatenated text, finish reason and
token count equal the offline API's (``LLM.chat`` in this process, same model, engine settings,
prompt, seed and sampling parameters); and afterwards the engine is idle (GetLoad: nothing
running, waiting or in flight, no KV block in use).

The session engine of conftest.py runs 16 sequences, so this module starts its own engine with
the same settings but ``max_num_sequence=32``."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest
from openai import AsyncOpenAI

from sluice.engine.client import EngineClient
from sluice.engine.overrides import parse_overrides
from tests.integration.conftest import MAIN_OVERRIDES, launch_engine, wait_for_idle, wait_serving
from tests.integration.test_facade_http import KEY, MODEL, launch_facade

pytestmark = pytest.mark.slow

CLIENTS = 32
MAX_TOKENS = 8
TEMPERATURE = 0.8
SUBJECTS = ["apples", "rivers", "owls", "clocks", "maps", "bread", "storms", "glass", "bees", "ships", "salt",
            "moss", "kites", "wolves", "tea", "bells", "caves", "frost", "silk", "drums", "lamps", "reeds",
            "foxes", "tides", "ink", "hills", "coins", "ferns", "snow", "looms", "crows", "dunes"]
OVERRIDES = {**parse_overrides(MAIN_OVERRIDES), "max_num_sequence": CLIENTS, "dtype": "float32"}


def _overrides_text() -> str:
    return ";".join(f"{k}={v}" for k, v in OVERRIDES.items())


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {SUBJECTS[i]}."}]


def _seed(i: int) -> int:
    return 1000 + 17 * i


@dataclass
class Streamed:
    text: str
    finish_reasons: list[str]
    completion_tokens: int


@pytest.fixture(scope="module")
def wide_facade(tmp_path_factory):
    """An engine that admits all 32 clients at once, and a facade in front of it."""
    logs = tmp_path_factory.mktemp("wide")
    engine = launch_engine(logs / "engine.log", "--mode", "local", "--overrides", _overrides_text())
    try:
        wait_serving(engine)
        facade = launch_facade(engine.target, logs / "facade.log")
        try:
            yield engine, facade
        finally:
            assert facade.stop() == 0
    finally:
        engine.stop()


async def _stream_all(url: str) -> list[Streamed]:
    async with AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=90) as sdk:
        async def one(i: int) -> Streamed:
            stream = await sdk.chat.completions.create(
                model=MODEL, messages=_messages(i), max_tokens=MAX_TOKENS, temperature=TEMPERATURE,
                seed=_seed(i), stream=True, stream_options={"include_usage": True})
            pieces, finishes, tokens = [], [], -1
            async for chunk in stream:
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                    if choice.finish_reason:
                        finishes.append(choice.finish_reason)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return Streamed("".join(pieces), finishes, tokens)

        return list(await asyncio.gather(*(one(i) for i in range(CLIENTS))))


def _watch_running(target: str, stop: threading.Event, seen: dict) -> None:
    """Record the most sequences GetLoad ever reported running, or the error that ended the watch.
    The deadline is generous: a GetLoad waits for the engine's current step on this shared CPU."""
    try:
        with EngineClient(target, timeout=120) as client:
            while not stop.is_set():
                seen["peak"] = max(seen["peak"], client.load().num_running)
                stop.wait(0.05)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        seen["error"] = exc


def _offline() -> list:
    from sluice.engine.llm import LLM
    from sluice.engine.overrides import build_engine_config
    from sluice.engine.sampling_params import SamplingParams

    llm = LLM(config=build_engine_config(MODEL, mode="local", overrides=OVERRIDES, device="cpu"))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=_seed(i)) for i in range(CLIENTS)]
    return llm.chat([_messages(i) for i in range(CLIENTS)], params)


def test_32_concurrent_streams_finish_equal_the_offline_api_and_leave_the_engine_idle(wide_facade):
    engine, facade = wide_facade
    stop, seen = threading.Event(), {"peak": 0, "error": None}
    watcher = threading.Thread(target=_watch_running, args=(engine.target, stop, seen), daemon=True)
    watcher.start()
    try:
        streamed = asyncio.run(_stream_all(facade.url))
    finally:
        stop.set()
        watcher.join(15)

    assert len(streamed) == CLIENTS
    assert all(len(s.finish_reasons) == 1 for s in streamed), [s.finish_reasons for s in streamed]
    assert seen["error"] is None, f"GetLoad failed while the clients ran: {seen['error']}"
    # More than the session engine's 16: the clients really ran together, not in two waves.
    assert seen["peak"] > 16, f"at most {seen['peak']} sequences ran at once"

    with EngineClient(engine.target) as client:
        load = wait_for_idle(client, timeout=15)
    assert (load.num_running, load.num_waiting, load.kv_blocks_used, load.num_in_flight) == (0, 0, 0, 0), load

    offline = _offline()
    for i, (got, ref) in enumerate(zip(streamed, offline)):
        want = ref.outputs[0]
        assert got.text == want.text, f"client {i} differs from the offline API"
        assert got.finish_reasons == [want.finish_reason], f"client {i}"
        assert got.completion_tokens == len(want.token_ids), f"client {i}"
