"""Penalties from the tokens each row holds, kept across steps (engine.penalty_rows).

Proves: over a run of steps in which outputs grow, drafts come and go, an output shrinks and a
request id is reused, the tallies kept across steps give the same batch (dense counts and seen
masks) as tallies made afresh, and ``penalize`` gives, bit for bit, the dense formulas over the
whole vocabulary (repetition then presence / frequency) on rows with and without penalties; an
out-of-range token (prompt, output or draft) is refused by name; finished requests are dropped.
"""
from __future__ import annotations

import random

import pytest
import torch

from sluice.engine.penalty_rows import PenaltyRows
from sluice.engine.request import Request
from sluice.engine.sampler import (
    GeneratorCache,
    SamplingBatch,
    apply_presence_frequency,
    apply_repetition_penalty,
    penalize,
)
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.rows import rows_of

VOCAB = 50
PARAMS = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=0.5, frequency_penalty=0.25),
    dict(repetition_penalty=0.8, presence_penalty=-0.3, frequency_penalty=0.7),
    dict(),                                     # no penalty: holds nothing, left untouched
]


def _dense_reference(logits: torch.Tensor, rows, vocab: int) -> torch.Tensor:
    """The penalties over the whole vocabulary from the rows' token lists (the old formulas)."""
    counts = torch.zeros(len(rows), vocab, dtype=torch.int32)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool)
    rep = torch.ones(len(rows))
    pres, freq = torch.zeros(len(rows)), torch.zeros(len(rows))
    for i, r in enumerate(rows):
        sp = r.request.sampling_params
        rep[i], pres[i], freq[i] = sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty
        if sp.repetition_penalty == 1.0 and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0:
            continue
        for t in [*r.request.output_token_ids, *r.drafts]:
            counts[i, t] += 1
        if sp.repetition_penalty != 1.0:
            seen[i, list(r.request.prompt_token_ids)] = True
    seen |= counts > 0
    out = apply_repetition_penalty(logits, seen, rep)
    return apply_presence_frequency(out, counts, pres, freq)


def _rows(reqs, rng):
    """Each request as one row, or with 1-3 drafts as several (some drafts repeat tokens)."""
    rows = []
    for req in reqs:
        drafts = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 1, 3]))]
        rows.extend(rows_of(req, drafts))
    return rows


def test_kept_tallies_equal_fresh_ones_and_the_dense_formulas_over_many_steps():
    rng = random.Random(5)
    torch.manual_seed(5)
    state = PenaltyRows()
    reqs = [Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))],
                    SamplingParams(temperature=0.0, **p)) for i, p in enumerate(PARAMS * 2)]
    for step in range(40):
        for req in reqs:
            req.output_token_ids.extend(rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 2, 4])))
        if step == 20:
            del reqs[1].output_token_ids[-3:]                      # a stop string cut accepted drafts
            reqs[2] = Request("r2", [3, 3, 4], SamplingParams(temperature=0.0, **PARAMS[2]))  # id reused
        rows = _rows(reqs, rng)
        kept = SamplingBatch.from_rows(rows, VOCAB, "cpu", GeneratorCache(), penalty_rows=state)
        fresh = SamplingBatch.from_rows(rows, VOCAB, "cpu", GeneratorCache())
        assert torch.equal(kept.output_counts, fresh.output_counts), step
        assert torch.equal(kept.seen_mask, fresh.seen_mask), step
        logits = torch.randn(len(rows), VOCAB) * 3
        got = penalize(logits, kept)
        assert torch.equal(got, _dense_reference(logits, rows, VOCAB)), step
        assert torch.equal(got, penalize(logits, fresh)), step
        # Rows without a penalty are untouched, bit for bit.
        params = [r.request.sampling_params for r in rows]
        plain = [i for i, sp in enumerate(params) if sp.repetition_penalty == 1.0
                 and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0]
        assert plain and torch.equal(got[plain], logits[plain])
    assert len(state) == 6                   # the requests with a penalty, one tally each
    for req in reqs:
        state.drop(req.request_id)
    assert len(state) == 0


def test_a_tally_grows_past_its_first_capacity():
    state = PenaltyRows()
    req = Request("long", [1], SamplingParams(presence_penalty=1.0, temperature=0.0))
    for t in range(1000):
        req.output_token_ids.append(t % 700)
        batch = SamplingBatch.from_requests([req], 1000, "cpu", penalty_rows=state)
    counts = batch.output_counts[0]
    assert int(counts.sum()) == 1000 and int((counts > 0).sum()) == 700
    assert int(counts[5]) == 2 and int(counts[699]) == 1 and int(counts[700]) == 0


@pytest.mark.parametrize("where", ["prompt", "output", "draft"])
def test_a_token_outside_the_vocabulary_is_refused(where):
    sp = SamplingParams(repetition_penalty=1.2, temperature=0.0)
    req = Request("r", [VOCAB if where == "prompt" else 1], sp)
    req.output_token_ids = [VOCAB + 3 if where == "output" else 2]
    rows = rows_of(req, [VOCAB] if where == "draft" else [])
    for state in (None, PenaltyRows()):
        with pytest.raises(ValueError, match=r"outside the vocabulary \(size 50\)"):
            SamplingBatch.from_rows(rows, VOCAB, "cpu", penalty_rows=state)
