"""The runner's step inputs with block-table rows kept across steps (model_runner.BlockTableRows).

Proves: over steps that mix chunked prefill, decode and drafts, with tables that grow past their
first capacity, and a preempted request readmitted with other blocks (its row dropped, as
``execute`` does for ``preempted_ids``), ``prepare`` with kept rows gives exactly the tensors it
gives when every table is converted afresh; the single-token (decode) path gives the tensors of
the general one; a row whose table shrank or changed its first block is rebuilt.
"""
from __future__ import annotations

import torch

from sluice.engine.model_runner import BlockTableRows, ModelRunner
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
    assert len(runner.block_tables) == 3
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


def test_a_row_whose_first_block_changed_is_rebuilt():
    kept = BlockTableRows()
    assert kept.row("x", (3, 4, 5)).tolist() == [3, 4, 5]
    assert kept.row("x", (3, 4, 5, 6)).tolist() == [3, 4, 5, 6]
    assert kept.row("x", (8, 9)).tolist() == [8, 9]      # shorter: rebuilt
    assert kept.row("x", (2, 9, 10)).tolist() == [2, 9, 10]   # another first block: rebuilt
    kept.drop("x")
    assert len(kept) == 0
