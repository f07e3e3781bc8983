"""The runner's step inputs from the row batch kept across steps (engine.row_batch.RowBatch).

Proves: over steps that mix chunked prefill, decode and drafts, with tables and token rows that
grow past their first capacity, and a preempted request readmitted with other blocks (its slot
released, as ``execute`` does for ``preempted_ids``), ``prepare`` with the kept slots gives
exactly the tensors it gives when every token list and table is read afresh; the single-token
(decode) path gives the tensors of the general one; a table that shrank or changed its first
block is rebuilt; a token row whose output shrank is rewritten; slots are reused and grow.
"""
from __future__ import annotations

import torch

from sluice.engine.model_runner import ModelRunner
from sluice.engine.row_batch import RowBatch
from sluice.engine.sampler import RowParams
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.outputs import RunnerOutput
from sluice.engine.scheduler import ScheduledSeq, SchedulerOutput

BS = 4


def _runner() -> ModelRunner:
    return ModelRunner(torch.nn.Identity(), num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4,
                       block_size=BS, vocab_size=100, device=torch.device("cpu"), dtype=torch.float32,
                       attn=None)


def _same(a, b) -> None:
    for name in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens", "block_tables"):
        x, y = getattr(a.meta, name), getattr(b.meta, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.meta.max_query_len, a.meta.max_seq_len, a.meta.query_lens_cpu, a.meta.seq_lens_cpu) == \
           (b.meta.max_query_len, b.meta.max_seq_len, b.meta.query_lens_cpu, b.meta.seq_lens_cpu)


def _seq(req, new, blocks, sample=True):
    return ScheduledSeq(req, new, req.num_computed_tokens, tuple(blocks), sample)


def test_kept_rows_give_the_fresh_inputs_through_growth_drafts_and_preemption():
    runner = _runner()
    seen = []
    runner.forward = lambda batch: seen.append(batch)      # execute() with no model behind it
    runner.sample = lambda scheduled, batch, hidden: RunnerOutput()
    preempted: tuple[str, ...] = ()
    sp = SamplingParams(max_tokens=500, temperature=0.0)
    a = Request("a", list(range(1, 11)), sp)
    b = Request("b", [20, 21, 22], sp)
    c = Request("c", [30, 31, 32, 33, 34], sp)
    tables = {"a": [5, 1], "b": [9], "c": [3, 8]}
    steps = []
    # 1: a's first chunk (no sample), b and c whole prompts.
    steps.append([_seq(a, 6, tables["a"], sample=False), _seq(b, 3, tables["b"]), _seq(c, 5, tables["c"])])
    for n_step in range(60):
        runner.execute(SchedulerOutput(tuple(steps[-1]), 0, preempted, ()))
        _same(seen[-1], runner.prepare(steps[-1]))
        preempted = ()
        for s in steps[-1]:       # the step ran: tokens computed, one sampled
            req = s.request
            req.num_computed_tokens += s.num_new_tokens - len(req.spec_token_ids)
            req.spec_token_ids = []
            if s.sample:
                req.output_token_ids.append(40 + n_step % 50)
        if n_step == 30:          # b is preempted: blocks freed, readmitted with others
            preempted = ("b",)    # (reported by the step that preempts; b runs again after it)
            b.num_computed_tokens = 0
            # The same first block and as many blocks as before: only the drop finds it stale.
            tables["b"] = [9] + [200 + j for j in range(len(tables["b"]) - 1)]
        c.spec_token_ids = [7, 8] if n_step % 3 == 0 else []   # c verifies drafts now and then
        nxt = []
        for req in (a, b, c):
            new = req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens
            need = -(-(req.num_computed_tokens + new) // BS)
            t = tables[req.request_id]
            while len(t) < need:
                t.append(100 + len(t) * 3 + ord(req.request_id[0]))
            nxt.append(_seq(req, new, t))
        steps.append(nxt)
    assert len(tables["a"]) > 16          # past the first capacity of a kept row
    assert len(runner.rows) == 3
    assert runner.rows.tables.shape[1] > 16 and runner.rows.tokens.shape[1] > 64   # grown
    assert all(s.num_new_tokens == 1 for s in steps[-2] if s.request is not c)


def test_the_decode_path_gives_the_general_path_s_tensors():
    runner = _runner()
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    reqs = [Request(f"r{i}", list(range(1, 3 + i)), sp) for i in range(3)]
    for r in reqs:
        r.output_token_ids = [50, 51]
        r.num_computed_tokens = r.num_tokens - 1
    decode = [_seq(r, 1, [4 + i, 7 + i]) for i, r in enumerate(reqs)]
    got = runner.prepare(decode)
    assert got.meta.is_pure_decode
    # The same step with one request recomputing its last two tokens takes the general path.
    reqs[0].num_computed_tokens -= 1
    mixed = runner.prepare([_seq(reqs[0], 2, [4, 7])] + decode[1:])
    assert not mixed.meta.is_pure_decode
    assert torch.equal(mixed.input_ids[1:], got.input_ids) and torch.equal(mixed.positions[1:], got.positions)
    assert torch.equal(mixed.meta.slot_mapping[1:], got.meta.slot_mapping)
    assert got.input_ids.tolist() == [51, 51, 51]
    assert got.positions.tolist() == [r.num_tokens - 1 for r in reqs]
    assert got.meta.slot_mapping.tolist() == [(4 + i if p < BS else 7 + i) * BS + p % BS
                                             for i, p in enumerate(got.positions.tolist())]


def _table(rows: RowBatch, req) -> list[int]:
    slot = rows.slot(req.request_id)
    return rows.tables[slot].tolist()


def test_a_table_whose_first_block_changed_is_rebuilt():
    rows = RowBatch(100)
    req = Request("x", [1, 2, 3], SamplingParams(max_tokens=5))
    for blocks in ((3, 4, 5), (3, 4, 5, 6), (8, 9), (2, 9, 10)):   # grows; shrinks; another first block
        rows.sync([ScheduledSeq(req, 1, 2, blocks, True)])
        assert _table(rows, req)[:len(blocks)] == list(blocks)
        assert not any(_table(rows, req)[len(blocks):])          # zero past the row's blocks
    rows.drop("x")
    assert len(rows) == 0 and not rows.tables.any()


def test_token_rows_follow_outputs_drafts_and_a_shrunk_output():
    rows = RowBatch(100)
    req = Request("x", [1, 2, 3], SamplingParams(max_tokens=50))
    known = lambda: rows.tokens[rows.slot("x"), :req.num_tokens].tolist()
    rows.sync([ScheduledSeq(req, 3, 0, (0,), True)])
    assert known() == [1, 2, 3]
    req.output_token_ids += [7, 8]
    req.spec_token_ids = [9, 9]
    rows.sync([ScheduledSeq(req, 3, 4, (0, 1), True)])           # token 4 plus two drafts
    assert rows.tokens[rows.slot("x"), :7].tolist() == [1, 2, 3, 7, 8, 9, 9]
    req.output_token_ids[:] = [7, 8, 9, 5]                         # one draft accepted, one added
    req.spec_token_ids = []
    rows.sync([ScheduledSeq(req, 1, 6, (0, 1), True)])
    assert known() == [1, 2, 3, 7, 8, 9, 5]
    req.output_token_ids[:] = [7]                                  # a stop string cut the output
    rows.sync([ScheduledSeq(req, 1, 3, (0,), True)])
    assert known() == [1, 2, 3, 7]
    req.output_token_ids += [6, 6]                                 # and it grew again, differently
    rows.sync([ScheduledSeq(req, 1, 5, (0, 1), True)])
    assert known() == [1, 2, 3, 7, 6, 6]


def test_slots_are_reused_grow_and_gather_each_request_s_parameters():
    rows = RowBatch(100, capacity=2)
    params = [SamplingParams(max_tokens=5, temperature=0.1 * i, top_k=i, top_p=1 - 0.01 * i, seed=i or None,
                             repetition_penalty=1 + 0.1 * (i % 3), min_tokens=i % 2, logprobs=i % 4 or None,
                             logit_bias={3: 1.0} if i == 5 else {})
              for i in range(9)]
    reqs = [Request(f"r{i}", [i + 1], sp) for i, sp in enumerate(params)]
    rows.sync([ScheduledSeq(r, 1, 0, (i,), True) for i, r in enumerate(reqs)])
    assert len(rows) == 9 and len(set(rows.slot(r.request_id) for r in reqs)) == 9
    order = [4, 0, 8, 5, 5]
    got = rows.params([rows.slot(reqs[i].request_id) for i in order])
    want = RowParams.of([reqs[i] for i in order], 100)
    for f in RowParams.FIELDS:
        assert getattr(got, f).tolist() == getattr(want, f).tolist(), f
    assert (got.num_logprobs, got.any_bias) == (want.num_logprobs, want.any_bias) and got.any_bias
    freed = rows.slot("r3")
    rows.release("r3")
    again = Request("r3", [1], SamplingParams(max_tokens=5, temperature=0.0))   # a reused id
    rows.sync([ScheduledSeq(again, 1, 0, (1,), True)])
    assert rows.slot("r3") == freed and rows.params([freed]).greedy.tolist() == [True]
