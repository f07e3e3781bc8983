"""32 concurrent streaming chat clients (the ``openai`` SDK's ``AsyncOpenAI``) against a real facade
over a real engine (CPU, float32) configured to run 32 sequences at once: every stream
finishes with one final chunk and its usage; each stream's concatenated text, finish reason and
token count equal the offline API's (``LLM.chat`` in this process, same model, engine settings,
prompt, seed and sampling parameters); and afterwards the engine is idle (GetLoad: nothing
running, waiting or in flight, no KV block in use).

The session engine of conftest.py runs 16 sequences, so this module starts its own engine with
the same settings but ``max_num_sequence=32``, on the tiny random-weight SmolLM2 (SmolLM2's
tokenizer and chat template, tests/model_files.py): the facade and the engine's batching are under
test, not the model, and its random tokens give the detokenizer partial UTF-8 sequences to
stream. Each client asks for 16 tokens: on the tiny model that still keeps all 32 in flight together
(GetLoad saw 32 running with 8), though the facade admits them one after another."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest
from openai import AsyncOpenAI

from sluice.engine.client import EngineClient
from sluice.engine.overrides import parse_overrides
from tests.integration.conftest import MAIN_OVERRIDES, launch_engine, wait_for_idle, wait_serving
from tests.integration.test_facade_http import KEY, launch_facade

CLIENTS = 32
MAX_TOKENS = 16
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
def model(tiny_smollm2) -> str:
    return str(tiny_smollm2)


@pytest.fixture(scope="module")
def wide_facade(tmp_path_factory, model):
    """An engine that admits all 32 clients at once, and a facade in front of it."""
    logs = tmp_path_factory.mktemp("wide")
    engine = launch_engine(logs / "engine.log", "--mode", "local", "--overrides", _overrides_text(),
                           "--embedding-model", "none", model=model)
    try:
        wait_serving(engine)
        facade = launch_facade(engine.target, logs / "facade.log")
        try:
            yield engine, facade
        finally:
            assert facade.stop() == 0
    finally:
        engine.stop()


async def _stream_all(url: str, model: str) -> list[Streamed]:
    async with AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=90) as sdk:
        async def one(i: int) -> Streamed:
            stream = await sdk.chat.completions.create(
                model=model, messages=_messages(i), max_tokens=MAX_TOKENS, temperature=TEMPERATURE,
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


def _offline(model: str) -> list:
    from sluice.engine.llm import LLM
    from sluice.engine.overrides import build_engine_config
    from sluice.engine.sampling_params import SamplingParams

    llm = LLM(config=build_engine_config(model, mode="local", overrides=OVERRIDES, device="cpu"))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=_seed(i)) for i in range(CLIENTS)]
    return llm.chat([_messages(i) for i in range(CLIENTS)], params)


def test_32_concurrent_streams_finish_equal_the_offline_api_and_leave_the_engine_idle(wide_facade, model):
    engine, facade = wide_facade
    stop, seen = threading.Event(), {"peak": 0, "error": None}
    watcher = threading.Thread(target=_watch_running, args=(engine.target, stop, seen), daemon=True)
    watcher.start()
    try:
        streamed = asyncio.run(_stream_all(facade.url, model))
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

    offline = _offline(model)
    for i, (got, ref) in enumerate(zip(streamed, offline)):
        want = ref.outputs[0]
        assert got.text == want.text, f"client {i} differs from the offline API"
        assert got.finish_reasons == [want.finish_reason], f"client {i}"
        assert got.completion_tokens == len(want.token_ids), f"client {i}"
