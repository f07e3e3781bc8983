"""The engine's request caps (``LimitsConfig``), for gRPC clients that bypass the facade: each a
``ValueError`` naming the parameter (INVALID_ARGUMENT at the servicer), raised before anything
is allocated or tokenized; and text prompts are tokenized off the engine's step thread."""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.errors import ContextLengthError
from sluice.engine.llm import LLM
from sluice.engine.overrides import build_engine_config
from sluice.engine.rpc.status import status_for
from sluice.engine.sampling_params import SamplingParams
from tests.tiny_model import prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def core(folder):
    return LLM(str(folder), device="cpu", max_prompt_bytes=4000, max_logprobs=3, max_tools_bytes=500).engine


@pytest.mark.parametrize(("params", "message"), [
    (dict(n=129), "n: at most 128 choices per request, got 129 (the server's max_n)"),
    (dict(n=2_000_000), "n: at most 128 choices per request, got 2000000"),
    (dict(stop=[f"s{i}" for i in range(17)]), "stop: at most 16 stop strings, got 17"),
    (dict(stop=["x" * 257]), "stop: at most 256 characters per stop string, got 257"),
    (dict(stop_token_ids=list(range(17))), "stop_token_ids: at most 16 stop tokens"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias: at most 1024 entries, got 1025"),
    (dict(logprobs=4), "logprobs: at most 3 alternatives per token, got 4 (the server's max_logprobs)"),
])
def test_parameter_caps(core, params, message):
    with pytest.raises(ValueError) as info:
        core.add_request("r", prompt(3), SamplingParams(**params))
    assert str(info.value) == message or str(info.value).startswith(message)
    assert status_for(info.value)[0].name == "INVALID_ARGUMENT"
    assert not core.has_unfinished_requests() and not core.is_active("r")


def test_prompt_bytes_are_checked_before_tokenizing(core, monkeypatch):
    calls = []
    monkeypatch.setattr(core.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    with pytest.raises(ValueError, match=r"^prompt: at most 4000 bytes of UTF-8 text, got 4002 "):
        core.add_request("r", "é" * 2001, SamplingParams())
    assert calls == [] and not core.is_active("r")


def test_token_prompt_over_the_context_is_refused_before_walking_it(core):
    with pytest.raises(ContextLengthError, match=r"^prompt: 5000000 tokens leave no room"):
        core.add_request("r", [object()] * 5_000_000, SamplingParams())   # a walk would say "token id"


def test_chat_caps_come_before_the_template(core):
    with pytest.raises(ValueError, match=r"^messages: at most 4000 bytes of message text"):
        core.render_chat([{"role": "user", "content": "a" * 3000}, {"role": "user", "content": "b" * 1001}])
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 600}}]
    with pytest.raises(ValueError, match=r"^tools: at most 500 bytes"):
        core.render_chat([{"role": "user", "content": "hi"}], tools=tools)


def test_caps_come_from_overrides(folder):
    config = build_engine_config(str(folder), overrides="max_n=4;max_prompt_bytes=1KiB", device="cpu")
    assert (config.limits.max_n, config.limits.max_prompt_bytes) == (4, 1024)
    with pytest.raises(ValueError, match="max_n: must be a positive integer"):
        build_engine_config(str(folder), overrides="max_n=0", device="cpu")


def test_text_prompts_are_tokenized_off_the_step_thread(folder):
    core = LLM(str(folder), device="cpu").engine
    threads = []
    encode = core.tokenizer.encode

    def recording(*a, **k):
        threads.append(threading.current_thread().name)
        return encode(*a, **k)

    core.tokenizer.encode = recording

    async def main():
        engine = AsyncEngine(lambda: core)
        engine.start()
        await engine.wait_ready()
        async with contextlib.aclosing(engine.generate("a", prompt(50), SamplingParams(max_tokens=2))) as it:
            outs = [o async for o in it]
        await engine.shutdown()
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 60))
    assert outs[-1].finished
    assert threads and "sluice-engine" not in threads


# ---- gRPC: the caps are read off the protobuf message, before it is converted -------------------
def _no_conversion(monkeypatch):
    from sluice.engine.rpc import convert

    def refuse(**kwargs):
        raise AssertionError(f"SamplingParams built from an over-cap message ({len(kwargs.get('stop', []))} stops)")

    monkeypatch.setattr(convert, "SamplingParams", refuse)


@pytest.mark.parametrize(("fields", "message"), [
    ({"stop": ["w1"] * 300_000}, "sampling.stop: at most 16 stop strings, got 300000"),
    ({"stop": ["x" * 257]}, "sampling.stop: at most 256 characters per stop string, got 257"),
    ({"stop_token_ids": [1] * 10_000}, "sampling.stop_token_ids: at most 16 stop tokens, got 10000"),
    ({"logit_bias": {i: 1.0 for i in range(2000)}}, "sampling.logit_bias: at most 1024 entries, got 2000"),
    ({"n": 2_000_000}, "sampling.n: at most 128 choices per request, got 2000000"),
    ({"logprobs": True, "top_logprobs": 50}, "sampling.top_logprobs: at most 20 alternatives per token, got 50"),
])
def test_grpc_caps_are_checked_on_the_message_before_conversion(monkeypatch, fields, message):
    from sluice.engine.config import LimitsConfig
    from sluice.engine.rpc import convert
    from sluice.engine.rpc import engine_pb2 as pb

    _no_conversion(monkeypatch)
    with pytest.raises(ValueError, match="^" + message):
        convert.sampling_from_proto(pb.SamplingParams(**fields), LimitsConfig())


def test_the_servicer_passes_the_engine_limits(monkeypatch, core):
    """Generate refuses 300k stop strings without copying them out of the message."""
    from types import SimpleNamespace

    from sluice.engine.rpc import engine_pb2 as pb
    from sluice.engine.rpc.servicer import EngineServicer

    _no_conversion(monkeypatch)
    servicer = EngineServicer(SimpleNamespace(core=core))
    request = pb.GenerateRequest(text="w1", sampling=pb.SamplingParams(stop=["w1"] * 300_000))

    async def first():
        return await servicer.Generate(request, None).__anext__()

    with pytest.raises(ValueError, match="^sampling.stop: at most 16 stop strings"):
        asyncio.run(first())
