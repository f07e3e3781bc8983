"""A grammar slower than the compile limit, on the default model behind ``AsyncEngine``.

Proves: the request is refused with the ValueError naming its parameter (the facade's 400, gRPC
INVALID_ARGUMENT) once the limit has passed, not after the compile; and an unconstrained stream
running meanwhile keeps its step rate (the compile runs in the manager's pool, off the step
thread, and the slow request never reaches the scheduler). The rate is compared with the same
stream's own rate before the compile, with a generous margin: on this shared 2-core machine the
compile takes CPU time from the step, which is not what is measured here.
"""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.engine_core import EngineCore
from sluice.engine.llm import build_config
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured import GrammarSpec
from tests.unit.test_structured_output import SLOW_REGEX

pytestmark = pytest.mark.slow


async def test_slow_grammar_is_refused_while_a_stream_keeps_its_rate(smollm2):
    core = EngineCore(build_config("smollm2", compile_timeout_s=2.0), loaded=smollm2)
    core.structured.warm_up().result()
    engine = AsyncEngine(lambda: core)
    engine.start()
    await engine.wait_ready()
    times: list[float] = []

    async def stream() -> None:
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        async for _ in engine.generate("free", "Tell me a long story about a ship.", params):
            times.append(time.monotonic())
            if len(times) > 12 and window[1] is not None and time.monotonic() > window[1] + 1.0:
                break

    window: list[float | None] = [None, None]
    task = asyncio.create_task(stream())
    while len(times) < 8:
        await asyncio.sleep(0.05)
    window[0] = time.monotonic()
    slow = SamplingParams(max_tokens=4, structured=GrammarSpec("regex", SLOW_REGEX, field="guided_regex"))
    with pytest.raises(ValueError, match=r"^guided_regex: the grammar did not compile within 2 s"):
        async for _ in engine.generate("slow", "Hello", slow):
            pass
    window[1] = time.monotonic()
    assert window[1] - window[0] < 6.0            # refused at the limit, not after the compile
    await task
    await engine.shutdown()

    gaps_before = [b - a for a, b in zip(times, times[1:]) if b <= window[0]]
    gaps_during = [b - a for a, b in zip(times, times[1:]) if window[0] < b <= window[1]]
    assert len(gaps_before) >= 5 and gaps_during, (gaps_before, gaps_during)
    assert statistics.median(gaps_during) < 4 * statistics.median(gaps_before) + 0.05, (gaps_before, gaps_during)
