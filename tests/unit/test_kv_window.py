"""The KV manager with a sliding window (issue 43), with exact block ids: blocks wholly behind a
request's window go back to the pool (oldest first, still cached), the table keeps its length, a
request holds at most its window's blocks and the step's, nothing is released twice or leaked,
prefix hits behind the window are not taken, a block whose parent entry was released is never
registered, and the scheduler admits prompts longer than the pool when their window fits."""
from __future__ import annotations

import pytest

from sluice.engine.config import SchedulerConfig
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.outputs import RunnerOutput
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler

BS = 4


def req(rid: str, tokens, max_tokens: int = 64) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=max_tokens))


def counts(kv: KVCacheManager) -> tuple[int, int, int]:
    s = kv.stats()
    return s.free, s.cached, s.in_use


def step(kv: KVCacheManager, r: Request, token: int, num_new: int = 1) -> list[int] | None:
    """One decode step: the token sampled by the previous step is computed now."""
    new = kv.allocate_slots(r, num_new)
    r.num_computed_tokens += num_new
    r.append_output_token(token)
    kv.check_invariants()
    return new


def test_blocks_behind_the_window_are_released_oldest_first_and_stay_cached():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=6)
    a = req("a", range(10))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    a.num_computed_tokens = 10
    a.append_output_token(50)
    assert counts(kv) == (13, 0, 3)
    # Position 10's window starts at 5: block 0 (positions 0-3) is never read again.
    assert step(kv, a, 51) == []
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.num_held_blocks("a") == 2
    assert counts(kv) == (13, 1, 2)                       # block 0 is cached, not in use
    assert kv.pool.blocks[0].block_hash is not None
    for t in range(52, 55):                                # positions 11..13: block 1 leaves at 13
        step(kv, a, t)
    assert kv.get_block_ids("a") == [0, 1, 2, 3] and kv.num_held_blocks("a") == 2
    # The oldest released block is the first cached block to be evicted.
    cached = [b.block_id for b in kv.pool.free_queue if b.block_hash is not None]
    assert cached == [0, 1]
    kv.free(a)
    kv.check_invariants()
    assert counts(kv)[2] == 0


def test_a_long_generation_holds_at_most_its_window_and_leaks_nothing():
    window = 9
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=window)
    a = req("a", range(7), max_tokens=200)
    kv.allocate_slots(a, 7)
    a.num_computed_tokens = 7
    a.append_output_token(1000)
    bound = -(-(window - 1 + 1) // BS) + 1
    for t in range(150):                                   # 150 positions in a pool of 32 slots
        assert step(kv, a, 1001 + t) is not None
        assert kv.num_held_blocks("a") <= bound
        # The block holding the next query's first visible position is held.
        first_seen = max(0, a.num_computed_tokens - window + 1) // BS
        assert first_seen >= kv._req_num_released["a"]
    assert len(kv.get_block_ids("a")) == -(-a.num_computed_tokens // BS)   # the table kept its length
    kv.free(a)
    kv.check_invariants()
    assert counts(kv)[2] == 0 and sum(counts(kv)) == 8


def test_without_a_window_nothing_is_released():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = req("a", range(10))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    a.append_output_token(50)
    for t in range(20):
        step(kv, a, 51 + t)
    assert kv.num_held_blocks("a") == len(kv.get_block_ids("a")) == 8
    assert kv.num_out_of_window(1000) == 0 and kv.max_blocks_for(100, 10) == 25


def test_a_prefix_hit_behind_the_window_is_not_taken():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=5)
    prompt = list(range(17))
    a = req("a", prompt)
    kv.allocate_slots(a, 17)
    a.num_computed_tokens = 17
    kv.free(a)
    b = req("b", prompt)
    ids, hit = kv.get_computed_blocks(b)
    assert (ids, hit) == ([0, 1, 2, 3], 16)                # every full block, cached
    assert kv.allocate_slots(b, 1, ids, hit) == [4]
    # Position 16's window starts at 12: blocks 0-2 are not taken, block 3 and the new one are.
    assert kv.get_block_ids("b") == [0, 1, 2, 3, 4] and kv.num_held_blocks("b") == 2
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [0, 0, 0, 1, 1]
    kv.check_invariants()
    kv.free(b)
    kv.check_invariants()
    assert counts(kv)[2] == 0


def test_a_block_whose_parent_entry_was_released_is_not_registered():
    # A window shorter than a block: block 0 leaves the window before block 1 is full, and may be
    # someone else's by then, so block 1 cannot name it as its parent.
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=2)
    a = req("a", range(4))
    kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    a.append_output_token(10)
    assert kv.pool.blocks[0].block_hash is not None
    for t in range(11, 16):
        step(kv, a, t)
    assert kv._req_num_released["a"] == 1 and kv.num_held_blocks("a") == 2
    assert kv.pool.blocks[1].block_hash is None            # full, but its parent entry is gone
    kv.free(a)
    kv.check_invariants()


def test_a_bad_window_is_refused_by_name():
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match="sliding_window: must be None or a positive integer"):
            KVCacheManager(num_blocks=4, block_size=BS, sliding_window=bad)


def _scheduler(num_blocks: int, window: int | None, budget: int = 4, spec: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, sliding_window=window)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_waiting=8, enable_chunked_prefill=True,
                          num_speculative_tokens=spec)
    return Scheduler(cfg, kv, BS, max_model_len=512)


def _run(s: Scheduler, token: int = 7, rejected: dict | None = None):
    out = s.schedule()
    sampled = {q.request_id: [token] for q in out.scheduled if q.sample}
    s.update_from_output(out, RunnerOutput(sampled_token_ids=sampled, num_rejected_tokens=rejected or {}))
    s.kv.check_invariants()
    return out


def test_the_scheduler_admits_a_prompt_longer_than_the_pool_when_its_window_fits():
    prompt = list(range(1000, 1040))                       # 40 tokens: 10 blocks, the pool has 6
    with pytest.raises(ValueError, match="need 10 KV blocks of 4 tokens, the pool has 6"):
        _scheduler(6, None).add_request(req("a", prompt, max_tokens=30))
    s = _scheduler(6, 8)
    assert s.kv.max_blocks_for(40, 4) == 4                 # ceil((8 - 1 + 4) / 4) + 1
    a = req("a", prompt, max_tokens=30)
    s.add_request(a)
    while s.has_unfinished():
        out = _run(s)
        assert all(s.kv.num_held_blocks(q.request_id) <= 4 for q in out.scheduled if not q.request.is_finished)
    assert len(a.output_token_ids) == 30 and s.kv.stats().in_use == 0


def test_rejected_drafts_never_need_a_released_block():
    window = 6
    s = _scheduler(32, window, budget=16, spec=3)
    a = req("a", range(2000, 2009), max_tokens=60)
    s.add_request(a)
    _run(s)
    for i in range(12):
        a.spec_token_ids[:] = [1, 2, 3]
        out = s.schedule()
        (seq,) = out.scheduled
        drafts = seq.num_computed_tokens + seq.num_new_tokens - a.num_tokens
        rejected = drafts if i % 2 else min(1, drafts)
        tokens = a.spec_token_ids[:drafts - rejected] + [9]      # the accepted drafts, then a bonus token
        s.update_from_output(out, RunnerOutput(sampled_token_ids={"a": tokens}, num_rejected_tokens={"a": rejected}))
        s.kv.check_invariants()
        assert a.num_computed_tokens >= seq.num_computed_tokens + 1
        # Every block the next step's queries read is still held.
        first_seen = max(0, a.num_computed_tokens - window + 1) // BS
        assert first_seen >= s.kv._req_num_released["a"]
    assert s.kv._req_num_released["a"] > 0
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.kv.check_invariants()
    assert s.kv.stats().in_use == 0
