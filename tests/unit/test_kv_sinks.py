"""The KV manager and scheduler with attention sinks (issue 43), with exact block ids: the table
is the cache, compacted (the sinks' blocks, then the most recent); the oldest block after the
sinks goes back to the pool when a step would outgrow the cache, and is the next one taken; a
failed allocation drops nothing; a step runs at most ``max_step_tokens`` of a request; the
scheduler reports the tokens dropped (the runner's position offset) and those dropped by this
step (the keys it re-rotates); prefix caching is off; bad settings are refused by name."""
from __future__ import annotations

import pytest

from sluice.engine.config import SchedulerConfig
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.outputs import RunnerOutput
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler

BS = 4


def req(rid: str, tokens, max_tokens: int = 64) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=max_tokens))


def decode(kv: KVCacheManager, r: Request, token: int) -> list[int] | None:
    new = kv.allocate_slots(r, 1)
    if new is not None:
        r.num_computed_tokens += 1
        r.append_output_token(token)
        kv.check_invariants()
    return new


def test_the_oldest_block_after_the_sinks_leaves_and_later_entries_move_up():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sinks=4, cache_window=16)   # 4 blocks, 1 of sinks
    assert (kv.enable_prefix_caching, kv.max_step_tokens, kv.max_blocks_for(100, 1)) == (False, 9, 4)
    a = req("a", range(6))
    assert kv.allocate_slots(a, 6) == [0, 1]
    a.num_computed_tokens = 6
    a.append_output_token(50)
    for t in range(51, 61):                        # cache positions 6..15: blocks 2 and 3
        decode(kv, a, t)
    assert kv.get_block_ids("a") == [0, 1, 2, 3] and kv.num_evicted_tokens("a") == 0
    # Position 16 needs a fifth block: block 1 (positions 4-7) leaves and is the one taken.
    assert decode(kv, a, 61) == [1]
    assert kv.get_block_ids("a") == [0, 2, 3, 1] and kv.num_evicted_tokens("a") == 4
    assert kv.stats().in_use == 4
    for t in range(62, 66):                        # then block 2 leaves, 4 tokens later
        decode(kv, a, t)
    assert kv.get_block_ids("a") == [0, 3, 1, 2] and kv.num_evicted_tokens("a") == 8
    kv.free(a)
    kv.check_invariants()
    assert kv.stats().in_use == 0 and kv.num_evicted_tokens("a") == 0


def test_a_failed_allocation_drops_nothing_and_a_step_fits_the_cache():
    kv = KVCacheManager(num_blocks=5, block_size=BS, sinks=4, cache_window=16)
    a, b = req("a", range(8)), req("b", range(100, 104))
    assert kv.allocate_slots(a, 8) == [0, 1]
    a.num_computed_tokens = 8
    assert kv.allocate_slots(b, 4) == [2]
    b.num_computed_tokens = 4
    assert kv.allocate_slots(a, 8) == [3, 4]       # a: 16 tokens, the cache's 4 blocks; the pool is dry
    a.num_computed_tokens = 16
    assert kv.allocate_slots(b, 1) is None         # b needs a block: none free, nothing changes
    assert kv.get_block_ids("b") == [2] and kv.get_block_ids("a") == [0, 1, 3, 4]
    # a drops block 1 for its next block: that frees nothing for others, and takes block 1 back.
    assert kv.allocate_slots(a, 1) == [1] and kv.get_block_ids("a") == [0, 3, 4, 1]
    with pytest.raises(ValueError, match=r"num_new_tokens: 13 tokens of request 'a' do not fit a cache of 4 blocks with 1 sink blocks \(at most 9 a step\)"):
        kv.allocate_slots(a, 13)
    kv.check_invariants()


def test_the_scheduler_caps_steps_and_reports_drops():
    kv = KVCacheManager(num_blocks=8, block_size=BS, sinks=4, cache_window=16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, BS, max_model_len=256)
    r = req("r", range(21), max_tokens=4)         # longer than the cache: chunks of at most 9
    sched.add_request(r)
    seen = []
    for _ in range(3):
        out = sched.schedule()
        (s,) = out.scheduled
        seen.append((s.num_computed_tokens, s.num_new_tokens, s.num_evicted_tokens, s.num_shifted_tokens,
                     s.block_ids, s.sample))
        sched.update_from_output(out, RunnerOutput(sampled_token_ids={"r": [7]} if s.sample else {}))
    assert seen == [(0, 9, 0, 0, (0, 1, 2), False),
                    (9, 9, 4, 4, (0, 2, 1, 3), False),       # block 1 left, then came back last
                    (18, 3, 8, 4, (0, 1, 3, 2), True)]
    out = sched.schedule()                         # decode at text position 21, cache position 13
    (s,) = out.scheduled
    assert (s.num_evicted_tokens, s.num_shifted_tokens, s.block_ids) == (8, 0, (0, 1, 3, 2))
    sched.finish_requests("r", r.status.FINISHED_ABORTED)
    assert kv.stats().in_use == 0
    # Without chunked prefill a prompt longer than one step's cap is refused.
    strict = Scheduler(SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=False), kv, BS, 256)
    with pytest.raises(ValueError, match="prompt: 21 tokens exceed the 9 that one step may run with attention sinks"):
        strict.add_request(req("s", range(21)))


@pytest.mark.parametrize("kwargs, words", [
    (dict(sinks=2, cache_window=16), "sinks: 2 tokens are not a whole number of blocks of 4"),
    (dict(sinks=4, cache_window=8), "cache_window: must hold the 4 sinks and two blocks"),
    (dict(sinks=4), "cache_window: must hold"),
    (dict(sinks=4, cache_window=16, sliding_window=8), "sliding_window: with sinks the kernels see no window"),
    (dict(cache_window=16), "cache_window: applies only with sinks"),
    (dict(sinks=-4, cache_window=16), "sinks: must be a non-negative integer"),
])
def test_bad_sink_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        KVCacheManager(num_blocks=8, block_size=BS, **kwargs)
