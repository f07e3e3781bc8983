"""The token-budget scheduler, with exact token counts and block ids: the budget split across
requests, chunked prefill, prefill and decode in one step, max_num_seqs, FCFS head-of-line
blocking, preemption by recompute (latest arrival, resumed first with its output tokens), the
waiting request that waits, errors on intake (queue full, prompt larger than the pool), aborts
of waiting and running requests, speculative tokens in the budget and rejected drafts, and a
fake runner loop in which 10 requests on a tiny pool all finish and leave the pool free."""
from __future__ import annotations

import pytest

from sluice.engine.config import SchedulerConfig
from sluice.engine.errors import ContextLengthError, QueueFullError
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.outputs import RunnerOutput
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def make(num_blocks=64, budget=64, max_seqs=8, chunked=True, spec=0, max_waiting=16,
         max_model_len=256) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_waiting=max_waiting,
                          enable_chunked_prefill=chunked, num_speculative_tokens=spec)
    return Scheduler(cfg, kv, BS, max_model_len), kv


def req(rid: str, n: int, max_tokens: int | None = 8, arrival: float | None = None,
        prefix: tuple[int, ...] = (), eos: frozenset[int] = frozenset()) -> Request:
    start = 1000 * sum(map(ord, rid))    # distinct tokens per id: no accidental prefix hits
    tokens = list(prefix) + [start + i for i in range(n - len(prefix))]
    extra = {} if arrival is None else {"arrival_time": arrival}
    return Request(request_id=rid, prompt_token_ids=tokens, eos_token_ids=eos,
                   sampling_params=SamplingParams(max_tokens=max_tokens), **extra)


def run(s: Scheduler, token: int = 7, sampled=None, rejected=None) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake runner that samples ``token`` wherever asked."""
    out = s.schedule()
    if sampled is None:
        sampled = {q.request_id: [token] for q in out.scheduled if q.sample}
    res = RunnerOutput(sampled_token_ids=sampled, num_rejected_tokens=rejected or {})
    changed = s.update_from_output(out, res)
    s.kv.check_invariants()
    return out, changed


def view(out: SchedulerOutput) -> list[tuple]:
    return [(q.request_id, q.num_new_tokens, q.num_computed_tokens, q.block_ids, q.sample)
            for q in out.scheduled]


def test_token_budget_is_split_across_requests():
    s, _ = make(budget=10)
    for rid in ("r0", "r1", "r2"):
        s.add_request(req(rid, 6))
    out, _ = run(s)
    assert view(out) == [("r0", 6, 0, (0, 1), True), ("r1", 4, 0, (2,), False)]
    assert out.num_batched_tokens == 10
    out, changed = run(s)
    assert view(out) == [("r0", 1, 6, (0, 1), True), ("r1", 2, 4, (2, 3), True),
                         ("r2", 6, 0, (4, 5), True)]
    assert out.num_batched_tokens == 9
    assert [r.request_id for r in changed] == ["r0", "r1", "r2"]


def test_chunked_prefill_runs_the_prompt_in_budget_sized_chunks():
    s, kv = make(budget=8)
    r = req("r0", 23, max_tokens=2)
    s.add_request(r)
    chunks = [view(run(s)[0]) for _ in range(4)]
    assert chunks == [[("r0", 8, 0, (0, 1), False)], [("r0", 8, 8, (0, 1, 2, 3), False)],
                      [("r0", 7, 16, (0, 1, 2, 3, 4, 5), True)], [("r0", 1, 23, (0, 1, 2, 3, 4, 5), True)]]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7, 7]
    assert r.finished_time is not None and not s.has_unfinished()
    out = s.schedule()
    assert out.scheduled == () and out.finished_ids == ("r0",)
    assert kv.stats().in_use == 0


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    s, _ = make(budget=10, chunked=False)
    for rid, n in (("r0", 6), ("r1", 6), ("r2", 2)):
        s.add_request(req(rid, n))
    out, _ = run(s)
    assert view(out) == [("r0", 6, 0, (0, 1), True)]          # r1 does not fit; r2 is behind it
    out, _ = run(s)
    assert view(out) == [("r0", 1, 6, (0, 1), True), ("r1", 6, 0, (2, 3), True),
                         ("r2", 2, 0, (4,), True)]
    with pytest.raises(ValueError, match="prompt: 11 tokens exceed max_num_batched_tokens 10"):
        s.add_request(req("big", 11))


def test_prefill_and_decode_share_a_step():
    s, _ = make()
    s.add_request(req("r0", 3))
    run(s)
    s.add_request(req("r1", 5))
    out, _ = run(s)
    assert view(out) == [("r0", 1, 3, (0,), True), ("r1", 5, 0, (1, 2), True)]


def test_max_num_seqs_bounds_the_running_set():
    s, _ = make(max_seqs=2)
    s.add_request(req("r0", 2, max_tokens=1))
    s.add_request(req("r1", 2))
    s.add_request(req("r2", 2))
    out, _ = run(s)
    assert [q.request_id for q in out.scheduled] == ["r0", "r1"]
    assert (s.num_running, s.num_waiting) == (1, 1)          # r0 finished after one token
    out, _ = run(s)
    assert [q.request_id for q in out.scheduled] == ["r1", "r2"]
    assert out.finished_ids == ("r0",)


def test_waiting_head_that_does_not_fit_blocks_the_queue():
    s, _ = make(num_blocks=4)
    s.add_request(req("r0", 12))                              # 3 blocks
    s.add_request(req("r1", 8))                               # needs 2, 1 left
    s.add_request(req("r2", 2))                               # would fit, but is behind r1
    out, _ = run(s)
    assert view(out) == [("r0", 12, 0, (0, 1, 2), True)]
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]


def test_preemption_takes_the_latest_arrival_and_resumes_it_first_with_its_output():
    s, _ = make(num_blocks=4)
    r0, r1 = req("r0", 8, max_tokens=2, arrival=0.0), req("r1", 8, max_tokens=4, arrival=1.0)
    for r in (r0, r1, req("r2", 3, arrival=2.0)):
        s.add_request(r)
    out, _ = run(s)
    assert view(out) == [("r0", 8, 0, (0, 1), True), ("r1", 8, 0, (2, 3), True)]
    first_time = r1.first_scheduled_time
    out, _ = run(s)                                           # r0 needs a third block: none free
    assert view(out) == [("r0", 1, 8, (0, 1, 3), True)]
    assert out.preempted_ids == ("r1",)
    assert (r1.status, r1.num_computed_tokens, r1.output_token_ids, r1.num_preemptions) == \
        (RequestStatus.PREEMPTED, 0, [7], 1)
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]
    assert r0.status == RequestStatus.FINISHED_LENGTH
    out, _ = run(s)
    # r1 resumes first: its first block is still cached (4 tokens), its tail was evicted by r0.
    assert view(out) == [("r1", 5, 4, (2, 3, 1), True), ("r2", 3, 0, (0,), True)]
    assert out.finished_ids == ("r0",)
    assert r1.output_token_ids == [7, 7] and r1.first_scheduled_time == first_time
    assert r1.num_cached_tokens == 0                          # set on the first admission only
    assert s.stats().num_preemptions == 1


def test_victim_is_chosen_by_arrival_time_not_by_position():
    s, _ = make(num_blocks=6)
    for rid, arrival in (("r0", 0.0), ("r1", 1.0), ("r2", 0.5)):
        s.add_request(req(rid, 8, arrival=arrival))
    run(s)                                                    # [0, 1], [2, 3], [4, 5]
    out, _ = run(s)
    assert out.preempted_ids == ("r1",)
    assert view(out) == [("r0", 1, 8, (0, 1, 3), True), ("r2", 1, 8, (4, 5, 2), True)]


def test_the_only_unscheduled_request_waits_with_its_blocks():
    s, kv = make(num_blocks=4)
    r0, r1 = req("r0", 4, max_tokens=3, arrival=0.0), req("r1", 8, arrival=1.0)
    s.add_request(r0)
    s.add_request(r1)
    run(s)                                                    # r0 [0], r1 [1, 2], free [3]
    out, _ = run(s)                                           # r0 takes 3; r1 finds none
    assert view(out) == [("r0", 1, 4, (0, 3), True)]
    assert out.preempted_ids == () and r1.status == RequestStatus.RUNNING
    assert kv.get_block_ids("r1") == [1, 2]
    run(s)                                                    # r0 finishes, freeing 0 and 3
    out, _ = run(s)
    assert view(out) == [("r1", 1, 8, (1, 2, 3), True)]


def test_a_request_alone_that_outgrows_the_pool_finishes_by_length():
    s, kv = make(num_blocks=2)
    r = req("r0", 8, max_tokens=10)
    s.add_request(r)
    run(s)
    out, changed = run(s)
    assert out.scheduled == () and out.finished_ids == ("r0",) and changed == []
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7]
    assert kv.stats().in_use == 0 and not s.has_unfinished()


def test_intake_errors_name_the_field_and_change_nothing():
    s, _ = make(num_blocks=2, max_waiting=2, max_model_len=32)
    with pytest.raises(ValueError, match="prompt: 9 tokens need 3 KV blocks of 4 tokens, the pool has 2"):
        s.add_request(req("big", 9))
    with pytest.raises(ContextLengthError, match="prompt: 32 tokens"):
        s.add_request(req("long", 32))
    with pytest.raises(ValueError, match="prompt: must hold"):
        s.add_request(Request(request_id="empty", prompt_token_ids=[], sampling_params=SamplingParams()))
    s.add_request(req("a", 8))
    with pytest.raises(ValueError, match="request_id: 'a'"):
        s.add_request(req("a", 2))
    s.add_request(req("b", 2))
    with pytest.raises(QueueFullError, match=r"waiting queue is full \(max_waiting=2\)"):
        s.add_request(req("c", 2))
    assert s.num_waiting == 2 and s.get_request("c") is None and s.get_request("a") is not None


def test_abort_of_waiting_and_running_requests_frees_blocks():
    s, kv = make(num_blocks=3)
    r0, r1 = req("r0", 8), req("r1", 8)
    s.add_request(r0)
    s.add_request(r1)
    run(s)                                                    # r0 runs, r1 waits (no room)
    assert kv.stats().in_use == 2 and s.num_waiting == 1
    done = s.finish_requests(["r1", "r0", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert done == [r1, r0]
    assert r0.status == r1.status == RequestStatus.FINISHED_ABORTED
    assert kv.stats().in_use == 0 and not s.has_unfinished()
    assert s.finish_requests("r0", RequestStatus.FINISHED_ABORTED) == []
    assert s.schedule().finished_ids == ("r1", "r0")
    with pytest.raises(ValueError, match="status"):
        s.finish_requests("x", RequestStatus.RUNNING)
    kv.check_invariants()


def test_abort_while_the_step_runs_drops_its_result():
    s, kv = make()
    r = req("r0", 5)
    s.add_request(r)
    out = s.schedule()
    s.finish_requests("r0", RequestStatus.FINISHED_STOPPED)
    assert s.update_from_output(out, RunnerOutput(sampled_token_ids={"r0": [7]})) == []
    assert r.output_token_ids == [] and kv.stats().in_use == 0


def test_token_stop_finishes_and_frees():
    s, kv = make()
    r = req("r0", 5, eos=frozenset({7}))
    s.add_request(r)
    _, changed = run(s)
    assert changed == [r] and r.status == RequestStatus.FINISHED_STOPPED
    assert kv.stats().in_use == 0


def test_context_window_ends_generation():
    s, _ = make(max_model_len=12)
    r = req("r0", 8, max_tokens=None)
    s.add_request(r)
    while s.has_unfinished():
        run(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 4


def test_spec_tokens_count_in_the_budget_and_are_cut_to_fit():
    s, _ = make(budget=6, spec=3)
    r0, r1 = req("r0", 4, max_tokens=20), req("r1", 2, max_tokens=20)
    s.add_request(r0)
    s.add_request(r1)
    run(s)
    r0.spec_token_ids = [1, 2, 3, 4, 5]                       # more than the config allows
    r1.spec_token_ids = [4, 5, 6]
    out = s.schedule()
    # r0: 1 + 3 drafts; r1 gets the 2 left: its real token and one draft.
    assert [(q.request_id, q.num_new_tokens, q.num_computed_tokens) for q in out.scheduled] == \
        [("r0", 4, 4), ("r1", 2, 2)]
    assert (r0.spec_token_ids, r1.spec_token_ids) == ([1, 2, 3], [4])
    assert out.num_batched_tokens == 6
    res = RunnerOutput(sampled_token_ids={"r0": [1, 2, 3, 8], "r1": [9]}, num_rejected_tokens={"r1": 1})
    s.update_from_output(out, res)
    assert (r0.num_computed_tokens, r0.num_tokens, r0.spec_token_ids) == (8, 9, [])
    assert (r1.num_computed_tokens, r1.num_tokens, r1.output_token_ids) == (3, 4, [7, 9])


def test_rejected_drafts_roll_back_and_lookahead_reserves_slots():
    s, _ = make(spec=3)
    r = req("r0", 5, max_tokens=20)
    s.add_request(r)
    out, _ = run(s)
    assert view(out) == [("r0", 5, 0, (0, 1), True)]           # 5 tokens + 3 lookahead slots
    r.spec_token_ids = [11, 12, 13]
    out = s.schedule()
    assert view(out) == [("r0", 4, 5, (0, 1, 2), True)]
    bad = RunnerOutput(sampled_token_ids={"r0": [11, 21]}, num_rejected_tokens={"r0": 4})
    with pytest.raises(ValueError, match="num_rejected_tokens: 4"):
        s.update_from_output(out, bad)
    assert (r.num_computed_tokens, r.num_tokens) == (5, 6)    # the bad result changed nothing
    s.update_from_output(out, RunnerOutput(sampled_token_ids={"r0": [11, 21]}, num_rejected_tokens={"r0": 2}))
    assert (r.num_computed_tokens, r.output_token_ids, r.spec_token_ids) == (7, [7, 11, 21], [])
    out, _ = run(s)
    assert view(out) == [("r0", 1, 7, (0, 1, 2), True)]


def test_runner_results_that_do_not_match_the_schedule_are_rejected():
    s, _ = make(budget=4)
    s.add_request(req("r0", 6))
    out = s.schedule()                                        # a chunk: nothing to sample
    with pytest.raises(ValueError, match="sampled_token_ids: request 'r0' has 1 tokens but sample=False"):
        s.update_from_output(out, RunnerOutput(sampled_token_ids={"r0": [7]}))


def test_ten_requests_on_a_tiny_pool_all_finish_and_free_the_pool():
    s, kv = make(num_blocks=6, budget=16, max_seqs=4)
    shared = (500, 501, 502, 503)                             # odd ones share their first block
    reqs = [req(f"r{i}", 3 + i, max_tokens=3 + i % 5, prefix=shared if i % 2 else ())
            for i in range(10)]
    for r in reqs:
        s.add_request(r)
    finished_ids: list[str] = []
    for _ in range(500):
        if not s.has_unfinished():
            break
        out, _ = run(s)
        finished_ids += out.finished_ids
        stats = kv.stats()
        assert stats.free + stats.cached + stats.in_use == stats.total == 6
    finished_ids += s.schedule().finished_ids
    assert not s.has_unfinished()
    assert sorted(finished_ids) == sorted(r.request_id for r in reqs)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [7] * r.sampling_params.max_tokens
    assert s.num_preemptions > 0
    assert kv.stats().in_use == 0 and kv.num_free_blocks == 6
    kv.check_invariants()
