"""Every way a request finishes reaches its stream exactly once, on the tiny random-weight model.

The case that used to hang: a request alone whose generation outgrows the KV pool is finished by
the scheduler inside ``schedule()`` ("length" at the pool's end). Nothing marked its client
request as having news, so no final delta ever went out while the engine kept stepping. Also:
``check_invariants`` names a request tracked by the core but neither scheduled, waiting nor
reported; ``shutdown()`` ends the streams still open with an error.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.errors import EngineUnavailableError
from sluice.engine.llm import LLM
from sluice.engine.request import RequestStatus
from sluice.engine.sampling_params import SamplingParams
from tests.tiny_model import prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(120)
POOL_TOKENS = 32           # 8 blocks of 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("tiny"))


def _llm(folder, **kw) -> LLM:
    opts = dict(device="cpu", block_size=4, max_total_tokens=POOL_TOKENS) | kw
    return LLM(str(folder), **opts)


def _run(core, rid: str, max_steps: int = 200) -> list:
    """Step until ``rid`` reports its end, at most ``max_steps`` steps; every output of it."""
    outs = []
    for _ in range(max_steps):
        for out in core.step():
            assert out.request_id == rid
            outs.append(out)
            if out.finished:
                return outs
    pytest.fail(f"{rid} got no final delta in {max_steps} steps "
                f"({sum(len(d.token_ids) for o in outs for d in o.deltas)} tokens so far)")


def test_generation_that_outgrows_the_pool_ends_with_one_length_record(folder, monkeypatch):
    monkeypatch.setenv("SLUICE_DEBUG_INVARIANTS", "1")
    llm = _llm(folder)
    core = llm.engine
    params = SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0)
    core.add_request("big", prompt(20), params)
    outs = _run(core, "big")
    finals = [d for o in outs for d in o.deltas if d.finished]
    assert len(finals) == 1 and finals[0].finish_reason == "length"
    tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
    # The pool holds 32 tokens; the last sampled token needs no slot of its own.
    assert len(tokens) == finals[0].usage.completion_tokens == POOL_TOKENS - 20 + 1
    assert "".join(d.text for o in outs for d in o.deltas).split() == [f"w{t}" for t in tokens]
    assert not core.has_unfinished_requests()
    assert core.kv.num_free_blocks == core.kv.num_total_blocks
    for _ in range(3):   # nothing more for it, ever
        assert core.step() == []


def test_pool_end_reaches_an_async_stream(folder):
    llm = _llm(folder)

    async def main():
        engine = AsyncEngine(lambda: llm.engine)
        engine.start()
        await engine.wait_ready()
        params = SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0)
        outs = []
        async with contextlib.aclosing(engine.generate("a", prompt(20), params)) as it:
            async for out in it:
                outs.append(out)
        await engine.shutdown()
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 60))
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason == "length"
    assert sum(1 for o in outs for d in o.deltas if d.finished) == 1


def test_invariant_names_a_request_finished_behind_the_cores_back(folder):
    core = _llm(folder, max_total_tokens=256).engine
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    core.add_request("r", prompt(6), params)
    core.step()
    core.check_invariants()
    # As the scheduler does on its own when the pool runs out: the core is not told.
    core.scheduler.finish_requests(["r#0"], RequestStatus.FINISHED_LENGTH)
    with pytest.raises(AssertionError, match=r"'r' choice 0: FINISHED_LENGTH, tracked by the core but "
                                             "neither scheduled, waiting nor reported"):
        core.check_invariants()
    outs = _run(core, "r")      # the step still finds it and reports it
    assert outs[-1].deltas[-1].finish_reason == "length"
    core.check_invariants()


def test_every_finish_reports_once_with_n_choices(folder, monkeypatch):
    """stop string, max_tokens, abort and pool end in one batch; one terminal delta each."""
    monkeypatch.setenv("SLUICE_DEBUG_INVARIANTS", "1")
    core = _llm(folder, max_total_tokens=64).engine
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    text = "".join(o.text for o in _llm(folder, max_total_tokens=64).generate(prompt(4), greedy)[0].outputs)
    stop_word = text.split()[2]
    core.add_request("stop", prompt(4), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0,
                                                       stop=[stop_word]))
    core.add_request("len", prompt(4), SamplingParams(n=2, max_tokens=3, ignore_eos=True, temperature=0.7, seed=1))
    core.add_request("abort", prompt(4), SamplingParams(max_tokens=30, ignore_eos=True))
    finals: dict[str, list] = {}
    for step in range(100):
        if step == 2:
            core.abort_request(["abort"])
        for out in core.step():
            for d in out.deltas:
                if d.finished:
                    finals.setdefault(out.request_id, []).append((d.index, d.finish_reason))
        if not core.has_unfinished_requests():
            break
    assert finals == {"stop": [(0, "stop")], "len": sorted(finals["len"]), "abort": [(0, "abort")]}
    assert sorted(finals["len"]) == [(0, "length"), (1, "length")]


def test_shutdown_ends_streams_still_open_with_an_error(folder):
    llm = _llm(folder, max_total_tokens=4096)

    async def main():
        engine = AsyncEngine(lambda: llm.engine)
        engine.start()
        await engine.wait_ready()
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        it = engine.generate("long", prompt(4), params)
        await it.__anext__()
        task = asyncio.ensure_future(_drain(it))
        await engine.shutdown()
        return await asyncio.wait_for(task, 10)

    async def _drain(it):
        try:
            async for _ in it:
                pass
        except EngineUnavailableError as exc:
            return str(exc)
        return "ended without an error"

    assert asyncio.run(asyncio.wait_for(main(), 60)) == "engine unavailable: the engine has stopped"
