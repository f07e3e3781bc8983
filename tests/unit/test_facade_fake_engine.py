"""A scripted in-process gRPC engine (a test double implementing the generated servicer) for the
facade's unit tests, plus checks that the double itself behaves as the contract says, so that the
facade tests built on it cannot pass against a double that never streams or never errors.

Behaviour is chosen by the prompt text: ``context-too-long`` → OUT_OF_RANGE, ``queue-full`` →
RESOURCE_EXHAUSTED, ``fail-midway`` → one message then INTERNAL, ``slow`` → many slow steps
(for disconnect tests), ``paced`` → ``max_tokens`` steps of 20 ms each. Otherwise each choice j generates ``max_tokens`` (8 when unlimited)
words ``c{j}w{k} ``, one token per step, the last with a final record carrying usage.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc

MODEL = "fake-model"


def _prompt_text(req: pb.GenerateRequest) -> str:
    kind = req.WhichOneof("input")
    if kind == "chat":
        return " ".join(m.content for m in req.chat.messages)
    if kind == "text":
        return req.text
    return " ".join(map(str, req.token_ids.ids))


class FakeEngine(pb_grpc.EngineServiceServicer):
    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.active: set[str] = set()
        self.cancelled: list[str] = []
        self.aborted: list[str] = []
        self.capabilities = ["chat", "generate"]
        self.model_name = MODEL

    async def Generate(self, request, context):
        self.requests.append(request)
        text = _prompt_text(request)
        sp = request.sampling
        if sp.HasField("temperature") and sp.temperature > 2:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be <= 2")
        if "context-too-long" in text:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                "prompt: 5000 tokens do not fit the context window of 2048")
        if "queue-full" in text:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full (1)")
        rid = request.request_id
        self.active.add(rid)
        try:
            async for msg in self._steps(request, text):
                yield msg
            if "fail-midway" in text:
                await context.abort(grpc.StatusCode.INTERNAL, "request failed: injected fault")
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.active.discard(rid)

    async def _steps(self, request: pb.GenerateRequest, text: str):
        sp = request.sampling
        n = sp.n if sp.HasField("n") else 1
        slow = "slow" in text
        paced = slow or "paced" in text
        steps = 1000 if slow else (sp.max_tokens if sp.HasField("max_tokens") else 8)
        prompt_ids = list(request.token_ids.ids) or list(range(1, len(text.split()) + 1))
        for k in range(steps):
            msg = pb.GenerateResponse(request_id=request.request_id)
            if k == 0:
                msg.prompt_token_ids.extend(prompt_ids)
            for j in range(n):
                self._delta(msg.choices.add(), j, k, steps, sp, len(prompt_ids))
            yield msg
            await asyncio.sleep(0.02 if paced else 0)
            if "fail-midway" in text:
                return

    @staticmethod
    def _delta(c: pb.ChoiceDelta, j: int, k: int, steps: int, sp: pb.SamplingParams, prompt_len: int) -> None:
        word = f"c{j}w{k} "
        c.index, c.text = j, word
        c.token_ids.append(100 + k)
        if sp.logprobs:
            lp = c.logprobs.add(token_id=100 + k, logprob=-0.25, token=word)
            for t in range(sp.top_logprobs):
                lp.top.add(token_id=200 + t, logprob=-0.25 - t, token=f"alt{t}")
        if k == steps - 1:
            c.final.finish_reason = pb.FINISH_REASON_LENGTH
            c.final.usage.prompt_tokens = prompt_len
            c.final.usage.completion_tokens = steps
            c.final.usage.cached_prompt_tokens = 1
            c.final.timings.ttft_s = 0.01

    async def Abort(self, request, context):
        hit = [r for r in request.request_ids if r in self.active]
        self.aborted.extend(request.request_ids)
        return pb.AbortResponse(aborted=hit)

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            name=self.model_name, path=f"/models/{self.model_name}.gguf", architecture="llama", max_model_len=2048, vocab_size=1000,
            dtype="float32", device="cpu", attention_backend="torch", capabilities=self.capabilities)])

    async def GetLoad(self, request, context):
        return pb.GetLoadResponse(num_running=len(self.active), num_waiting=0, kv_blocks_used=2 * len(self.active),
                                  kv_blocks_total=64, prefix_cache_hit_rate=0.5, num_in_flight=len(self.active))

    async def Detokenize(self, request, context):
        return pb.DetokenizeResponse(text="".join(f"<{t}>" for t in request.token_ids))

    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Embed: model {MODEL} does not support embeddings")


async def start_fake_engine() -> tuple[grpc.aio.Server, FakeEngine, int]:
    server = grpc.aio.server()
    fake = FakeEngine()
    pb_grpc.add_EngineServiceServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, fake, port


@pytest.fixture
async def fake_engine():
    server, fake, port = await start_fake_engine()
    yield fake, port
    await server.stop(grace=None)


async def test_fake_engine_streams_and_errors(fake_engine):
    _, port = fake_engine
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.EngineServiceStub(ch)
        req = pb.GenerateRequest(request_id="r1", text="hello", sampling=pb.SamplingParams(n=2, max_tokens=3))
        msgs = [m async for m in stub.Generate(req)]
        assert len(msgs) == 3 and all(len(m.choices) == 2 for m in msgs)
        assert msgs[-1].choices[1].final.finish_reason == pb.FINISH_REASON_LENGTH
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(pb.GenerateRequest(text="context-too-long")):
                pass
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
