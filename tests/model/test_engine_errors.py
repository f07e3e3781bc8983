"""Bad input to the engine raises ValueError naming the field, and allocates nothing.

Each case is checked through the offline API and the engine core; afterwards the scheduler is
empty and every KV block is free, and the engine still serves a good request.
"""
from __future__ import annotations

import pytest

from sluice.engine.errors import ContextLengthError, QueueFullError
from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(loaded=smollm2, max_model_len=64, max_waiting=2)


def _assert_nothing_allocated(llm: LLM) -> None:
    llm.engine.kv.check_invariants()
    load = llm.engine.get_load()
    assert (load.num_running, load.num_waiting, load.kv_blocks_used) == (0, 0, 0)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"min_p": 2.0}, "min_p"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, params, exc, field", [
    ("", SamplingParams(), ValueError, "prompt"),
    ([], SamplingParams(), ValueError, "prompt"),
    ([1, 2, 10**6], SamplingParams(), ValueError, "prompt"),
    ([1, -3], SamplingParams(), ValueError, "prompt"),
    ("hello " * 80, SamplingParams(), ContextLengthError, "prompt"),
    ("hello", SamplingParams(max_tokens=100), ContextLengthError, "max_tokens"),
    ("hello", SamplingParams(logit_bias={10**6: 1.0}), ValueError, "logit_bias"),
    ("hello", SamplingParams(stop_token_ids=[10**6]), ValueError, "stop_token_ids"),
])
def test_bad_requests_allocate_nothing(llm, prompt, params, exc, field):
    with pytest.raises(exc, match=rf"^{field}:"):
        llm.generate([prompt], params)
    with pytest.raises(exc, match=rf"^{field}:"):
        llm.engine.add_request("bad", prompt, params)
    _assert_nothing_allocated(llm)
    # One bad prompt among good ones: nothing of the batch is queued.
    with pytest.raises(exc):
        llm.generate(["fine", prompt], params)
    _assert_nothing_allocated(llm)


def test_duplicate_id_and_full_queue(llm):
    sp = SamplingParams(max_tokens=2)
    llm.engine.add_request("a", "one", sp)
    with pytest.raises(ValueError, match="^request_id:"):
        llm.engine.add_request("a", "two", sp)
    llm.engine.add_request("b", "two", sp)
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        llm.engine.add_request("c", "three", sp)
    with pytest.raises(QueueFullError):
        llm.engine.add_request("d", "four", SamplingParams(max_tokens=2, n=3))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _assert_nothing_allocated(llm)


def test_abort_frees_blocks_and_reports(llm):
    llm.engine.add_request("x", "Tell me a long story about", SamplingParams(max_tokens=30, ignore_eos=True, n=2))
    llm.engine.step()
    assert llm.engine.get_load().kv_blocks_used > 0
    llm.engine.abort_request(["x", "unknown"])
    outs = llm.engine.step()
    final = [o for o in outs if o.request_id == "x"]
    assert final and final[-1].finished
    assert sorted(d.finish_reason for d in final[-1].deltas if d.finished) == ["abort", "abort"]
    _assert_nothing_allocated(llm)


def test_engine_still_serves_after_errors(llm):
    res = llm.generate(["The sky is"], SamplingParams(max_tokens=4, temperature=0))
    assert res[0].usage.completion_tokens == 4 or res[0].outputs[0].finish_reason == "stop"
    _assert_nothing_allocated(llm)
