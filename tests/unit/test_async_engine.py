"""AsyncEngine's threading and queueing, driven by a fake core that records its calls.

The subject is the hand-off between asyncio and the engine thread, not the model: a fake core
(one scripted token per live request per step, told when to raise) stands in for EngineCore;
the real engine behind the same AsyncEngine is covered by tests/integration.

Proves: outputs reach their own request's stream, in order, without cross-talk, across
concurrent requests; leaving the async iterator early aborts the request in the core; a
validation error from add_request is raised from the first iteration and leaves nothing open;
an exception from a whole step() ends every request in flight with EngineStepError (and aborts
them in the core) while the loop keeps serving the next request; call() runs on the engine
thread; a load failure reaches wait_ready() and refuses requests; drain() waits for requests in
flight and refuses new ones, or after its timeout aborts the rest; shutdown() stops the thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from sluice.engine.async_engine import AsyncEngine, EngineState, EngineStepError
from sluice.engine.errors import EngineUnavailableError
from sluice.engine.outputs import CompletionDelta, RequestOutput
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0


class FakeCore:
    """Stands in for EngineCore. Each step emits the next token (0, 1, 2, ...) of every live
    request and finishes it at ``max_tokens``; an aborted request gets a final "abort" delta on
    the next step, as the real core does. Called only from the engine thread; the test sets the
    knobs (``fail_steps``, ``add_error``) and reads ``calls``, a list appended to atomically."""

    def __init__(self, step_delay_s: float = 0.002) -> None:
        self.calls: list[tuple] = []
        self.threads: set[str] = set()
        self.live: dict[str, list[int]] = {}     # request id -> [tokens emitted, max_tokens]
        self.aborted: list[str] = []             # final "abort" deltas due next step
        self.fail_steps = 0
        self.add_error: Exception | None = None
        self.step_delay_s = step_delay_s
        self.model_info = "fake-model"
        self.closed = False

    def close(self) -> None:
        """What outlives the step loop (EngineCore.close); shutdown calls it once the thread is gone."""
        self.closed = True

    def prepare_prompt(self, prompt, params, add_special_tokens=True):
        return [1, 2, 3]

    def add_request(self, request_id, prompt, params, add_special_tokens=True, token_ids=None):
        self.threads.add(threading.current_thread().name)
        self.calls.append(("add", request_id, prompt))
        if self.add_error is not None:
            raise self.add_error
        self.live[request_id] = [0, params.max_tokens]
        return [1, 2, 3]

    def abort_request(self, request_ids):
        ids = list(request_ids)
        self.calls.append(("abort", tuple(ids)))
        for rid in ids:
            if self.live.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live or self.aborted)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.step_delay_s)
        if self.fail_steps > 0:
            self.fail_steps -= 1
            self.calls.append(("step_failed",))
            raise RuntimeError("boom")
        outs = [RequestOutput(rid, [CompletionDelta(0, finish_reason="abort")], True) for rid in self.aborted]
        self.aborted = []
        for rid, state in list(self.live.items()):
            tok = state[0]
            state[0] += 1
            done = state[0] >= state[1]
            delta = CompletionDelta(0, str(tok), [tok], finish_reason="length" if done else None)
            outs.append(RequestOutput(rid, [delta], done))
            if done:
                del self.live[rid]
        return outs

    def get_load(self):
        return ("load", len(self.live))


@contextlib.asynccontextmanager
async def running(core: FakeCore):
    engine = AsyncEngine(lambda: core)
    engine.start()
    await asyncio.wait_for(engine.wait_ready(), WAIT_S)
    try:
        yield engine
    finally:
        await engine.shutdown()
        assert core.closed                       # the core's pools and ranks are released


async def _collect(engine: AsyncEngine, rid: str, max_tokens: int | None) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=max_tokens)
    async with contextlib.aclosing(engine.generate(rid, f"prompt {rid}", params)) as stream:
        return [out async for out in stream]


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for d in o.deltas for t in d.token_ids]


async def test_outputs_reach_their_own_streams_in_order():
    core = FakeCore()
    async with running(core) as engine:
        lengths = {"a": 3, "b": 7, "c": 1}
        results = await asyncio.wait_for(
            asyncio.gather(*(_collect(engine, rid, n) for rid, n in lengths.items())), WAIT_S)
        for (rid, n), outs in zip(lengths.items(), results):
            assert {o.request_id for o in outs} == {rid}
            assert _tokens(outs) == list(range(n))
            assert [o.finished for o in outs] == [False] * (n - 1) + [True]
            assert outs[-1].deltas[-1].finish_reason == "length"
        assert engine.num_in_flight == 0
        assert sorted(c[1] for c in core.calls if c[0] == "add") == ["a", "b", "c"]
        assert core.threads == {"sluice-engine"}


async def test_leaving_the_iterator_early_aborts_the_request():
    core = FakeCore()
    async with running(core) as engine:
        got = []
        async with contextlib.aclosing(engine.generate("long", [5, 6], SamplingParams(max_tokens=10_000))) as s:
            async for out in s:
                got.append(out)
                if len(got) == 2:
                    break
        assert _tokens(got) == [0, 1] and engine.num_in_flight == 0
        await _until(lambda: ("abort", ("long",)) in core.calls, "the abort to reach the core")
        await _until(lambda: not core.has_unfinished_requests(), "the core to drop the request")
        # The engine keeps serving afterwards.
        assert _tokens(await asyncio.wait_for(_collect(engine, "next", 2), WAIT_S)) == [0, 1]


async def test_add_error_is_raised_from_the_first_iteration_and_leaves_nothing_open():
    core = FakeCore()
    core.add_error = ValueError("max_tokens: too many")
    async with running(core) as engine:
        with pytest.raises(ValueError, match="^max_tokens: too many$"):
            await asyncio.wait_for(_collect(engine, "bad", 4), WAIT_S)
        assert engine.num_in_flight == 0
        core.add_error = None
        first = engine.generate("dup", "x", SamplingParams(max_tokens=10_000))
        assert (await asyncio.wait_for(first.__anext__(), WAIT_S)).request_id == "dup"
        with pytest.raises(ValueError, match="^request_id: 'dup' is already in flight"):
            await engine.generate("dup", "x", SamplingParams()).__anext__()
        assert engine.num_in_flight == 1   # the refused duplicate did not close the open stream
        await first.aclose()
        await _until(lambda: ("abort", ("dup",)) in core.calls, "the abort of the open stream")


async def test_a_failed_step_fails_requests_in_flight_and_the_loop_keeps_serving():
    core = FakeCore()
    async with running(core) as engine:
        streams = {rid: engine.generate(rid, "p", SamplingParams(max_tokens=10_000)) for rid in ("x", "y")}
        for s in streams.values():      # both are live in the core before the fault
            assert (await asyncio.wait_for(s.__anext__(), WAIT_S)).finished is False
        core.fail_steps = 1
        for rid, s in streams.items():
            with pytest.raises(EngineStepError, match="^engine fault: RuntimeError: boom$"):
                while True:
                    await asyncio.wait_for(s.__anext__(), WAIT_S)
        assert engine.num_in_flight == 0
        assert ("abort", ("x", "y")) in core.calls           # the core frees what it held
        outs = await asyncio.wait_for(_collect(engine, "after", 3), WAIT_S)
        assert _tokens(outs) == [0, 1, 2] and outs[-1].finished
        assert engine.state is EngineState.READY


async def test_call_runs_on_the_engine_thread_and_passes_errors_back():
    core = FakeCore()
    async with running(core) as engine:
        where = await engine.call(lambda c: (threading.current_thread().name, c.model_info))
        assert where == ("sluice-engine", "fake-model")
        assert await engine.get_load() == ("load", 0)
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda c: 1 / 0)
        assert engine.model_info == "fake-model"


async def test_load_failure_reaches_wait_ready_and_refuses_requests():
    def fail():
        raise RuntimeError("no weights")
    engine = AsyncEngine(fail)
    engine.start()
    with pytest.raises(RuntimeError, match="no weights"):
        await asyncio.wait_for(engine.wait_ready(), WAIT_S)
    assert engine.state is EngineState.FAILED
    with pytest.raises(EngineUnavailableError, match="failed to load: no weights"):
        await engine.generate("r", "p", SamplingParams()).__anext__()
    await engine.shutdown()
    assert engine.state is EngineState.FAILED


async def test_drain_waits_for_requests_in_flight_and_refuses_new_ones():
    core = FakeCore(step_delay_s=0.01)
    async with running(core) as engine:
        task = asyncio.create_task(_collect(engine, "a", 8))
        await _until(lambda: engine.num_in_flight == 1, "the request to open")
        assert await asyncio.wait_for(engine.drain(timeout_s=WAIT_S), WAIT_S + 1) == 0
        assert task.done() and _tokens(task.result()) == list(range(8))
        assert engine.state is EngineState.DRAINING
        with pytest.raises(EngineUnavailableError, match="draining"):
            await engine.generate("late", "p", SamplingParams()).__anext__()
        assert await engine.call(lambda c: "still callable") == "still callable"
    assert engine.state is EngineState.STOPPED
    assert "sluice-engine" not in {t.name for t in threading.enumerate()}
    with pytest.raises(EngineUnavailableError, match="stopped"):
        await engine.generate("later", "p", SamplingParams()).__anext__()


async def test_drain_timeout_aborts_the_rest():
    core = FakeCore()
    async with running(core) as engine:
        tasks = [asyncio.create_task(_collect(engine, rid, 10_000_000)) for rid in ("p", "q")]
        await _until(lambda: engine.num_in_flight == 2, "both requests to open")
        assert await asyncio.wait_for(engine.drain(timeout_s=0.2), WAIT_S) == 2
        for t in tasks:
            outs = await asyncio.wait_for(t, WAIT_S)
            assert outs[-1].finished and outs[-1].deltas[-1].finish_reason == "abort"
            assert _tokens(outs) == list(range(len(outs) - 1))
        assert engine.num_in_flight == 0 and not core.has_unfinished_requests()


async def test_a_call_cancelled_before_the_engine_runs_it_leaves_the_thread_alive():
    """Regression: a GetLoad or a Generate whose deadline passed while its command waited in the
    queue used to set a result on a cancelled future, killing the engine thread for good."""
    core = FakeCore(step_delay_s=0.05)   # slow steps: commands wait in the queue
    async with running(core) as engine:
        busy = asyncio.ensure_future(_collect(engine, "long", 20))
        await _until(lambda: ("add", "long", "prompt long") in core.calls, "the long request")
        for _ in range(5):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.get_load(), 0.001)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(_collect(engine, "gone", 3), 0.001)
        assert _tokens(await asyncio.wait_for(busy, WAIT_S)) == list(range(20))
        # The thread still serves: a new request runs to the end and a call answers.
        assert _tokens(await asyncio.wait_for(_collect(engine, "after", 2), WAIT_S)) == [0, 1]
        assert await asyncio.wait_for(engine.get_load(), WAIT_S) == ("load", 0)
        await _until(lambda: engine.num_in_flight == 0, "no stream left open")
