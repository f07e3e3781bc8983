"""Generate over gRPC against a real engine process (SmolLM2): 16 concurrent streams interleave
token by token and each equals the offline API's output for the same seed; the stream's records
(per-choice deltas, one final record per choice with usage and timings, logprobs, matched stops)
are complete; chat messages are rendered by the engine; Abort ends a stream; the model is
described by GetModelInfo / ListModels."""
from __future__ import annotations

import asyncio

import pytest

from sluice.engine.client import AsyncEngineClient, Choice, EngineClient, SamplingOptions
from tests.integration.conftest import MAIN_OVERRIDES, wait_for_idle

pytestmark = pytest.mark.slow

PROMPTS = [f"Story {i}: once upon a time, a {animal}" for i, animal in enumerate(
    ["cat", "dog", "fox", "owl", "bee", "cow", "elk", "yak", "ant", "bat", "eel", "hen", "pig", "ram", "emu", "gnu"])]


def _options(i: int) -> SamplingOptions:
    return SamplingOptions(max_tokens=6, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True)


async def _run_concurrently(target: str) -> tuple[list[tuple[str, int]], list[Choice]]:
    events: list[tuple[str, int]] = []
    async with AsyncEngineClient(target, timeout=120.0) as client:
        async def one(i: int) -> Choice:
            choice = Choice(0)
            async for d in client.generate(PROMPTS[i], _options(i)):
                if d.token_ids and not choice.token_ids:
                    events.append(("first", i))
                choice.add(d)
                if d.finished:
                    events.append(("finish", i))
            return choice

        choices = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    return events, list(choices)


def test_16_concurrent_streams_interleave_and_equal_the_offline_api(engine_server) -> None:
    events, choices = asyncio.run(_run_concurrently(engine_server.target))

    firsts = [n for n, (kind, _) in enumerate(events) if kind == "first"]
    finishes = [n for n, (kind, _) in enumerate(events) if kind == "finish"]
    assert len(firsts) == len(finishes) == 16
    assert max(firsts) < min(finishes), f"a stream finished before all had started: {events}"
    assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in choices)

    from sluice.engine.llm import LLM
    from sluice.engine.overrides import build_engine_config
    from sluice.engine.sampling_params import SamplingParams

    # An engine configured as the server's, so in its weight format too (auto: w4a8 on CPU).
    llm = LLM(config=build_engine_config("smollm2", mode="local", overrides=MAIN_OVERRIDES, device="cpu"))
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(16)]
    offline = llm.generate(PROMPTS, params)
    for i, (streamed, ref) in enumerate(zip(choices, offline)):
        assert streamed.token_ids == ref.outputs[0].token_ids, f"stream {i} differs from the offline API"
        assert streamed.text == ref.outputs[0].text


def test_one_final_record_per_choice_with_usage_timings_and_logprobs(client: EngineClient) -> None:
    prompt = "The three primary colours are"
    stream = client.generate(prompt, n=2, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True,
                             logprobs=True, top_logprobs=3)
    deltas = list(stream)
    finals = [d for d in deltas if d.finished]
    assert sorted(d.index for d in finals) == [0, 1]
    n_prompt = len(client.tokenize(prompt).token_ids)
    assert stream.prompt_token_ids == client.tokenize(prompt).token_ids
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert mine[-1].finished and not any(d.finished for d in mine[:-1])
        final = mine[-1]
        ids = [t for d in mine for t in d.token_ids]
        lps = [lp for d in mine for lp in d.logprobs]
        assert final.finish_reason == "length" and len(ids) == 5
        assert final.usage.prompt_tokens == n_prompt and final.usage.completion_tokens == 5
        t = final.timings
        assert 0 <= t.queued_s <= t.ttft_s <= t.total_s
        assert [lp.token_id for lp in lps] == ids
        for lp in lps:
            assert len(lp.top) == 3 and lp.logprob <= 0.0
            assert [a.logprob for a in lp.top] == sorted((a.logprob for a in lp.top), reverse=True)
        assert client.detokenize(ids) == "".join(d.text for d in mine)


def test_stop_string_and_stop_token_are_reported(client: EngineClient) -> None:
    prompt = "List the days of the week: Monday, Tuesday,"
    greedy = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True).collect()[0]
    words = [w for w in greedy.text.split() if len(w.strip(",.")) > 3]
    assert words, f"greedy output has no word to stop on: {greedy.text!r}"
    stop = words[1 if len(words) > 1 else 0].strip(",.")
    got = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]).collect()[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == greedy.text[: greedy.text.index(stop)]

    stop_tok = greedy.token_ids[2]
    got = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True,
                          stop_token_ids=[stop_tok]).collect()[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop_tok
    assert got.token_ids[: greedy.token_ids.index(stop_tok)] == greedy.token_ids[: greedy.token_ids.index(stop_tok)]


def test_chat_is_rendered_by_the_engine(client: EngineClient) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    tok = client.tokenize(messages=messages)
    assert tok.prompt and "Name a colour." in tok.prompt and tok.max_model_len == 8192
    via_chat = client.chat(messages, max_tokens=8, temperature=0.0).collect()[0]
    via_ids = client.generate(tok.token_ids, max_tokens=8, temperature=0.0).collect()[0]
    assert via_chat.token_ids == via_ids.token_ids and via_chat.text == via_ids.text
    assert via_chat.usage.prompt_tokens == len(tok.token_ids)


def test_tokenize_detokenize_round_trip(client: EngineClient) -> None:
    text = "Paged attention keeps KV blocks small."
    ids = client.tokenize(text, add_special_tokens=False).token_ids
    assert ids and client.detokenize(ids) == text


def test_abort_by_request_id_ends_the_stream(client: EngineClient) -> None:
    stream = client.generate("Count slowly: one, two,", max_tokens=400, ignore_eos=True, request_id="abort-me")
    first = next(stream)
    assert first.request_id == "abort-me"
    assert client.abort("abort-me", "never-existed") == ["abort-me"]
    rest = list(stream)
    assert rest and rest[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in [first, *rest]) < 400
    load = wait_for_idle(client)
    assert (load.num_running, load.num_waiting, load.kv_blocks_used) == (0, 0, 0)


def test_model_info_and_list_models(client: EngineClient) -> None:
    info = client.model_info()
    assert info.max_model_len == 8192 and info.vocab_size == 49152
    assert {"generate", "chat", "embeddings", "rerank"} <= info.capabilities
    assert "infilling" not in info.capabilities
    assert info.device == "cpu" and info.dtype == "float32"
    assert client.list_models() == [info]
