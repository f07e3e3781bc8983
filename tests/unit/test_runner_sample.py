"""The runner's last stage: one sampling batch for every logit row of a step, the shared stages
(penalties, bias, min_tokens and grammar masks) run once over all of them, then a draw for the
rows without drafts and verification for the rest (model_runner.ModelRunner.sample).

Proves: a step that mixes plain rows (seeded and greedy, penalised, with logprobs) and drafted
ones (a greedy chain with a penalty, a seeded chain through rejection sampling) gives exactly
the tokens, logprobs and rejections of the plain rows sampled alone and the drafted rows
verified alone, each with its own sampling batch (the path before one batch served both), and
that the parameters it reads come from the kept slots (a request whose slot holds other
parameters samples by them).
"""
from __future__ import annotations

import torch

from sluice.engine.model_runner import ModelRunner
from sluice.engine.penalty_rows import PenaltyRows
from sluice.engine.request import Request
from sluice.engine.sampler import GeneratorCache, Sampler, SampleRow, SamplingBatch
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import ScheduledSeq
from sluice.engine.spec_decode.rows import rows_of
from sluice.engine.spec_decode.verify import DraftedSeq, verify

VOCAB, BS = 64, 4


class _LogitsAreHidden(torch.nn.Module):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _runner() -> ModelRunner:
    return ModelRunner(_LogitsAreHidden(), num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8,
                       block_size=BS, vocab_size=VOCAB, device=torch.device("cpu"), dtype=torch.float32,
                       attn=None)


def _requests() -> list[Request]:
    specs = [
        ("plain-seeded", SamplingParams(max_tokens=9, temperature=0.9, seed=5, repetition_penalty=1.4, logprobs=2)),
        ("chain-greedy", SamplingParams(max_tokens=9, temperature=0.0, frequency_penalty=0.7, logprobs=1)),
        ("plain-greedy", SamplingParams(max_tokens=9, temperature=0.0, logit_bias={3: 5.0})),
        ("chain-seeded", SamplingParams(max_tokens=9, temperature=1.1, seed=11, top_k=20, min_tokens=8)),
    ]
    reqs = []
    for i, (rid, sp) in enumerate(specs):
        r = Request(rid, [1 + i, 2 + i, 3 + i], sp, eos_token_ids=(0,))
        r.output_token_ids = [4 + i, 5, 4 + i]
        r.num_computed_tokens = r.num_tokens - 1
        reqs.append(r)
    reqs[1].spec_token_ids = [7, 9]
    reqs[3].spec_token_ids = [2, 6, 5]
    return reqs


def _scheduled(reqs):
    return [ScheduledSeq(r, 1 + len(r.spec_token_ids), r.num_computed_tokens, (0, 1, 2), True) for r in reqs]


def test_one_batch_for_plain_and_drafted_rows_equals_each_on_its_own():
    for trial in range(5):
        torch.manual_seed(trial)
        reqs = _requests()
        runner = _runner()
        scheduled = _scheduled(reqs)
        batch = runner.prepare(scheduled, runner.rows)
        hidden = torch.randn(int(batch.input_ids.numel()), VOCAB) * 3
        hidden[:, 7] += 6.0     # the greedy chain's first draft is often right
        got = runner.sample(scheduled, batch, hidden)

        logits = hidden[batch.sample_rows]
        gens, tallies = GeneratorCache(), PenaltyRows()
        plain, chains = [reqs[0], reqs[2]], [reqs[1], reqs[3]]
        plain_rows = [0, 4]                       # each sequence's first logit row: 0, 1-3, 4, 5-8
        sb = SamplingBatch.from_rows([SampleRow(r) for r in plain], VOCAB, "cpu", gens, None, tallies)
        so = Sampler()(logits[plain_rows], sb)
        assert [got.sampled_token_ids[r.request_id] for r in plain] == [[t] for t in so.token_ids.tolist()]
        assert got.logprobs["plain-seeded"][0].logprob == so.logprobs[0].item()
        rows, seqs = [], []
        for r in chains:
            seqs.append(DraftedSeq(r, len(rows), list(r.spec_token_ids), None))
            rows.extend(rows_of(r, list(r.spec_token_ids)))
        drafted = torch.cat([logits[1:4], logits[5:]])
        vb = SamplingBatch.from_rows(rows, VOCAB, "cpu", gens, None, tallies)
        for s, v in zip(seqs, verify(drafted, vb, seqs, gens)):
            rid = s.request.request_id
            assert got.sampled_token_ids[rid] == v.token_ids, (trial, rid)
            assert got.num_rejected_tokens[rid] == v.num_rejected
            assert (got.logprobs.get(rid) is None) == (v.logprobs is None)
            if v.logprobs is not None:
                assert [(t.token_id, t.logprob, t.top) for t in got.logprobs[rid]] == \
                       [(t.token_id, t.logprob, t.top) for t in v.logprobs]


def test_parameters_come_from_the_request_s_slot():
    hidden = torch.zeros(1, VOCAB)
    hidden[0, 5] = 1.0
    hidden[0, 9] = 0.99            # the repetition penalty (token 5 was output) makes 9 the most likely
    for repetition, want in ((None, 9), (1.0, 5)):
        reqs = _requests()[:1]     # sampling at T=0.9 with repetition_penalty 1.4
        runner = _runner()
        scheduled = _scheduled(reqs)
        batch = runner.prepare(scheduled, runner.rows)
        slot = runner.rows.slot(reqs[0].request_id)
        runner.rows._params["greedy"][slot] = True           # the slot, not the request, is read
        if repetition is not None:
            runner.rows._params["repetition"][slot] = repetition
        assert runner.sample(scheduled, batch, hidden).sampled_token_ids[reqs[0].request_id] == [want]


def test_a_steady_batch_reuses_its_gather_and_a_new_request_renews_it():
    reqs = _requests()
    runner = _runner()
    rows = runner.rows
    rows.sync(_scheduled(reqs[:2]))
    slots = [rows.slot(r.request_id) for r in reqs[:2]]
    first = rows.params(slots)
    assert rows.params(slots) is first                       # nothing changed hands
    rows.release(reqs[1].request_id)
    rows.sync(_scheduled(reqs[2:3]))                         # another request takes the freed slot
    assert rows.slot(reqs[2].request_id) == slots[1]
    again = rows.params(slots)
    assert again is not first and again.greedy.tolist() == [False, True]   # plain-greedy's own parameters
