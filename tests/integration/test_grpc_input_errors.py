"""Inputs that used to fail inside the engine step with a 500 (found by schemathesis once its
requests reached a model): a temperature that float32 rounds to 0 is greedy, a repetition
penalty float32 cannot hold is refused naming the field, and a grammar the tokenizer cannot spell
ends the call with INVALID_ARGUMENT (the facade's 400), not INTERNAL. In-process engine server on
the tiny word-level model (it cannot write "w5 w6": no token continues after "w5")."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.llm import LLM
from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from sluice.engine.rpc.server import EngineServer, ServerConfig
from sluice.engine.sampling_params import GREEDY_BELOW, SamplingParams
from tests.tiny_model import write_tiny_folder

pytestmark = pytest.mark.timeout(300)


def test_tiny_temperatures_are_greedy_and_penalties_are_bounded():
    assert SamplingParams(temperature=5e-324).greedy and SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    for bad in (5e-324, 1e-7, 1e7):
        with pytest.raises(ValueError, match=r"^repetition_penalty: must be (>=|<=)"):
            SamplingParams(repetition_penalty=bad)
    SamplingParams(repetition_penalty=1e-6)
    SamplingParams(repetition_penalty=1e6)


async def test_extremes_over_grpc(tmp_path):
    core = LLM(str(write_tiny_folder(tmp_path / "tiny")), device="cpu").engine
    server = EngineServer(AsyncEngine(lambda: core), ServerConfig(port=0, grace_s=1.0))
    port = await server.start()
    stop = asyncio.Event()
    running = asyncio.ensure_future(server.run_until(stop))
    await asyncio.wait_for(server.engine.wait_ready(), 120)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.EngineServiceStub(channel)

            async def run(sampling: pb.SamplingParams) -> list[pb.GenerateResponse]:
                return [m async for m in stub.Generate(pb.GenerateRequest(text="w1 w2", sampling=sampling))]

            tiny = await run(pb.SamplingParams(max_tokens=4, temperature=5e-324, ignore_eos=True))
            greedy = await run(pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            ids = [list(c.token_ids) for msgs in (tiny, greedy) for m in msgs for c in m.choices]
            assert sum(ids[:len(ids) // 2], []) == sum(ids[len(ids) // 2:], [])   # the argmax, both
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await run(pb.SamplingParams(max_tokens=4, repetition_penalty=5e-324))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("sampling.repetition_penalty: must be >= 1e-06")
            choice = pb.StructuredOutput(choice=pb.ChoiceConstraint(choices=["w5 w6"]), param="guided_choice")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await run(pb.SamplingParams(max_tokens=4, temperature=0, structured_output=choice))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert err.value.details().startswith("grammar: no token of the model's vocabulary can continue")
    finally:
        stop.set()
        await asyncio.wait_for(running, 60)
